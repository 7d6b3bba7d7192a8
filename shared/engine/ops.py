"""The model's non-GEMM ops, one implementation per backend, chosen by name.

    torch   the reference: plain torch ops, the CPU path (and a GPU fallback without Triton)
    triton  fused Triton kernels (kernels/): RoPE + KV write, paged decode / prefill attention, RMSNorm with
            the residual add, SwiGLU; logits straight to float32 from the bf16 lm_head GEMM
    deterministic
            triton's, made batch-invariant (--deterministic, kernels/invariant.py): every linear layer and the
            lm_head through one fixed-tile Triton GEMM, one paged attention kernel with one fixed tile for
            decode and prefill alike, no fused small-batch GEMVs; a row's bits depend on that
            row alone, not on its batch, its padding or whether its position came from prefill or decode

Both take the same arguments and compute the same function; the torch ops are what the kernels are tested
against. Residual adds return the new residual: the torch ops allocate it, the kernels update it in place.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from shared.engine.attention import AttentionMetadata, paged_attention
from shared.engine.kernels import HAVE_TRITON
from shared.engine.kv_cache import KVCache


class Ops(Protocol):
    name: str
    batched: bool  # takes the packed batch metadata (BatchTensors) and serves CUDA graphs (the Triton kinds)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def embed(self, ids: torch.Tensor, weight: torch.Tensor, fed: torch.Tensor | None) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope_write(self, qkv: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, kv: KVCache, layer: int,
                   meta: AttentionMetadata, heads: tuple[int, int, int]) -> torch.Tensor: ...

    def attention(self, q: torch.Tensor, kv: KVCache, layer: int, meta: AttentionMetadata, scale: float
                  ) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def lm_head(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    # Small batches (T <= gemv_rows): linear layers with their neighbours fused (0 = never)
    gemv_rows: int

    def norm_linear(self, x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor
                    ) -> torch.Tensor: ...

    def norm_swiglu(self, x: torch.Tensor, norm: torch.Tensor, eps: float, gate_up: torch.Tensor
                    ) -> torch.Tensor: ...

    def linear_residual(self, a: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, hd); cos, sin (T, 1, hd/2). Pairs are (x[i], x[i + hd/2]) (HF's rotate_half layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class TorchOps:
    name = "torch"
    batched = False
    gemv_rows = 0  # the unfused forward always; the fused forms below are the reference for the kernels

    def linear(self, x, weight):
        return F.linear(x, weight)

    def norm_linear(self, x, norm, eps, weight):
        return F.linear(rms_norm(x, norm, eps), weight)

    def norm_swiglu(self, x, norm, eps, gate_up):
        return self.silu_mul(F.linear(rms_norm(x, norm, eps), gate_up))

    def linear_residual(self, a, weight, x):
        return x + F.linear(a, weight)

    def embed(self, ids, weight, fed):
        """weight[ids]; an id -(r + 1) stands for fed[r] (overlapped scheduling's placeholders)."""
        if fed is not None:
            ids = torch.where(ids < 0, fed[(-ids - 1).clamp(min=0)], ids)
        return weight[ids]

    def rms_norm(self, x, delta, w, eps):
        """(RMSNorm(x + delta), x + delta); delta None = no residual add."""
        if delta is not None:
            x = x + delta
        return rms_norm(x, w, eps), x

    def rope_write(self, qkv, positions, rope, kv, layer, meta, heads):
        H, KV, hd = heads
        T = qkv.shape[0]
        positions = positions.long()
        cos, sin = rope[positions].unsqueeze(2).unbind(1)  # each (T, 1, hd/2)
        q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        q = apply_rotary(q.view(T, H, hd), cos, sin)  # (T, H, hd)
        k = apply_rotary(k.view(T, KV, hd), cos, sin)  # (T, KV, hd)
        kv.write(layer, k, v.view(T, KV, hd), meta.slot_mapping.long())
        return q

    def attention(self, q, kv, layer, meta, scale):
        k_cache, v_cache = kv.layer(layer)
        return paged_attention(q, k_cache, v_cache, meta, scale)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)  # each (T, I)
        return F.silu(gate) * up

    def lm_head(self, h, weight):
        return F.linear(h, weight).float()


class TritonOps:
    """The GPU path. Decode-only steps use the split decode kernel; steps whose sequences have no cached
    prefix (fresh prompts) use torch's flash SDPA per sequence; anything else the paged prefill kernel."""

    name = "triton"
    batched = True

    def __init__(self) -> None:
        # decorated here: after TRITON_INTERPRET is known
        from shared.engine.kernels import attention, fused, gemv

        self._attn = attention
        self._fused = fused
        self._gemv = gemv.gemv
        self.gemv_rows = 8  # decode at batch <= 8: Triton GEMVs with norm / residual / SwiGLU fused in
        self._fp32_heads: dict[int, torch.Tensor] = {}
        self._mm_to_fp32: bool | None = None  # does torch.mm(bf16, bf16, out_dtype=float32) run here?

    def linear(self, x, weight):
        return F.linear(x, weight)

    def embed(self, ids, weight, fed):
        return self._fused.embed(ids, weight, fed)

    def rms_norm(self, x, delta, w, eps):
        return self._fused.add_rms_norm(x, delta, w, eps), x

    def rope_write(self, qkv, positions, rope, kv, layer, meta, heads):
        H, KV, hd = heads
        k_cache, v_cache = kv.layer(layer)
        self._fused.rope_write(qkv, positions, meta.slot_mapping, rope, k_cache, v_cache, H, KV, hd)
        return qkv[:, : H * hd].view(-1, H, hd)  # rotated in place; row stride (H + 2 KV) hd

    def attention(self, q, kv, layer, meta, scale):
        b = meta.batch
        assert b is not None, "the Triton path needs the batched metadata (ModelRunner builds it on GPUs)"
        k_cache, v_cache = kv.layer(layer)
        if b.decode:
            return self._attn.decode_attention(q, k_cache, v_cache, b.block_tables, b.context_lens, scale,
                                               b.max_context)
        if b.fresh:
            return self._fresh_prompts(q, k_cache, v_cache, meta, scale)
        return self._attn.prefill_attention(q, k_cache, v_cache, b.block_tables, b.q_starts, b.q_lens,
                                            b.context_lens, b.max_q_len, scale)

    def _fresh_prompts(self, q, k_cache, v_cache, meta, scale):
        """Every sequence computes its whole prompt: causal flash attention over this step's own K/V."""
        KV, D = k_cache.shape[2:]
        slots = meta.slot_mapping.long()
        k = k_cache.view(-1, KV, D).index_select(0, slots)  # (T, KV, D): this step's rotated keys
        v = v_cache.view(-1, KV, D).index_select(0, slots)
        H = q.shape[1]
        # K/V repeated to every query head: with enable_gqa SDPA leaves the flash kernel for the math one
        # (seen on the H200: 2K-token prefill of the 8B shape 2.5x slower than HF)
        k = k.repeat_interleave(H // KV, dim=1)  # (T, H, D)
        v = v.repeat_interleave(H // KV, dim=1)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for s in meta.spans:
            rows = slice(s.q_start, s.q_start + s.q_len)
            # 4-D (1, H, n, D): the flash kernel takes only 4-D inputs, 3-D ones fall back to the math kernel
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None],
                is_causal=True, scale=scale,
            )  # (1, H, n, D)
            out[rows] = o[0].transpose(0, 1)
        return out

    def silu_mul(self, gate_up):
        return self._fused.silu_mul(gate_up)

    def norm_linear(self, x, norm, eps, weight):
        return self._gemv(x, weight, norm=norm, eps=eps)

    def norm_swiglu(self, x, norm, eps, gate_up):
        return self._gemv(x, gate_up, norm=norm, eps=eps, swiglu=True)

    def linear_residual(self, a, weight, x):
        return self._gemv(a, weight, residual=x)

    def lm_head(self, h, weight):
        """float32 logits from the bf16 GEMM's float32 accumulator: rounding them to bf16 first flips near-ties."""
        if weight.dtype == torch.float32:
            return F.linear(h, weight)
        if self._mm_to_fp32 is None:  # probed once, outside any graph capture (the first call is eager)
            try:
                torch.mm(h[:1], weight[:8].t(), out_dtype=torch.float32)
                self._mm_to_fp32 = True
            except (RuntimeError, TypeError):
                self._mm_to_fp32 = False
        if self._mm_to_fp32:
            return torch.mm(h, weight.t(), out_dtype=torch.float32)
        w32 = self._fp32_heads.get(id(weight))  # no bf16 -> fp32 GEMM in this torch: a float32 copy of the head
        if w32 is None:
            w32 = self._fp32_heads.setdefault(id(weight), weight.float())
        return F.linear(h.float(), w32)


class DeterministicOps(TritonOps):
    """TritonOps with every reduction in an order fixed by the row alone (kernels/invariant.py). What it turns
    off: cuBLAS (its per-M algorithms and split-K), the fused small-batch GEMVs (their norm-in-prologue rounds
    differently from the unfused path other batch sizes take), the split-KV decode kernel (its split size
    follows the batch's longest context) and flash SDPA for fresh prompts (another reduction order than the
    paged kernel decode uses)."""

    name = "deterministic"

    def __init__(self) -> None:
        super().__init__()
        from shared.engine.kernels import invariant

        self._inv = invariant
        self.gemv_rows = 0

    def linear(self, x, weight):
        return self._inv.matmul(x, weight)

    def norm_linear(self, x, norm, eps, weight):
        return self.linear(self.rms_norm(x, None, norm, eps)[0], weight)

    def norm_swiglu(self, x, norm, eps, gate_up):
        return self.silu_mul(self.norm_linear(x, norm, eps, gate_up))

    def linear_residual(self, a, weight, x):
        return x + self.linear(a, weight)

    def attention(self, q, kv, layer, meta, scale):
        b = meta.batch
        assert b is not None, "the Triton path needs the batched metadata (ModelRunner builds it on GPUs)"
        k_cache, v_cache = kv.layer(layer)
        return self._inv.attention(q, k_cache, v_cache, b.block_tables, b.q_starts, b.q_lens, b.context_lens,
                                   1 if b.decode else b.max_q_len, scale, b.decode)

    def lm_head(self, h, weight):
        return self._inv.matmul(h, weight, out_dtype=torch.float32)


OPS: dict[str, type] = {"torch": TorchOps, "triton": TritonOps, "deterministic": DeterministicOps}


def select_ops(device: torch.device, name: str = "auto") -> Ops:
    """'auto': Triton on a GPU when it is installed, torch otherwise."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and HAVE_TRITON else "torch"
    if name not in OPS:
        raise ValueError(f"no ops backend {name!r} (have {sorted(OPS)})")
    if name != "torch" and not HAVE_TRITON:
        raise ValueError(f"the {name} backend needs the triton package")
    return OPS[name]()
