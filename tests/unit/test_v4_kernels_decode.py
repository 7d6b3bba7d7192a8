"""Batched V4 decode attention (deepseek_v4/decode.py, kernels/v4_decode.py) against the per-sequence path.

One decode step of five sequences at once, on a tiny checkpoint with index_topk below the entry count: rows that
close a CSA and an HCA window this step, rows that close neither, a row just after a bounded replay (begin > 0:
window and compressor slots before it masked) and one still inside its restored prefix (its closing windows are
frozen: never rebuilt). Per layer kind, the batched torch path and the Triton kernel (interpreter, fp32) give
the loop's output, leave the same rings and paged entries, and CSA's indexer chooses the same entries; then the
whole model decodes with the kernels forced on and gives the torch path's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.engine.attention import AttentionMetadata, SeqSpan
from shared.engine.engine import Engine
from shared.engine.kv_quant import Fp8Rows, dequantize, storage
from shared.engine.models.deepseek_v4 import decode
from shared.engine.models.deepseek_v4.cache import V4Cache
from shared.engine.models.deepseek_v4.mhc import rms
from shared.engine.models.deepseek_v4.rope import rotate
from shared.engine.models.deepseek_v4.spec import CSA, HCA, SLIDING
from tests import v4_checkpoints

# CPU tensors through the interpreter; on a GPU machine tests/gpu/ runs these kernels at real shapes instead
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (tests/gpu covers CUDA)")

pytest.importorskip("triton")

TOPK = 2  # below the 7-9 entries the CSA rows see


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v4dec")
    v4_checkpoints.build(path, "mixed", index_topk=TOPK)
    return path


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, v4_checkpoints.BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


class Step:
    """Sequences prefilled through the per-sequence path, then one decode row each."""

    def __init__(self, engine: Engine) -> None:
        self.model, self.kv, self.bt = engine.model, engine.kv, engine.block_tokens
        self.tables: dict[str, list[int]] = {}
        self.next_block = 0

    def blocks(self, n: int) -> list[int]:
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def forward(self, rows: list[tuple[str, int, int]], seed: int) -> torch.Tensor:
        """rows: (request id, start, end) -> logits of the chunk [start, end) of each, token ids drawn at random."""
        spans, pos = [], []
        for rid, a, b in rows:
            spans.append(SeqSpan(len(pos), b - a, b, torch.tensor(self.tables[rid][: -(-b // self.bt)]), rid))
            pos += range(a, b)
        meta = AttentionMetadata(torch.zeros(len(pos), dtype=torch.long), spans)
        return self.model.logits(self.model.forward(_ids(len(pos), seed), torch.tensor(pos), meta, self.kv))

    def setup(self) -> list[tuple[str, int]]:
        """Prefill the batch; returns (request id, decode position) per row."""
        kv, bt = self.kv, self.bt
        lengths = {"a": 31, "b": 26, "c": 35}  # p + 1 = 32: closes CSA (m 4) and HCA (m 8); 27: neither; 36: CSA
        for rid, n in lengths.items():
            self.tables[rid] = self.blocks(3)
            kv.begin(rid, 0)
        self.forward([(rid, 0, n) for rid, n in lengths.items()], seed=1)
        self.tables["first"] = self.blocks(2)
        kv.begin("first", 0)
        self.forward([("first", 0, 2 * bt)], seed=2)
        # bounded replays over a private copy of first's blocks: begin 26, so positions 24-25 are masked
        # (window, CSA's previous half-window, HCA's window); "r" rebuilds windows from 28 on, "f" none before 32
        for rid, frozen in (("r", 28), ("f", 32)):
            self.tables[rid] = self.blocks(2) + self.blocks(1)
            kv.write_blocks(self.tables[rid][:2], kv.read_blocks(self.tables["first"]))
            kv.states[rid] = kv._fresh(26, 26, frozen)
        self.forward([("r", 26, 31), ("f", 26, 31)], seed=3)
        return [("a", 31), ("b", 26), ("c", 35), ("r", 31), ("f", 31)]

    def meta(self, rows: list[tuple[str, int]]) -> tuple[AttentionMetadata, torch.Tensor]:
        spans = [SeqSpan(j, 1, p + 1, torch.tensor(self.tables[rid][: -(-(p + 1) // self.bt)]), rid)
                 for j, (rid, p) in enumerate(rows)]
        return AttentionMetadata(torch.zeros(len(rows), dtype=torch.long), spans), torch.tensor([p for _, p in rows])


def _tensors(kv: V4Cache) -> list[torch.Tensor]:
    out = [storage(t) for t in kv.swa_pool] + list(kv._paged)  # FP8 stores: their packed bytes
    for pair in (*kv.comp_pool, *kv.index_pool):
        if pair is not None:
            out += pair
    return out


def _restore(kv: V4Cache, snapshot: list[torch.Tensor]) -> None:
    for t, saved in zip(_tensors(kv), snapshot):
        t.copy_(saved)


@pytest.fixture(scope="module")
def step(checkpoint: Path) -> tuple[Step, list[tuple[str, int]]]:
    s = Step(Engine(str(checkpoint), kv_blocks=64))
    return s, s.setup()


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_batched_decode_matches_the_loop(step, kind: str) -> None:
    st, rows = step
    model, kv, att = st.model, st.kv, st.model.attention
    i = model.spec.kinds.index(kind)
    layer = model.layers[i]
    meta, positions = st.meta(rows)
    x = rms(torch.randn(len(rows), model.spec.hidden_size, generator=torch.Generator().manual_seed(4)), None, 1e-6)
    angles = att.angles(positions)
    snapshot = [t.clone() for t in _tensors(kv)]
    results = {}
    for path in ("loop", "torch", "triton"):
        _restore(kv, snapshot)
        att.batched, att.triton = path != "loop", path == "triton"
        states = [kv.state(rid, p) for rid, p in rows]
        try:
            out = att(i, layer, x, positions, angles, meta, states, kv, att.decode_batch(meta, states, positions, kv))
        finally:
            att.batched = att.triton = False
        results[path] = (out, [t.clone() for t in _tensors(kv)])
    want, want_cache = results["loop"]
    assert any(not torch.equal(a, b) for a, b in zip(want_cache, snapshot))  # the step wrote rings / entries
    for path in ("torch", "triton"):
        got, cache = results[path]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=path)
        for a, b in zip(cache, want_cache):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=path)
    _restore(kv, snapshot)


def test_indexer_chooses_the_loops_entries(step) -> None:
    st, rows = step
    model, kv, att = st.model, st.kv, st.model.attention
    s = model.spec
    i = s.kinds.index(CSA)
    layer = model.layers[i]
    ix = layer.indexer
    assert ix is not None
    meta, positions = st.meta(rows)
    x = rms(torch.randn(len(rows), s.hidden_size, generator=torch.Generator().manual_seed(5)), None, 1e-6)
    cq, sq = att.angles(positions)["compress"]
    part = layer.wx.part
    q_res = rms(F.linear(x, part("wq_a")), layer.q_norm, s.rms_eps)
    iq = rotate(F.linear(q_res, layer.wq.part("indexer.wq_b")).view(len(rows), s.index_heads, s.index_head_dim),
                cq, sq)
    idx = (F.linear(x, part("indexer.compressor.wkv")), F.linear(x, part("indexer.compressor.wgate")), iq,
           F.linear(x, part("indexer.weights_proj")))
    snapshot = [t.clone() for t in _tensors(kv)]
    states = [kv.state(rid, p) for rid, p in rows]
    b = decode.batch_of(meta, states, positions)
    decode.compress(att, ix.compressor, kv.index_pool[i], idx[:2], b, kv.index_keys[i], kv, s.index_head_dim)
    ids = decode.select(att, i, layer, b, kv, iq, idx[3])
    _restore(kv, snapshot)
    for row, (span, state) in enumerate(zip(meta.spans, states)):
        p = span.context_len - 1
        visible = torch.tensor([(p + 1) // ix.compressor.ratio])
        chosen = att.select(layer, i, state, tuple(t[row : row + 1] for t in idx), p, span, kv, visible)
        want = set(chosen[0].nonzero()[:, 0].tolist())
        assert len(want) == TOPK < int(visible)  # sparse: fewer chosen than visible
        assert set(ids[row][ids[row] >= 0].tolist()) == want, span.request_id
    _restore(kv, snapshot)


def test_model_decodes_with_the_kernels_forced_on(tmp_path: Path) -> None:
    """The whole tiny model, five rows of a decode batch over three steps: logits of the batched path with its
    Triton kernel forced on equal the torch path's (the mHC kernels stay off: the interpreter is slow, and
    test_v4_parity runs them with this path through the engine). index_topk covers every entry here: with fewer,
    exact ties of the indexer's ReLU scores (0) may break either way between the paths (the selection is tested
    above)."""
    v4_checkpoints.build(tmp_path, "mixed")
    got = {}
    for kernels in ("torch", "triton"):
        st = Step(Engine(str(tmp_path), kv_blocks=64))
        st.model.attention.batched = st.model.attention.triton = kernels == "triton"
        rows = st.setup()
        steps = []
        for k in range(3):
            meta, positions = st.meta([(rid, p + k) for rid, p in rows])
            ids = _ids(len(rows), seed=10 + k)
            steps.append(st.model.logits(st.model.forward(ids, positions, meta, st.kv)))
        got[kernels] = torch.stack(steps)
    torch.testing.assert_close(got["triton"], got["torch"], atol=1e-4, rtol=0)


def _without_scratch(kv: V4Cache) -> list[torch.Tensor]:
    """Every pool and paged tensor less its scratch row (padding rows write there)."""
    pools = [t for t in _tensors(kv) if t.shape[0] == kv.slots + 1]
    paged = [t for t in kv._paged]
    return [t[: kv.slots].clone() for t in pools] + [t[: kv.scratch_block].clone() for t in paged]


def test_decode_graph_inputs_and_padding_give_the_forwards_step(tmp_path: Path) -> None:
    """The graph runner's body, run eagerly (no CUDA here): five rows packed into a batch bucket of 8 with
    padding rows and a context bucket past the longest row give the same logits as the model's forward on the
    same rows (and its streams), leave every real ring and entry as the forward does, and move each state's
    length on."""
    from types import SimpleNamespace

    from shared.engine.models.deepseek_v4.graphs import V4DecodeGraphs

    v4_checkpoints.build(tmp_path, "mixed")
    st = Step(Engine(str(tmp_path), kv_blocks=64))
    st.model.attention.batched = True  # the batched torch path (the kernel is checked against it above)
    rows = st.setup()
    kv = st.kv
    ids = _ids(len(rows), seed=20)
    snapshot = [t.clone() for t in _tensors(kv)]
    meta, positions = st.meta(rows)
    counted = st.model.expert_counts.clone()
    streams = st.model.forward(ids, positions, meta, kv)
    want = st.model.logits(streams)
    want_counts = st.model.expert_counts - counted  # the real rows' routing choices
    want_cache = _without_scratch(kv)
    _restore(kv, snapshot)
    for rid, p in rows:
        kv.states[rid].length = p  # as before the forward
    fed = torch.zeros(8, dtype=torch.long)
    graphs = V4DecodeGraphs(st.model, kv, torch.device("cpu"), 4 * st.bt, (1, 2, 4, 8), fed)
    chunks = []
    for j, (rid, p) in enumerate(rows):
        tokens = [0] * p + [int(ids[j])]
        chunks.append(SimpleNamespace(seq=SimpleNamespace(request_id=rid, token_ids=tokens,
                                                          block_table=st.tables[rid]),
                                      start=p, num_tokens=1, sample=True, drafts=[]))
    assert graphs.fits(chunks)
    counted = st.model.expert_counts.clone()
    got = graphs.run(chunks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert graphs.hidden is not None  # the real rows' streams too: what the MTP drafter advances on
    torch.testing.assert_close(graphs.hidden, streams, atol=1e-5, rtol=1e-5)
    assert int(want_counts.sum()) == len(rows) * st.model.spec.experts_per_token * st.model.spec.num_layers
    assert torch.equal(st.model.expert_counts - counted, want_counts)  # the three padding rows are not counted
    for a, b in zip(_without_scratch(kv), want_cache):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # fp32 sums in another order
    assert [kv.states[rid].length for rid, _ in rows] == [p + 1 for _, p in rows]
    assert not graphs.fits([SimpleNamespace(**{**vars(chunks[0]), "num_tokens": 2})])  # a prefill chunk


def test_engine_with_triton_ops_takes_the_batched_path(checkpoint: Path) -> None:
    assert Engine(str(checkpoint), kv_blocks=8, kernels="triton").model.attention.batched
    assert not Engine(str(checkpoint), kv_blocks=8).model.attention.batched


def test_slots_run_out_clearly(checkpoint: Path) -> None:
    kv = Engine(str(checkpoint), kv_blocks=8, max_running=1).kv
    assert kv.slots == 2  # max_running and as many held (and one scratch row, never lent)
    kv.begin("x", 0)
    kv.begin("y", 0)
    kv.begin("x", 0)  # a resumed request keeps to one slot
    with pytest.raises(RuntimeError, match="slots are in use"):
        kv.begin("z", 0)
    kv.drop_state("y")
    assert kv.begin("z", 0) == 0 and kv.states["z"].slot != kv.states["x"].slot


@pytest.fixture(scope="module")
def fp8_step(checkpoint: Path) -> tuple[Step, list[tuple[str, int]]]:
    s = Step(Engine(str(checkpoint), kv_blocks=64, kv_cache_dtype="fp8"))
    return s, s.setup()


def _with_padding_row(b: decode.DecodeBatch, kv: V4Cache, bt: int) -> decode.DecodeBatch:
    """b and one padding row as the graph runner packs it (graphs.py): position 0 in the scratch slot with a
    table of the scratch block, and a context bucket past the longest row (HCA's grid covers masked entries)."""
    def one(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.tensor([value])])

    table = torch.cat([b.table, torch.full((1, b.table.shape[1]), kv.scratch_block)])
    table = F.pad(table, (0, 1), value=kv.scratch_block)
    return decode.DecodeBatch(one(b.slots, kv.scratch_slot), one(b.positions, 0), one(b.begins, 0),
                              one(b.frozen, 0), table, table.shape[1] * bt)


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_fp8_kernel_reads_the_packed_rows_as_the_torch_path(fp8_step, kind: str, monkeypatch) -> None:
    """--kv-cache-dtype fp8: one decode step of the five rows and a padding row, the batched torch path (its
    gathers dequantize the packed rows) against the Triton kernels reading and writing the same bytes
    themselves. The rings hold the same bytes; the paged stores the same values (the compressor kernel packs
    entries whose float32 sums round apart from torch's by an ulp, so a scale's bytes may differ); the
    attention reads them (fp32 compute): equal up to the order of the sums."""
    from shared.engine.kernels import v4_decode

    st, rows = fp8_step
    model, kv, att = st.model, st.kv, st.model.attention
    i = model.spec.kinds.index(kind)
    layer = model.layers[i]
    assert isinstance(kv.swa_pool[i], Fp8Rows) and (kind == SLIDING or isinstance(kv.entries[i], Fp8Rows))
    meta, positions = st.meta(rows)
    states = [kv.state(rid, p) for rid, p in rows]
    batch = _with_padding_row(decode.batch_of(meta, states, positions), kv, st.bt)
    x = rms(torch.randn(len(rows) + 1, model.spec.hidden_size, generator=torch.Generator().manual_seed(6)), None,
            1e-6)
    angles = att.angles(batch.positions)
    launches = []

    def counted(*args, **kwargs) -> torch.Tensor:
        launches.append(args[1])
        return decode_attention(*args, **kwargs)

    decode_attention = v4_decode.decode_attention
    monkeypatch.setattr(v4_decode, "decode_attention", counted)
    snapshot = [t.clone() for t in _tensors(kv)]
    results = {}
    for path in ("torch", "triton"):
        _restore(kv, snapshot)
        att.batched, att.triton = True, path == "triton"
        try:
            out = att(i, layer, x, batch.positions, angles, None, [], kv, batch)
        finally:
            att.batched = att.triton = False
        results[path] = (out, [t.clone() for t in _tensors(kv)])
    _restore(kv, snapshot)
    assert len(launches) == 1 and isinstance(launches[0], Fp8Rows)  # the kernel ran, on the packed ring
    (want, want_cache), (got, cache) = results["torch"], results["triton"]
    assert any(not torch.equal(a, b) for a, b in zip(want_cache, snapshot))  # the step wrote rings / entries
    paged = range(len(kv.swa_pool), len(kv.swa_pool) + len(kv._paged))
    assert all(torch.equal(a, b) for n, (a, b) in enumerate(zip(cache, want_cache)) if n not in paged)
    stores = [t for pair in zip(kv.entries, kv.index_keys) for t in pair if t is not None]
    for n, store in zip(paged, stores):
        assert isinstance(store, Fp8Rows)
        torch.testing.assert_close(dequantize(cache[n], store.layout, torch.float32),
                                   dequantize(want_cache[n], store.layout, torch.float32), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
