"""DeepSeek-V4's mixture of experts: routing (sqrt-softplus / sigmoid / softmax scores, top-k with a selection
bias, or hash routing by token id on the first layers), the routed experts (clamped SwiGLU) and the shared one.

With `triton` (the model runs its Triton kernels: CUDA) the experts and the shared one are one fused grouped
GEMM pair for any batch size (kernels/moe.py); the torch code below is the CPU path and the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine.kernels import HAVE_TRITON
from shared.engine.models.deepseek_v4.spec import DeepseekV4Spec
from shared.engine.models.deepseek_v4.weights import Experts, Layer
from shared.engine.quant import linear

if HAVE_TRITON:
    from shared.engine.kernels.moe import fused_moe

GATHER_MAX_PAIRS = 32  # (row, expert) pairs up to which the experts' weights are gathered (decode, batch <= 5)


def route(s: DeepseekV4Spec, layer: Layer, x: torch.Tensor, input_ids: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> chosen experts (T, k) int64 and their combine weights (T, k) float32."""
    return route_weights(x, layer.gate, layer.gate_bias, layer.tid2eid, input_ids, s.scoring, s.experts_per_token,
                         s.routed_scale)


def route_weights(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
                  input_ids: torch.Tensor, scoring: str, k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router as pure tensors: sqrt-softplus, sigmoid or softmax scores; top-k with the selection bias, or
    hash routing by token id (tid2eid)."""
    logits = F.linear(x, gate).float()  # (T, E)
    if scoring == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    if tid2eid is not None:
        chosen = tid2eid[input_ids]  # (T, k): hash routing by token id
    else:
        assert bias is not None
        chosen = torch.topk(scores + bias, k, dim=-1, sorted=False).indices
    weights = scores.gather(1, chosen)
    return chosen, weights / (weights.sum(-1, keepdim=True) + 1e-20) * scale


def moe(s: DeepseekV4Spec, layer: Layer, x: torch.Tensor, input_ids: torch.Tensor, triton: bool = False,
        counts: torch.Tensor | None = None, real: torch.Tensor | None = None) -> torch.Tensor:
    """counts (E,) int64: the layer's row of the model's expert counts, to which this step's choices are added,
    one per row that `real` (T,) int64 marks 1."""
    chosen, weights = route(s, layer, x, input_ids)
    if counts is not None:
        assert real is not None
        tally(counts, chosen, real)
    if triton:
        return fused(s, layer, x, chosen, weights)
    out = experts(layer.experts, x, chosen, weights, s.swiglu_limit)
    if layer.shared is not None:
        out = out + shared_expert(layer.shared, x, s.swiglu_limit)
    return out


def tally(counts: torch.Tensor, chosen: torch.Tensor, real: torch.Tensor) -> None:
    """counts[e] += the real rows that chose expert e: one scatter on the device, no read-back, so a CUDA graph
    captures it (the buffer is the model's, allocated once) and a step pays one tiny kernel per layer."""
    T, k = chosen.shape
    counts.index_add_(0, chosen.reshape(-1), real[:, None].expand(T, k).reshape(-1))


def fused(s: DeepseekV4Spec, layer: Layer, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
          ) -> torch.Tensor:
    """The Triton path: routed experts and (when it has their width) the shared expert in the same launches."""
    ex, sh = layer.experts, layer.shared
    # it rides along only in the experts' own format (FP4 experts with an FP8 shared expert: two launches more)
    rides = sh is not None and sh.w13.shape[1:] == ex.w13.shape[1:] and type(sh.w13) is type(ex.w13)
    out = fused_moe(x, chosen, weights, ex.w13, ex.w2, s.swiglu_limit, (sh.w13[0], sh.w2[0]) if rides else None)
    if sh is not None and not rides:  # several shared experts stacked into one wider SwiGLU
        out = out + shared_expert(sh, x, s.swiglu_limit)
    return out


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def shared_expert(ex: Experts, x: torch.Tensor, limit: float) -> torch.Tensor:
    """Every row through the one shared expert: a dense SwiGLU."""
    return linear(swiglu(linear(x, ex.w13[0]), limit), ex.w2[0])


def experts(ex: Experts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, limit: float
            ) -> torch.Tensor:
    """Each row through its chosen experts (clamped SwiGLU), weighted and summed: grouped by expert, or for
    a few (row, expert) pairs (decode at small batch) as two batched products over the gathered weights,
    with no host round trip to learn which experts were hit."""
    T, k = chosen.shape
    if T * k <= GATHER_MAX_PAIRS:
        flat = chosen.flatten()
        xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # (T k, D, 1)
        h = swiglu(torch.bmm(ex.w13[flat], xs).squeeze(-1), limit)  # (T k, I)
        y = torch.bmm(ex.w2[flat], h.unsqueeze(-1)).squeeze(-1) * weights.flatten()[:, None].to(x.dtype)
        return y.view(T, k, -1).sum(1).to(x.dtype)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=ex.w13.shape[0]).tolist()
    out = torch.zeros_like(x)
    at = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[at : at + count]
        at += count
        rows = picks // k
        y = F.linear(swiglu(F.linear(x[rows], ex.w13[e]), limit), ex.w2[e]) * weights.flatten()[picks, None].to(x.dtype)
        out.index_add_(0, rows, y.to(out.dtype))
    return out
