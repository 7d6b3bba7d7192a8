"""V4 decode's compressor update (kernels/v4_compress.py) and indexer scores (kernels/v4_index.py) on a GPU at
V4-Flash's widths (entries of 512 channels with 64 rotated, CSA m 4 with its overlap, HCA m 128, indexer keys of
128 channels, 64 index heads), against decode.py's torch path, in fp32 and bf16, with rows past 300K tokens
(RoPE angles of 3e5 radians: tl.cos / tl.sin against torch's cos / sin on the same float32 angles), inside a
captured CUDA graph, and the tiny model's decode steps replayed from graphs with every kernel on (marked gpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.kv_quant import RowLayout
from shared.engine.models.deepseek_v4 import decode
from tests import v4_checkpoints
from tests.v4_compress_cases import compress_case, index_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

D, ROPE, INDEX_DIM, INDEX_HEADS, TOPK = 512, 64, 128, 64, 512


def _rows(ratio: int) -> list[tuple[int, int, int, int]]:
    """Closing and open rows, a replay, a frozen row, a row past 300K tokens (slot, p, begin, frozen)."""
    m = ratio
    return [(0, 4 * m - 1, 0, 0), (1, 4 * m + 1, 0, 0), (2, 9 * m - 1, 8 * m - 2, 0), (3, 6 * m - 1, 0, 6 * m),
            (4, 2500 * m - 1, 0, 0), (5, (300_000 // m + 7) * m - 1, 0, 0), (6, 3 * m, 0, 0), (8, 0, 0, 0)]


def _eager_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path eagerly (not torch.compile'd by fusion.py): torch's own cos / sin are the reference."""
    monkeypatch.setattr(decode, "window_entry", decode.window_entry.__wrapped__)


def _run(case, kernels: bool) -> list[torch.Tensor]:
    case.step(kernels)
    torch.cuda.synchronize()
    return case.state()


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, ratio, overlap, d", [("csa", 4, True, D), ("hca", 128, False, D),
                                                     ("indexer", 4, True, INDEX_DIM)])
def test_compress_kernel_at_flash_shape(name, ratio, overlap, d, dtype, fp8, monkeypatch) -> None:
    _eager_reference(monkeypatch)
    layout = None if not fp8 else RowLayout(d, ROPE if name != "indexer" else 0)  # as cache.py lays them out
    make = lambda: compress_case(_rows(ratio), ratio, overlap, d, ROPE, dtype, "cuda", num_blocks=16,  # noqa: E731
                                 fp8=layout)
    case = make()
    before = case.state()
    want = _run(make(), kernels=False)
    got = _run(make(), kernels=True)
    # bf16: the torch path sums the window and normalises in bf16, the kernel in float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b, what in zip(got[:2], want[:2], ("kv ring", "gate ring")):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=f"{name}: {what}")
    # FP8: entries that round apart by tol may land one e4m3 step (1/8 of the value at most) apart
    atol, rtol = (tol + 1e-2, 1 / 8) if fp8 else (tol, tol)
    entries_got, entries_want = case.entries(got), case.entries(want)
    torch.testing.assert_close(entries_got, entries_want, atol=atol, rtol=rtol, msg=f"{name}: store")
    assert not torch.equal(got[2], before[2])
    far = 5  # the row past 300K tokens: its entry's rotated channels
    w = _rows(ratio)[far][1] // ratio
    slot = (w * ratio % max(16, ratio)) // ratio
    torch.testing.assert_close(entries_got[far, slot, -ROPE:], entries_want[far, slot, -ROPE:], atol=atol,
                               rtol=rtol)
    assert not torch.equal(got[2][far, slot], before[2][far, slot])


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_index_kernel_at_flash_shape(dtype, fp8) -> None:
    positions = [4095, 300_011, 130, 8191, 2, 65_535]
    case = index_case(positions, 4, INDEX_HEADS, INDEX_DIM, TOPK, dtype, "cuda", fp8=fp8, pad_context=1000)
    m, spec = 4, case.att.spec
    E = case.b.max_context // m
    from shared.engine.kernels.v4_index import index_scores

    got = index_scores(case.kv.index_keys[0], case.b.table, case.iq, case.weights, case.b.positions, m,
                       case.kv.block_tokens, E, spec.index_head_dim**-0.5, spec.index_heads**-0.5)
    e = torch.arange(E, device="cuda").expand(len(positions), E)
    blk, j = decode.entry_slots(case.b, e, m, case.kv.block_tokens)
    want = decode.index_scores.__wrapped__(case.kv.index_keys[0], blk, j, case.iq, case.weights, e,
                                           case.b.positions, m, spec.index_head_dim**-0.5, spec.index_heads**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    ids = case.select(True)
    ref = want.topk(TOPK, dim=-1)
    ref_ids = torch.where(ref.values == float("-inf"), -1, ref.indices)
    for r, p in enumerate(positions):
        a, b = set(ids[r][ids[r] >= 0].tolist()), set(ref_ids[r][ref_ids[r] >= 0].tolist())
        assert len(a) == len(b) == min(TOPK, (p + 1) // m)
        assert len(a & b) >= 0.98 * len(b)  # near-ties at the k-th score may round either way


def test_kernels_under_a_cuda_graph(monkeypatch) -> None:
    """The CSA layer's compressor update, its indexer's compressor update and the selection captured in one CUDA
    graph and replayed give the eager torch path's pools, keys and choice (fp32)."""
    _eager_reference(monkeypatch)
    rows = _rows(4)
    make = lambda d: compress_case(rows, 4, True, d, ROPE, torch.float32, "cuda", num_blocks=16)  # noqa: E731
    comp, index = make(D), make(INDEX_DIM)
    sel = index_case([r[1] for r in rows], 4, INDEX_HEADS, INDEX_DIM, TOPK, torch.float32, "cuda")
    sel.b = index.b
    sel.kv.index_keys[0] = index.store
    sel.kv.block_tokens = index.kv.block_tokens
    saved = [comp.state(), index.state()]

    def step(kernels: bool) -> torch.Tensor:
        comp.step(kernels)
        index.step(kernels)
        return sel.select(kernels)

    def restore() -> None:
        for case, state in zip((comp, index), saved):
            for t, s in zip((*case.rings, case.store), state):
                t.copy_(s)

    want_ids = step(False)
    want = [comp.state(), index.state()]
    restore()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(True)  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = step(True)
    restore()  # the capture ran nothing; the replay is the step
    graph.replay()
    torch.cuda.synchronize()
    for got_state, want_state in zip([comp.state(), index.state()], want):
        for a, b in zip(got_state, want_state):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for r in range(len(rows)):
        a, b = set(ids[r][ids[r] >= 0].tolist()), set(want_ids[r][want_ids[r] >= 0].tolist())
        assert len(a) == len(b) and len(a & b) >= 0.98 * len(b)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return v4_checkpoints.build_hub(tmp_path_factory.mktemp("v4comp"))


def test_model_decode_graphs_with_the_kernels_give_the_torch_paths_tokens(hub: Path) -> None:
    """The tiny model in fp32: decode steps replayed from CUDA graphs on the Triton path (the compressor and
    indexer kernels included) give the eager torch path's greedy tokens, and graphs were captured."""
    from shared.engine.engine import Engine, EngineRequest, run_to_completion
    from shared.schemas.generate import SamplingParams

    def requests() -> list[EngineRequest]:
        greedy = SamplingParams(temperature=0, max_tokens=24)
        return [EngineRequest(f"r{i}", torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(i))
                              .tolist(), greedy, max_new_tokens=24, stop_token_ids=[])
                for i, n in enumerate((5, 40, 23, 61))]

    torch_path = Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64, kernels="torch",
                        cuda_graphs=False)
    kernels = Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64, kernels="triton")
    assert kernels.model.attention.triton
    assert run_to_completion(kernels, requests()) == run_to_completion(torch_path, requests())
    assert kernels.runner.graphs is not None and kernels.runner.graphs.graphs
