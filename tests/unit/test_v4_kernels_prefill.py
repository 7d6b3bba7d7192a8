"""V4 prefill attention through the Triton kernels (kernels/v4_prefill.py, models/deepseek_v4/prefill.py) against
the torch path (Attention.attend_one), under TRITON_INTERPRET=1 in fp32 on tiny one-layer models of each kind:
chunks that start mid-window, after a cached prefix (frozen entries, bounded replay: begin > 0), CSA with fewer
top-k slots than entries (the selected sets compared), and a tiny model end to end with the kernels on."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.v4_layer import TINY, spec_for, weights_for
from shared.engine.attention import AttentionMetadata, SeqSpan
from shared.engine.config import ModelConfig
from shared.engine.models.deepseek_v4 import prefill
from shared.engine.models.deepseek_v4.model import DeepseekV4
from shared.engine.models.deepseek_v4.spec import CSA, HCA, SLIDING

# CPU tensors through the interpreter; on a GPU machine tests/gpu/ runs these kernels at real shapes instead
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (tests/gpu covers CUDA)")

ATOL = 2e-5
# 8 index heads: a score is exactly 0 (every head's ReLU off) rarely enough that top-k has no ties to break
DIMS = {**TINY, "index_heads": 8}
RATIOS = {SLIDING: 0, CSA: 4, HCA: 8}


def _model(kind: str) -> DeepseekV4:
    spec = spec_for(kind, DIMS, RATIOS)
    config = ModelConfig(arch="deepseek_v4", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_layers=1,
                         num_heads=spec.num_heads, num_kv_heads=1, head_dim=spec.head_dim,
                         intermediate_size=spec.moe_intermediate, rope_theta=spec.rope_theta, rms_eps=spec.rms_eps,
                         max_position=spec.max_position, tie_embeddings=False, bos_id=0, eos_ids=(1,), spec=spec)
    model = DeepseekV4(config, weights_for(spec, torch.device("cpu"), torch.float32), torch.device("cpu"),
                       torch.float32)
    model.make_cache(32)
    return model


@pytest.fixture(scope="module", params=[SLIDING, CSA, HCA])
def model(request: pytest.FixtureRequest) -> DeepseekV4:
    return _model(request.param)


def _attend(model: DeepseekV4, kernels: bool, rid: str, table: list[int], start: int, x: torch.Tensor
            ) -> torch.Tensor:
    """The layer's attention over one chunk of rows x at positions start.., torch path or kernels."""
    kv = model.cache
    assert kv is not None
    n = x.shape[0]
    positions = torch.arange(start, start + n)
    span = SeqSpan(0, n, start + n, torch.tensor(table[: -(-(start + n) // kv.block_tokens)]), rid)
    att = model.attention
    att.prefill_kernels = kernels
    state = kv.state(rid, start)
    try:
        return att(0, model.layers[0], x, positions, att.angles(positions), AttentionMetadata(positions, [span]),
                   [state], kv, None)
    finally:
        att.prefill_kernels = False
        state.length = start + n  # as DeepseekV4.forward does after the last layer


def _x(model: DeepseekV4, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, model.spec.hidden_size, generator=torch.Generator().manual_seed(seed))


def _both(model: DeepseekV4, rid: str, table: list[int], start: int, x: torch.Tensor) -> None:
    """The chunk through both paths from the same cache contents: same output, same rings and entries after."""
    kv = model.cache
    assert kv is not None
    before = (copy.deepcopy(kv.states[rid]), [t.clone() for t in kv._paged])
    want = _attend(model, False, rid, table, start, x)
    ref_state, ref_paged = kv.states[rid], [t.clone() for t in kv._paged]
    kv.states[rid] = before[0]
    for t, saved in zip(kv._paged, before[1]):
        t.copy_(saved)
    got = _attend(model, True, rid, table, start, x)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for a, b in zip(kv.states[rid].tensors(), ref_state.tensors()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for a, b in zip(kv._paged, ref_paged):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_chunks_from_the_start_and_mid_window(model: DeepseekV4) -> None:
    kv = model.cache
    assert kv is not None
    table = list(range(8))
    kv.begin("a", 0)
    at = 0
    for n, seed in ((13, 1), (3, 2), (37, 3), (1, 4), (22, 5)):  # starts 0, 13, 16, 53 (decode: torch), 54
        if n > 1:
            _both(model, "a", table, at, _x(model, n, seed))
        else:
            _attend(model, False, "a", table, at, _x(model, n, seed))
        at += n
    kv.drop_state("a")


def test_chunk_after_a_cached_prefix(model: DeepseekV4) -> None:
    """Blocks restored, no short-term state: a bounded replay from begin > 0 with the restored entries frozen."""
    kv = model.cache
    assert kv is not None
    bt = kv.block_tokens
    table = list(range(8, 16))
    kv.begin("first", 0)
    _attend(model, False, "first", table, 0, _x(model, 3 * bt, 6))
    kv.drop_state("first")
    start = kv.begin("replay", 2 * bt)
    assert 0 < start < 2 * bt  # begin > 0, entries of the first two blocks frozen
    _both(model, "replay", table[:2] + list(range(16, 22)), start, _x(model, 2 * bt + 9 - start, 7))
    kv.drop_state("replay")


def test_indexer_selects_the_same_entries_when_topk_is_smaller() -> None:
    model = _model(CSA)
    s = model.spec
    kv = model.cache
    assert kv is not None
    n, E, start = 60, 23, 32  # entries visible per query: (p + 1) // 4, from 8 to 23 > index_topk = 8
    assert s.index_topk < E
    g = torch.Generator().manual_seed(9)
    iq = torch.randn(n, s.index_heads, s.index_head_dim, generator=g)
    weights = torch.randn(n, s.index_heads, generator=g)
    keys = torch.randn(E, s.index_head_dim, generator=g)
    scale = s.index_head_dim**-0.5 * s.index_heads**-0.5
    for block in (32 * 4 * E, 1 << 20):  # several query blocks, one
        ids = prefill.top_entries(iq, weights, keys, start, 4, s.index_topk, scale, block_bytes=block)
        assert ids.shape == (n, s.index_topk) and ids.dtype == torch.int32
        # the torch path's selection: full scores, masked, top-k, as Attention.select computes them
        scores = (torch.relu(torch.einsum("nhc,ec->nhe", iq, keys)) * s.index_head_dim**-0.5
                  * (weights * s.index_heads**-0.5).unsqueeze(-1)).sum(1)
        visible = (torch.arange(start, start + n) + 1) // 4
        scores = scores.masked_fill(torch.arange(E)[None, :] >= visible[:, None], float("-inf"))
        want = torch.zeros(n, E, dtype=torch.bool).scatter_(1, scores.topk(s.index_topk, -1).indices, True)
        want &= torch.arange(E)[None, :] < visible[:, None]
        got = torch.zeros(n, E + 1, dtype=torch.bool).scatter_(1, ids.long() % (E + 1), True)[:, :E]
        assert torch.equal(got, want)
        assert ((ids >= 0).sum(1) == visible.clamp(max=s.index_topk)).all()


def test_no_entries_yet_and_sinks_only() -> None:
    """A CSA chunk before its first window closes: no ids, the window and the sink alone."""
    model = _model(CSA)
    kv = model.cache
    assert kv is not None
    kv.begin("short", 0)
    _both(model, "short", list(range(4)), 0, _x(model, 3, 11))


# --- a tiny model end to end -----------------------------------------------------------------------------------

def test_tiny_model_prefill_with_kernels_equals_torch(tmp_path) -> None:
    """Every layer kind of the parity suite's "mixed" checkpoint; only the prefill kernels are forced on (the
    mHC kernel's interpreter time is the parity suite's triton case)."""
    from shared.engine.engine import Engine
    from tests import v4_checkpoints

    path = tmp_path / "v4"
    v4_checkpoints.build(path, "mixed")
    ids = torch.randint(0, v4_checkpoints.BASE["vocab_size"], (40,), generator=torch.Generator().manual_seed(3))
    out = {}
    for kernels in (False, True):
        engine = Engine(str(path), kv_blocks=64)
        model, kv = engine.model, engine.kv
        model.attention.prefill_kernels = kernels
        kv.begin("a", 0)
        table = torch.arange(8)
        got, at = [], 0
        for n in (17, 1, 22):  # chunked prefill, a decode row between (the torch path), a chunk mid-window
            positions = torch.arange(at, at + n)
            span = SeqSpan(0, n, at + n, table[: -(-(at + n) // kv.block_tokens)], "a")
            got.append(model.logits(model.forward(ids[at : at + n], positions, AttentionMetadata(positions, [span]),
                                                  kv)))
            at += n
        out[kernels] = torch.cat(got)
    torch.testing.assert_close(out[True], out[False], atol=1e-4, rtol=0)
    assert (out[True] - out[False]).abs().max() > 0  # the kernels really ran (other rounding than the torch path)
