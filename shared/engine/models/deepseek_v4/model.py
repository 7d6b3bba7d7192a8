"""DeepSeek-V4 forward: chunked prefill and batched decode over the two-tier cache (cache.py).

One layer, for the T rows of a step (several sequences' chunks back to back):

    streams (T, hc, D) --mHC pre--> x --norm--> attention --mHC post + Sinkhorn mix--> streams
                       --mHC pre--> x --norm--> MoE        --mHC post + Sinkhorn mix--> streams

The parts, one module each: weights.py (what the checkpoint gives), mhc.py (hyper-connections and the norm),
attention.py (sliding window + compressed entries, the compressors and CSA's indexer), moe.py (routing and
experts), mtp.py (the draft layer). Everything numerically sensitive (norms, softmax, Sinkhorn, routing) runs
in float32, whatever the weight dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shared.engine.attention import AttentionMetadata
from shared.engine.config import ModelConfig
from shared.engine.kv_cache import CacheSpec
from shared.engine.models.deepseek_v4 import mtp
from shared.engine.models.deepseek_v4.attention import Attention
from shared.engine.models.deepseek_v4.cache import RequestState, V4Cache
from shared.engine.models.deepseek_v4.decode import DecodeBatch
from shared.engine.models.deepseek_v4.graphs import V4DecodeGraphs
from shared.engine.models.deepseek_v4.mhc import hc_head, hc_post, hc_pre, rms
from shared.engine.models.deepseek_v4.moe import moe
from shared.engine.models.deepseek_v4.spec import DeepseekV4Spec
from shared.engine.models.deepseek_v4.weights import HcParams, load
from shared.engine.ops import Ops
from shared.engine.quant import linear

if TYPE_CHECKING:
    from shared.engine.parallel.ep_moe import ExpertParallel


class DeepseekV4:
    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
        ops: Ops | None = None, held_experts: Sequence[int] | None = None,
    ) -> None:
        """held_experts: the main layers' routed experts this process keeps (a rank of an expert-parallel worker,
        parallel/servers.py; their stacks in this order), None = all."""
        spec: DeepseekV4Spec = config.spec
        self.config, self.spec, self.dtype, self.device = config, spec, dtype, device
        self.block_tokens = spec.block_tokens
        self.cache: V4Cache | None = None
        # Triton kernels where they replace long chains of tiny torch ops (the rest is the torch path)
        self.triton = ops is not None and ops.name == "triton" and spec.hc_mult & (spec.hc_mult - 1) == 0
        self.held_experts = list(range(spec.num_experts) if held_experts is None else held_experts)
        # FP8 / FP4 kept for the kernels
        self.weights = load(spec, weights, device, dtype, quantized=self.triton, held=held_experts)
        self.layers = self.weights.layers
        self.mtp = self.weights.mtp
        self.attention = Attention(spec, device, triton=self.triton)
        # (layers, experts) int64: token-expert pairs routed since load, accumulated on the device by every forward
        # of the main layers (not the MTP draft layer's); the worker reads it every few seconds (expert placement)
        self.expert_counts = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.int64, device=device)
        # set by parallel/ep_moe.py when the worker spans several ranks: the main layers' routed experts live
        # in its per-rank slots and every MoE layer is an exchange between the ranks
        self.expert_parallel: ExpertParallel | None = None

    # --- the cache ----------------------------------------------------------------------------------------------

    def cache_spec(self, block_tokens: int, dtype: torch.dtype) -> CacheSpec:
        """dtype: the cache's (kv_quant.kv_dtype: the model's, bfloat16, or FP8's packed rows)."""
        probe = V4Cache(self.spec, 1, torch.device("cpu"), self.dtype, mtp=self.mtp is not None, slots=0,
                        kv_dtype=dtype)
        return CacheSpec(None, probe.state_bytes, block_bytes=probe.block_bytes, block_tokens=self.block_tokens,
                         kv_dtype=str(dtype).removeprefix("torch."))

    def make_cache(self, num_blocks: int, max_running: int = 64, kv_dtype: torch.dtype | None = None) -> V4Cache:
        """Per-request state slots: max_running running requests and as many again held after they finish
        (awaiting their KV store); more than that fails clearly at admission. kv_dtype: as cache_spec's."""
        self.cache = V4Cache(self.spec, num_blocks, self.device, self.dtype, mtp=self.mtp is not None,
                             slots=2 * max_running, kv_dtype=kv_dtype)
        return self.cache

    # --- forward ------------------------------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: V4Cache,
        fed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> residual streams (T, hc, D) before the head's collapse. An id -(r + 1) is
        a placeholder for fed[r], a token sampled by the step still in flight."""
        # a span's first position is its context less its query rows (no read-back from the device)
        states = [kv.state(span.request_id, span.context_len - span.q_len) for span in meta.spans]
        batch = self.attention.decode_batch(meta, states, positions, kv)
        streams = self.layers_forward(input_ids, positions, meta, states, kv, batch, fed)
        for span, state in zip(meta.spans, states):
            state.length = span.context_len
        return streams

    def layers_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
                       states: list[RequestState], kv: V4Cache, batch: DecodeBatch | None,
                       fed: torch.Tensor | None) -> torch.Tensor:
        """The layers over the step's rows: per sequence (meta, states), or as one decode batch. Reads nothing
        back to the host on the batched path (a CUDA graph captures it: graphs.py)."""
        s = self.spec
        if fed is not None:  # always the select, never a test of the ids: that would wait for the device
            input_ids = torch.where(input_ids < 0, fed[(-input_ids - 1).clamp(min=0, max=fed.shape[0] - 1)],
                                    input_ids)
        x = self.weights.embed[input_ids]
        streams = x.unsqueeze(1).expand(-1, s.hc_mult, -1).contiguous()  # (T, hc, D)
        angles = self.attention.angles(positions)
        # a captured decode step's padding rows (the scratch slot, graphs.py) route too: they are not counted
        real = (torch.ones(input_ids.shape[0], dtype=torch.int64, device=x.device) if batch is None
                else (batch.slots != kv.scratch_slot).long())  # (T,)
        ep = self.expert_parallel
        if ep is not None and ep.announce is not None:
            ep.announce()  # the other ranks join this forward's exchanges
        for i, layer in enumerate(self.layers):
            post, comb, h = hc_pre(s, streams, layer.hc_attn, self.triton)
            out = self.attention(i, layer, rms(h, layer.attn_norm, s.rms_eps), positions, angles, meta, states, kv,
                                 batch)
            streams = hc_post(out, post, comb, streams)
            post, comb, h = hc_pre(s, streams, layer.hc_ffn, self.triton)
            h = rms(h, layer.ffn_norm, s.rms_eps)
            out = (moe(s, layer, h, input_ids, self.triton, self.expert_counts[i], real) if ep is None
                   else ep.moe(s, i, layer, h, input_ids, self.expert_counts[i], real))
            streams = hc_post(out, post, comb, streams)
        return streams

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert's weights as loaded (FP4 with its scales, or dense), for placement."""
        ex = self.layers[0].experts if self.expert_parallel is None else self.expert_parallel.local[0]
        return (ex.w13.nbytes + ex.w2.nbytes) // ex.w13.shape[0]

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """streams (N, hc, D) of the rows we sample from -> (N, V) float32."""
        return self.head_logits(streams, self.weights.hc_head, self.weights.norm)

    def head_logits(self, streams: torch.Tensor, hc: HcParams, norm: torch.Tensor) -> torch.Tensor:
        x = hc_head(self.spec, streams, hc)
        return linear(rms(x, norm, self.spec.rms_eps), self.weights.head).float()

    # --- CUDA graphs (graphs.py) ------------------------------------------------------------------------------

    def decode_graphs(self, kv: V4Cache, device: torch.device, max_tokens: int, sizes: tuple[int, ...],
                      fed: torch.Tensor) -> V4DecodeGraphs | None:
        """Decode steps replayed from graphs: only on the batched path, whose kernels read nothing back."""
        if not self.attention.batched or kv.cap_swa < self.spec.window:
            return None
        return V4DecodeGraphs(self, kv, device, max_tokens, sizes, fed)

    # --- multi-token prediction (mtp.py) ------------------------------------------------------------------------

    def mtp_advance(self, kv: V4Cache, request_id: str, start: int, streams: torch.Tensor, next_tokens: list[int]
                    ) -> torch.Tensor | None:
        return mtp.advance(self, kv, request_id, start, streams, next_tokens)

    def mtp_draft(self, kv: V4Cache, request_id: str, out: torch.Tensor, position: int, k: int,
                  floor: float = 0.0) -> tuple[list[int], list[float]]:
        return mtp.draft(self, kv, request_id, out, position, k, floor)
