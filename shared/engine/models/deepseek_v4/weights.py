"""DeepSeek-V4's weights as the forward reads them: one frozen record per layer, built from the loader's tensors.

Expert weights are stacked per layer ((E, 2 I, D) gate rows then up rows, and (E, D, I)), so a batch can index
them by expert id. Everything numerically sensitive (norm weights, mHC parameters, sinks, position biases)
is kept in float32 whatever the weight dtype.

With `quantized` (the model runs its Triton kernels) the linears a kernel reads quantized stay as the checkpoint
gave them: FP8 attention projections, compressors, indexer, shared expert, MTP projections and head (kernels/
fp8_gemm.py), FP4 routed experts (kernels/moe.py). Anything else quantized (an FP8 routed expert, a router, an
embedding) is dequantized here, as every weight is on the torch path.

The attention's linears that read one input are merged after loading (merged_linear.py; the checkpoint's names
are unchanged): one GEMM for what were up to seven launches on x (two GEMMs with FP8, below), one for q_res:

    Layer.wx  reads the block input x:  wq_a | wkv                                               (every layer)
              | compressor.wkv | compressor.wgate                                                (HCA, CSA)
              | indexer.compressor.wkv | indexer.compressor.wgate | indexer.weights_proj         (CSA)
    Layer.wq  reads the query's low-rank residual q_res:  wq_b | indexer.wq_b                    (the latter CSA)

Dense (the torch path, or a checkpoint in bfloat16): all parts of each merge into one weight. FP8 kept: parts
merge only when their rows are whole scale blocks of one layout (dense parts merge among themselves, apart); at
V4-Flash's widths, all shipped FP8, that is all of wx but indexer.weights_proj (64 rows, one partial block: its
own GEMM), and both of wq. wq runs merged at one input row only: beyond, its column views would be copied (rms
and rotate_ want rows of one stride), 0.5 GiB for an 8K chunk's queries, so it runs one GEMM per part on row
views of the merged weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.models.deepseek_v4.spec import CSA, SLIDING, DeepseekV4Spec
from shared.engine.merged_linear import MergedLinear, merge
from shared.engine.quant import Fp4Weight, Fp8Weight, Weight, as_dense, cat_rows


@dataclass(frozen=True)
class Compressor:
    """Its projections wkv and wgate, (C, D) each (C = 2 d for CSA: Ca | Cb; d for HCA), are parts of Layer.wx."""

    ape: torch.Tensor  # (m, C) float32 position bias inside a window
    norm: torch.Tensor  # (d,) float32
    ratio: int
    overlap: bool  # CSA: entry w also mixes window w - 1


@dataclass(frozen=True)
class Indexer:
    """CSA's lightning indexer; its projections are parts of the layer's merged linears: wq_b (heads *
    index_head_dim, q_lora_rank) of Layer.wq, weights_proj (heads, D) and its compressor's of Layer.wx."""

    compressor: Compressor


@dataclass(frozen=True)
class Experts:
    w13: Weight  # (E, 2 I, D): gate rows then up rows (plain or FP4; the shared expert plain or FP8)
    w2: Weight  # (E, D, I)


HcParams = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # fn ((2 + hc) hc, hc D), base, scale (3,)


@dataclass(frozen=True)
class Layer:
    kind: str
    hc_attn: HcParams
    hc_ffn: HcParams
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wx: MergedLinear  # the linears that read x: wq_a (q_lora_rank, D), wkv (d, D), the compressors', the indexer's
    q_norm: torch.Tensor
    wq: MergedLinear  # the linears that read q_res: wq_b (H d, q_lora_rank), CSA's indexer.wq_b
    kv_norm: torch.Tensor
    wo_a: Weight  # (G * o_lora_rank, H * d / G); FP8 only when a group's rows are whole scale blocks
    wo_b: Weight  # (D, G * o_lora_rank)
    sinks: torch.Tensor  # (H,) float32
    compressor: Compressor | None
    indexer: Indexer | None
    gate: torch.Tensor  # (E, D) router
    gate_bias: torch.Tensor | None  # (E,) float32 selection bias (top-k routed layers)
    tid2eid: torch.Tensor | None  # (V, k) int64 (hash-routed layers)
    experts: Experts
    shared: Experts | None  # the shared expert(s) as one (1, 2 I', D) expert


@dataclass(frozen=True)
class Mtp:
    """Multi-token prediction: the layer pairs the main model's streams at position j with the embedding of
    token j + 1 and predicts token j + 2, through one more (window-only) block and its own head collapse."""

    layer: Layer
    e_proj: Weight  # (D, D)
    h_proj: Weight  # (D, D)
    enorm: torch.Tensor
    hnorm: torch.Tensor
    norm: torch.Tensor
    hc_head: HcParams


@dataclass(frozen=True)
class V4Weights:
    embed: torch.Tensor
    head: Weight
    norm: torch.Tensor
    hc_head: HcParams
    layers: list[Layer]
    mtp: Mtp | None  # None: the checkpoint has no (window-only) MTP layer


def load(spec: DeepseekV4Spec, weights: dict[str, Weight], device: torch.device, dtype: torch.dtype,
         quantized: bool = False, held: Sequence[int] | None = None) -> V4Weights:
    """quantized: keep the FP8 linears and FP4 routed experts the checkpoint has as they are (Triton kernels);
    held: the main layers' routed experts to bring to the device, stacked in this order (a rank of an
    expert-parallel worker: parallel/), None = all of them. The MTP layer always gets all its experts."""

    def got(name: str) -> Weight:
        if name not in weights:
            raise ValueError(f"checkpoint has no tensor {name}")
        return weights[name]

    def w(name: str, keep_fp32: bool = False) -> torch.Tensor:
        return as_dense(got(name), torch.float32 if keep_fp32 else dtype).to(device)

    def f32(name: str) -> torch.Tensor:
        return w(name, keep_fp32=True)

    def lin(name: str, row_groups: int = 1) -> Weight:
        """A linear: FP8 kept when quantized (and each of row_groups slices is whole blocks), else dense."""
        t = got(name)
        kept = quantized and isinstance(t, Fp8Weight)
        if kept and row_groups > 1:  # wo_a: attention.output slices it per group, on block edges
            kept = (t.shape[0] // row_groups) % t.block[0] == 0
        return t.to(device) if kept else w(name)

    def hc(p: str) -> HcParams:
        return f32(p + "_fn"), f32(p + "_base"), f32(p + "_scale")

    def compressor(p: str, ratio: int, overlap: bool) -> Compressor:
        return Compressor(f32(p + "ape"), f32(p + "norm.weight"), ratio, overlap)

    def merged(a: str, parts: list[str], max_rows: int | None = None) -> MergedLinear:
        """The linears a + part + ".weight" merged; their own loaded tensors are dropped here."""
        return merge({n: lin(f"{a}{n}.weight") for n in parts}, max_rows)

    def experts(p: str, names: list[str], kind: type) -> Experts:
        """Stacked (E, 2 I, D) and (E, D, I), kept quantized when every part is of `kind` (FP4 routed, FP8
        shared) with one block layout and the gate rows end on a block edge."""
        ups = [(got(f"{p}{e}.w1.weight"), got(f"{p}{e}.w3.weight")) for e in names]
        downs = [got(f"{p}{e}.w2.weight") for e in names]
        parts = [t for pair in ups for t in pair] + downs
        if quantized and _stackable(parts, kind):
            return Experts(_stack([cat_rows(list(pair)) for pair in ups]).to(device), _stack(downs).to(device))
        w13 = torch.stack([torch.cat([as_dense(a, dtype), as_dense(b, dtype)]) for a, b in ups]).to(device)
        return Experts(w13, torch.stack([as_dense(t, dtype) for t in downs]).to(device))

    def layer(p: str, kind: str, ratio: int, hashed: bool, routed: Sequence[int] = range(spec.num_experts)
              ) -> Layer:
        a = p + "attn."
        x_parts = ["wq_a", "wkv"] + (["compressor.wkv", "compressor.wgate"] if kind != SLIDING else [])
        q_parts = ["wq_b"]
        if kind == CSA:
            x_parts += ["indexer.compressor.wkv", "indexer.compressor.wgate", "indexer.weights_proj"]
            q_parts += ["indexer.wq_b"]
        return Layer(
            kind=kind,
            hc_attn=hc(p + "hc_attn"),
            hc_ffn=hc(p + "hc_ffn"),
            attn_norm=f32(p + "attn_norm.weight"),
            ffn_norm=f32(p + "ffn_norm.weight"),
            wx=merged(a, x_parts), q_norm=f32(a + "q_norm.weight"), wq=merged(a, q_parts, max_rows=1),
            kv_norm=f32(a + "kv_norm.weight"),
            wo_a=lin(a + "wo_a.weight", spec.o_groups), wo_b=lin(a + "wo_b.weight"), sinks=f32(a + "attn_sink"),
            compressor=compressor(a + "compressor.", ratio, kind == CSA) if kind != SLIDING else None,
            indexer=Indexer(compressor(a + "indexer.compressor.", ratio, True)) if kind == CSA else None,
            gate=w(p + "ffn.gate.weight"),
            gate_bias=None if hashed else f32(p + "ffn.gate.bias"),
            tid2eid=weights[p + "ffn.gate.tid2eid"].to(device=device, dtype=torch.long) if hashed else None,
            experts=experts(p + "ffn.experts.", [str(e) for e in routed], Fp4Weight),
            shared=experts(p + "ffn.", ["shared_experts"], Fp8Weight) if spec.num_shared_experts else None,
        )

    routed = range(spec.num_experts) if held is None else held
    layers = [layer(f"layers.{i}.", kind, ratio, i < spec.hash_layers, routed)
              for i, (kind, ratio) in enumerate(zip(spec.kinds, spec.ratios))]
    # The MTP layer drafts tokens for speculative decoding. DeepSeek's releases make it window-only (their
    # compress_ratios end in 0): its sliding ring is all the state it needs, kept beside the main layers'.
    mtp = None
    if spec.num_mtp_layers and spec.mtp_kinds[0] == SLIDING:
        p = "mtp.0."
        mtp = Mtp(layer(p, SLIDING, 0, False), lin(p + "e_proj.weight"), lin(p + "h_proj.weight"),
                  f32(p + "enorm.weight"), f32(p + "hnorm.weight"), f32(p + "norm.weight"), hc(p + "hc_head"))
    return V4Weights(w("embed.weight"), lin("head.weight"), f32("norm.weight"), hc("hc_head"), layers, mtp)


def _stackable(parts: list[Weight], kind: type) -> bool:
    if not all(isinstance(t, kind) for t in parts):
        return False
    blocks = {t.block for t in parts}  # type: ignore[union-attr]
    if len(blocks) != 1:
        return False
    block = blocks.pop()
    # FP8's 2-D blocks: the gate rows (w1) must end on a block edge for [w1; w3] to be one block grid
    return kind is not Fp8Weight or parts[0].shape[0] % block[0] == 0


def _stack(parts: list) -> Fp8Weight | Fp4Weight:
    """(E, ...) from E quantized matrices of one layout."""
    return type(parts[0])(torch.stack([t.data for t in parts]), torch.stack([t.scale for t in parts]),
                          parts[0].block)
