"""V4 prefill kernels on a GPU (marked gpu: skipped without CUDA) at V4-Flash-like attention shapes (head_dim 512,
64 heads, window 128, CSA ratio 4 with index_topk 512, HCA ratio 128, hidden 4096), against the torch path in
fp32 and bf16, and a 16K-token chunk whose peak memory stays linear in the chunk (the torch path's logits alone
would be 64 x 16K x 16.5K float32 = 68 GiB)."""

from __future__ import annotations

import pytest
import torch

from bench.v4_layer import FLASH, spec_for, weights_for
from shared.engine.attention import AttentionMetadata, SeqSpan
from shared.engine.config import ModelConfig
from shared.engine.models.deepseek_v4.model import DeepseekV4
from shared.engine.models.deepseek_v4.spec import CSA, HCA, SLIDING

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DIMS = {**FLASH, "num_experts": 4, "experts_per_token": 2, "moe_intermediate": 256}  # attention is what is tested
RATIOS = {SLIDING: 0, CSA: 4, HCA: 128}
CUDA = torch.device("cuda")


def _model(kind: str, dtype: torch.dtype, tokens: int) -> DeepseekV4:
    spec = spec_for(kind, DIMS, RATIOS)
    config = ModelConfig(arch="deepseek_v4", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_layers=1,
                         num_heads=spec.num_heads, num_kv_heads=1, head_dim=spec.head_dim,
                         intermediate_size=spec.moe_intermediate, rope_theta=spec.rope_theta, rms_eps=spec.rms_eps,
                         max_position=spec.max_position, tie_embeddings=False, bos_id=0, eos_ids=(1,), spec=spec)
    from shared.engine.ops import select_ops

    model = DeepseekV4(config, weights_for(spec, CUDA, dtype), CUDA, dtype, select_ops(CUDA, "triton"))
    assert model.attention.prefill_kernels
    model.make_cache(-(-tokens // spec.block_tokens))
    return model


def _attend(model: DeepseekV4, kernels: bool, rid: str, start: int, x: torch.Tensor) -> torch.Tensor:
    kv = model.cache
    assert kv is not None
    n = x.shape[0]
    positions = torch.arange(start, start + n, device=CUDA)
    table = torch.arange(-(-(start + n) // kv.block_tokens), device=CUDA)
    span = SeqSpan(0, n, start + n, table, rid)
    att = model.attention
    state = kv.state(rid, start)
    saved = att.prefill_kernels
    att.prefill_kernels = kernels
    try:
        return att(0, model.layers[0], x, positions, att.angles(positions), AttentionMetadata(positions, [span]),
                   [state], kv, None)
    finally:
        att.prefill_kernels = saved
        state.length = start + n


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_chunk_after_a_prefix_matches_torch(kind: str, dtype: torch.dtype, tol: float) -> None:
    """A 1000-token chunk after a 2300-token prefix (mid-window, 575 CSA entries > index_topk, 17 HCA ones)."""
    torch.manual_seed(0)
    model = _model(kind, dtype, 3300)
    kv = model.cache
    assert kv is not None
    kv.begin("a", 0)
    D = model.spec.hidden_size
    _attend(model, False, "a", 0, torch.randn(2300, D, device=CUDA, dtype=dtype))
    x = torch.randn(1000, D, device=CUDA, dtype=dtype)
    state = kv.states["a"]
    saved_state = [t.clone() for t in state.tensors()]
    saved_paged = [t.clone() for t in kv._paged]
    want = _attend(model, False, "a", 2300, x).float()
    for t, v in zip(state.tensors(), saved_state):
        t.copy_(v)
    for t, v in zip(kv._paged, saved_paged):
        t.copy_(v)
    state.length = 2300
    got = _attend(model, True, "a", 2300, x).float()
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < tol, err


def test_16k_chunk_memory_is_linear_in_the_chunk() -> None:
    """CSA (window + compressed entries + indexer) over one 16K-token chunk in bf16: peak memory above the
    weights and cache within a few copies of the chunk's (n, heads, head_dim) activations."""
    n = 16384
    model = _model(CSA, torch.bfloat16, n)
    kv = model.cache
    assert kv is not None
    kv.begin("long", 0)
    x = torch.randn(n, model.spec.hidden_size, device=CUDA, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = _attend(model, True, "long", 0, x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    act = n * model.spec.num_heads * model.spec.head_dim * 2  # one bf16 (n, H, d) tensor: 1 GiB
    print(f"16K CSA chunk: peak {peak / 2**30:.2f} GiB above the inputs ({peak / act:.1f} x one (n, H, d) tensor)")
    assert torch.isfinite(out).all()
    assert peak < 10 * act  # torch path: > 64 x (n, H, d) for its float32 logits alone
