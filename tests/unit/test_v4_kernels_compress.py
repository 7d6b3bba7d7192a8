"""V4 decode's compressor update (kernels/v4_compress.py) and indexer scores (kernels/v4_index.py) under the
Triton interpreter (fp32, CPU), against decode.py's torch path (the reference), on random pools.

Compressor: mixed batches of rows that close their window this step and rows that do not, HCA (m 8) and CSA's
overlap (m 4: the previous window's Ca channels), the indexer's narrow keys (every channel rotated), a first
window (its previous-window slots before position 0), bounded replay (begin > 0 masks slots), frozen rows
(restored windows are never rebuilt), rows whose tables span many blocks and a row past 300K tokens (RoPE angles
of 3e5 radians). The interpreter computes tl.cos / tl.sin with numpy, so these tests check the angle arithmetic
(float32 position * inv_freq, as rope.py's Rotary); the GPU's cos / sin precision is checked by
tests/gpu/test_v4_compress_gpu.py. Indexer: scores (fp32 and FP8 packed keys) and the chosen sets with
index_topk below the visible entries, a context bucket past the longest row.
"""

from __future__ import annotations

import pytest
import torch

from shared.engine.kv_quant import RowLayout
from shared.engine.models.deepseek_v4 import decode
from tests.v4_compress_cases import compress_case, index_case

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (tests/gpu covers CUDA)")

triton = pytest.importorskip("triton")
tl = triton.language

from shared.engine.kernels.v4_compress import _bf16_bits, _e4m3_bits  # noqa: E402  (needs triton)

# slot, position, begin, frozen
HCA_ROWS = [(0, 15, 0, 0),  # closes window 1
            (1, 12, 0, 0),  # open
            (2, 23, 18, 0),  # closes after a bounded replay: tokens 16, 17 masked
            (3, 31, 0, 32),  # closes a restored window: frozen, not rebuilt
            (4, 71, 0, 0),  # closes window 8, in the table's fifth block
            (5, 299_999, 0, 0),  # closes past 300K tokens
            (7, 0, 0, 0)]  # a graph's padding row: position 0 (open)
CSA_ROWS = [(0, 3, 0, 0),  # closes window 0: window -1's Ca slots are before position 0
            (1, 7, 0, 0),  # closes
            (2, 9, 0, 0),  # open
            (3, 27, 22, 0),  # closes after a replay: Ca slots 20, 21 masked
            (4, 31, 0, 28),  # closes the first window not restored (frozen 28: windows before 7)
            (5, 35, 0, 36),  # frozen
            (6, 300_003, 0, 0)]  # closes past 300K tokens


def _run(case, kernels: bool) -> list[torch.Tensor]:
    case.step(kernels)
    return case.state()


@pytest.mark.parametrize("name, rows, ratio, overlap, d, rope, fp8", [
    ("hca", HCA_ROWS, 8, False, 32, 16, None),
    ("csa", CSA_ROWS, 4, True, 32, 16, None),
    ("csa-indexer", CSA_ROWS, 4, True, 16, 16, None),
    ("hca-wide", HCA_ROWS[:3], 8, False, 48, 8, None),  # d / 2 not a power of two: padded channels
    ("hca-fp8", HCA_ROWS, 8, False, 32, 16, RowLayout(32, 16)),  # e4m3 | scales | bf16 RoPE channels
    ("csa-fp8", CSA_ROWS, 4, True, 32, 16, RowLayout(32, 16)),
    ("csa-indexer-fp8", CSA_ROWS, 4, True, 16, 16, RowLayout(16, 0)),  # indexer keys: all e4m3
])
def test_compress_kernel_matches_the_torch_path(name, rows, ratio, overlap, d, rope, fp8) -> None:
    make = lambda: compress_case(rows, ratio, overlap, d, rope, torch.float32, "cpu", fp8=fp8)  # noqa: E731
    case = make()
    before = case.state()
    want = _run(make(), kernels=False)
    got = _run(make(), kernels=True)
    for a, b, what in zip(got[:2], want[:2], ("kv ring", "gate ring")):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{name}: {what}")
    # FP8: the same values (the kernel's float32 sums round apart by an ulp: a scale's bytes may differ)
    torch.testing.assert_close(case.entries(got), case.entries(want), atol=1e-5, rtol=1e-5, msg=f"{name}: store")
    # the step wrote every row's ring slot and exactly the closing, unfrozen rows' entries
    changed = lambda state: (state[2] != before[2]).flatten(1).any(1).nonzero()[:, 0].tolist()  # noqa: E731
    closes = [r for r, (_, p, _, fz) in enumerate(rows) if (p + 1) % ratio == 0 and p // ratio >= fz // ratio]
    assert changed(got) == closes and (fp8 is not None or changed(want) == closes), name
    assert not torch.equal(got[0], before[0]) and not torch.equal(got[1], before[1])


def test_large_positions_rotate_at_their_own_angle() -> None:
    """The entry past 300K tokens differs from what the same window would give at a small position: the kernel
    used the row's own angle (compared with torch above), not a wrapped or truncated one. Same seed, so the
    same pools: window 2 (tokens 16-23) lies in the ring slots (cap 12) of window 37499 (tokens 299992-299999)."""
    rows = [(0, 299_999, 0, 0)]
    small = [(0, 23, 0, 0)]
    far, near = (compress_case(r, 8, False, 32, 16, torch.float32, "cpu") for r in (rows, small))
    _run(far, kernels=True)
    _run(near, kernels=True)
    entry_far = far.store[0, (299_992 % 16) // 8]
    entry_near = near.store[0, (16 % 16) // 8]
    assert torch.allclose(entry_far[:16], entry_near[:16])  # unrotated channels: the same window, the same sum
    assert not torch.allclose(entry_far[16:], entry_near[16:], atol=1e-3)


@triton.jit
def _bits(x_ptr, e4m3_ptr, bf16_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(e4m3_ptr + i, _e4m3_bits(x))
    tl.store(bf16_ptr + i, _bf16_bits(x))


def test_packed_rows_round_as_torch() -> None:
    """The FP8 store's e4m3 and bfloat16 bits, spelled out in integer ops (the interpreter's casts round a carry
    or a tie otherwise): every e4m3 value, the midpoints between neighbours (ties to even), subnormals and
    random values give torch's bits."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[torch.isfinite(codes)].sort().values
    mids = (values[1:] + values[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([values, mids, torch.randn(2000, generator=g) * 100, torch.randn(2000, generator=g) * 0.01])
    x = torch.nn.functional.pad(x.clamp(-448, 448), (0, 8192 - x.numel()))
    e4m3, bf16 = torch.empty(8192, dtype=torch.uint8), torch.empty(8192, dtype=torch.int16)
    _bits[(1,)](x, e4m3, bf16, N=8192)
    assert torch.equal(e4m3, x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(bf16, x.to(torch.bfloat16).view(torch.int16))


def _select(case, kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m = case.layer.compressor.ratio
    E = case.b.max_context // m
    ids = case.select(kernels)
    spec = case.att.spec
    if kernels:
        from shared.engine.kernels.v4_index import index_scores

        scores = index_scores(case.kv.index_keys[0], case.b.table, case.iq, case.weights, case.b.positions, m,
                              case.kv.block_tokens, E, spec.index_head_dim**-0.5, spec.index_heads**-0.5)
    else:
        e = torch.arange(E).expand(len(case.b.positions), E)
        blk, j = decode.entry_slots(case.b, e, m, case.kv.block_tokens)
        scores = decode.index_scores(case.kv.index_keys[0], blk, j, case.iq, case.weights, e, case.b.positions, m,
                                     spec.index_head_dim**-0.5, spec.index_heads**-0.5)
    return scores, ids


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_index_kernel_scores_and_chooses_as_the_torch_path(fp8: bool) -> None:
    # 20 heads (padded to 32 in the dot): ReLU zeros in every head, an exact tie of scores, are unlikely
    positions = [30, 3, 150, 299, 7, 2]  # 7, 1, 37, 75, 2, 0 visible entries of m 4
    topk = 5
    case = index_case(positions, 4, 20, 16, topk, torch.float32, "cpu", fp8=fp8, pad_context=40)
    want_scores, want_ids = _select(case, kernels=False)
    got_scores, got_ids = _select(case, kernels=True)
    assert got_scores.shape == want_scores.shape == (len(positions), (299 + 1 + 40) // 4)
    torch.testing.assert_close(got_scores, want_scores, atol=1e-5, rtol=1e-5)
    visible = [(p + 1) // 4 for p in positions]
    for r, v in enumerate(visible):
        assert torch.isinf(got_scores[r, v:]).all() and torch.isfinite(got_scores[r, :v]).all()
        chosen = sorted(got_ids[r][got_ids[r] >= 0].tolist())
        assert chosen == sorted(want_ids[r][want_ids[r] >= 0].tolist())
        assert len(chosen) == min(topk, v)  # sparse where topk < visible, -1 past a short row's entries
