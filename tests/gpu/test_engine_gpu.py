"""The engine on a GPU in bf16 (marked gpu: skipped without CUDA): CUDA graphs, split decode, device sampling."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.random_model import SHAPES, random_llama
from shared.schemas.generate import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPES["smollm2-135m"], "cuda", seed=1)


def prompts(n: int, seed: int, lo: int = 5, hi: int = 300) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, 49152) for _ in range(r.randrange(lo, hi))] for _ in range(n)]


def reqs(ps: list[list[int]], n: int, sampling: SamplingParams = GREEDY, tag: str = "r") -> list[EngineRequest]:
    return [EngineRequest(f"{tag}{i}", p, sampling, n) for i, p in enumerate(ps)]


def test_graphs_match_eager_and_torch_ops(model) -> None:
    """40 sequences (graph buckets 48, 32, 16, ... as they finish) give the same greedy tokens with and without
    graphs, and agree with the torch ops (bf16 rounding may flip a near-tie late in a sequence, so the first
    tokens must match exactly and most of the rest)."""
    ps = prompts(40, 0)
    graphs = Engine(model, device="cuda", kv_blocks=2048, max_running=64)
    eager = Engine(model, device="cuda", kv_blocks=2048, max_running=64, cuda_graphs=False)
    torch_ops = Engine(model, device="cuda", kv_blocks=2048, max_running=64, kernels="torch")
    a = run_to_completion(graphs, reqs(ps, 12))
    assert a == run_to_completion(eager, reqs(ps, 12))
    b = run_to_completion(torch_ops, reqs(ps, 12))
    assert all(a[k][:2] == b[k][:2] for k in a)
    assert sum(a[k] == b[k] for k in a) >= 0.8 * len(a)
    assert graphs.runner.graphs is not None and len(graphs.runner.graphs.graphs) >= 2


def test_warmed_up_graphs_change_nothing(model) -> None:
    """Every (batch, context) bucket captured before any request (Engine.warm_up): the same tokens as eager, and
    serving captures no more."""
    ps = prompts(10, 1)
    engine = Engine(model, device="cuda", kv_blocks=2048, max_running=16)
    graphs = engine.runner.graphs
    assert graphs is not None
    buckets = len(graphs.sizes) * len(graphs.context_buckets)
    assert engine.warm_up() == buckets
    eager = Engine(model, device="cuda", kv_blocks=2048, max_running=16, cuda_graphs=False)
    assert run_to_completion(engine, reqs(ps, 8)) == run_to_completion(eager, reqs(ps, 8))
    assert len(graphs.graphs) == buckets


def test_long_context_split_decode_matches_torch_ops(model) -> None:
    """Contexts over several 256-token partitions of the split decode kernel, fp32 end to end."""
    m32 = random_llama(SHAPES["smollm2-135m"], "cuda", seed=2)
    ps = prompts(3, 1, lo=600, hi=1500)
    fast = Engine(m32, device="cuda", dtype=torch.float32, kv_blocks=512)
    ref = Engine(m32, device="cuda", dtype=torch.float32, kv_blocks=512, kernels="torch")
    assert run_to_completion(fast, reqs(ps, 8)) == run_to_completion(ref, reqs(ps, 8))


def test_seeded_sampling_is_batch_independent() -> None:
    """fp32: in bf16 a different batch size picks another GEMM algorithm, and random weights give near-uniform
    probabilities whose draws flip on that rounding (seen on the H200); the sampler itself is checked exactly."""
    from shared.engine.sampler import sample_on_device
    from shared.engine.sequence import SamplingSpec

    logits = torch.randn(6, 49152, device="cuda")
    spec = SamplingSpec(0.8, 50, 0.9, 1234)
    one = sample_on_device(logits[2:3], [spec], [7]).item()
    assert sample_on_device(logits, [SamplingSpec(0.0, 0, 1.0, 0)] * 2 + [spec] * 4, [0, 0, 7, 1, 2, 3])[2] == one
    m32 = random_llama(SHAPES["smollm2-135m"], "cuda", seed=3)
    hot = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    ps = prompts(9, 2)
    engine = Engine(m32, device="cuda", dtype=torch.float32, kv_blocks=2048)
    alone = run_to_completion(engine, [EngineRequest("x", ps[0], hot, 10)])["x"]
    mixed = run_to_completion(engine, [EngineRequest("x", ps[0], hot, 10)] + reqs(ps[1:], 6, GREEDY, "g"))["x"]
    assert alone == mixed
    other = run_to_completion(engine, [EngineRequest("y", ps[0], SamplingParams(temperature=0.8, seed=99), 10)])
    assert other["y"] != alone
    assert engine.stats().free_blocks == 2048


def test_bf16_logits_close_to_fp32(model) -> None:
    m32 = {k: v.float() for k, v in model.weights.items()}
    from shared.engine.loader import LoadedModel

    ids = prompts(1, 3)[0]
    out = []
    for dtype, weights in ((torch.bfloat16, model.weights), (torch.float32, m32)):
        engine = Engine(LoadedModel("m", model.config, weights), device="cuda", dtype=dtype, kv_blocks=64)
        engine.add(EngineRequest("l", ids, GREEDY, 1))
        out.append(engine.runner.run(engine.scheduler.schedule())[0].float())
        assert out[-1].dtype == torch.float32
    rel = (out[0] - out[1]).norm() / out[1].norm()
    assert rel < 3e-2


def overlap_run(engine: Engine, ps: list[list[int]], stop: list[int]) -> dict[str, list[int]]:
    """Mixed lengths and finishes: max_new_tokens 2..24, stop tokens, seeded rows, late joiners, an abort."""
    hot = SamplingParams(temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    out: dict[str, list[int]] = {}
    finished: set[str] = set()
    for i, p in enumerate(ps[:20]):
        engine.add(EngineRequest(f"a{i}", p, hot if i % 5 == 0 else GREEDY, 2 + i, stop_token_ids=stop))
    step = 0
    while engine.has_work():
        if step == 3:
            for i, p in enumerate(ps[20:]):
                engine.add(EngineRequest(f"b{i}", p, GREEDY, 3 + 2 * i, stop_token_ids=stop))
        if step == 5:
            engine.abort("a19")
        for o in engine.step():
            assert o.request_id not in finished
            out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finish_reason is not None:
                finished.add(o.request_id)
        step += 1
    ids = {f"a{i}" for i in range(20)} | {f"b{i}" for i in range(len(ps) - 20)}
    assert finished | {"a19"} == ids and engine.stats().free_blocks == engine.stats().total_blocks
    out.pop("a19", None)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overlapped_equals_synchronous(model, dtype) -> None:
    """Overlapped scheduling (device-side token feedback, one-step-late read-back) gives the same tokens as the
    synchronous path, with CUDA graphs, for a batch with mixed lengths and finishes."""
    m = model  # fp32 draws, cast by each engine to its dtype
    ps = prompts(26, 4, lo=5, hi=200)
    sync = Engine(m, device="cuda", dtype=dtype, kv_blocks=2048, max_running=32)
    sync.overlap = False
    probe = run_to_completion(sync, reqs(ps[:4], 10, tag="p"))
    stop = [probe["p0"][3], probe["p1"][5], probe["p3"][1]]
    expected = overlap_run(sync, ps, stop)
    fast = Engine(m, device="cuda", dtype=dtype, kv_blocks=2048, max_running=32)
    assert fast.overlap
    got = overlap_run(fast, ps, stop)
    assert got == expected
    assert sum(len(v) < 2 + int(k[1:]) for k, v in expected.items() if k[0] == "a") >= 1  # some stopped early


def test_processors_on_the_device_paths() -> None:
    """Repetition penalty, min_tokens and min_p through the GPU's paths (batched sampling, CUDA graphs, the
    overlapped steps whose last token the host has not seen yet): fp32, the same tokens as synchronous eager
    steps; and the processors' device work equals the CPU's on the same logits."""
    from shared.engine.processors import LogitsProcessors
    from shared.engine.scheduler import Chunk
    from shared.engine.sequence import SamplingSpec, Sequence

    m32 = random_llama(SHAPES["smollm2-135m"], "cuda", seed=6)
    ps = prompts(12, 6, lo=5, hi=120)
    sync = Engine(m32, device="cuda", dtype=torch.float32, kv_blocks=2048, max_running=32, cuda_graphs=False)
    sync.overlap = False
    held = [2, 6, 10]  # the min_tokens rows: their stop ids are the first tokens greedy gives them
    probe = run_to_completion(sync, [EngineRequest(f"p{i}", ps[i], GREEDY, 4) for i in held])
    stop = sorted({t for v in probe.values() for t in v})

    def requests() -> list[EngineRequest]:
        kinds = [SamplingParams(temperature=0, ignore_eos=True, repetition_penalty=1.5),
                 SamplingParams(temperature=0.8, seed=9, min_p=0.1, repetition_penalty=1.3, ignore_eos=True),
                 SamplingParams(temperature=0, stop_token_ids=stop, min_tokens=6),
                 GREEDY]
        return [EngineRequest(f"r{i}", p, kinds[i % 4], 16) for i, p in enumerate(ps)]

    expected = run_to_completion(sync, requests())
    assert all(len(expected[f"r{i}"]) >= 6 and not set(expected[f"r{i}"][:6]) & set(stop) for i in held)
    assert expected["r0"] != run_to_completion(sync, [EngineRequest("g", ps[0], GREEDY, 16)])["g"]
    fast = Engine(m32, device="cuda", dtype=torch.float32, kv_blocks=2048, max_running=32)
    assert fast.overlap
    assert run_to_completion(fast, requests()) == expected
    assert fast.runner.graphs is None or fast.runner.graphs.graphs  # decode steps replayed graphs (with Triton)
    # and no step waits for the device (the penalty's token sets grow on it): the host stays a step ahead
    for r in requests():
        fast.add(r)
    for _ in range(4):
        fast.step()  # prefill; the graphs of this batch were captured by the run above
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            fast.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while fast.has_work():
        fast.step()

    logits = torch.randn(3, 49152, device="cuda")
    seqs = [Sequence(f"s{i}", [5, 9, 5, 70 + i], SamplingSpec(0.0, 0, 1.0, 0, repetition_penalty=1.7, min_tokens=2),
                     frozenset({2, 11}), 8, 0, False) for i in range(3)]
    rows = [(Chunk(s, 3, 2, True, (40,)), r) for s in seqs[:1] for r in (0, 1)] + [(Chunk(seqs[1], 3, 1, True), 0)]
    outs = [LogitsProcessors(49152, torch.device(d)).apply(logits.to(d), rows, [1, 2, 0]).cpu() for d in ("cpu", "cuda")]
    assert torch.equal(outs[0], outs[1])


def test_penalties_bias_and_logprobs_on_the_device_paths() -> None:
    """presence / frequency penalties, logit_bias and logprobs through the overlapped steps and CUDA graphs
    (fp32): the same tokens as synchronous eager steps, logprobs as close as one forward to another, and no step
    waits for the device (the output counts grow on it, the logprobs come back with the tokens)."""
    m32 = random_llama(SHAPES["smollm2-135m"], "cuda", seed=7)
    ps = prompts(12, 7, lo=5, hi=120)
    sync = Engine(m32, device="cuda", dtype=torch.float32, kv_blocks=2048, max_running=32, cuda_graphs=False)
    sync.overlap = False

    def requests() -> list[EngineRequest]:
        kinds = [SamplingParams(temperature=0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0),
                 SamplingParams(temperature=0.8, seed=9, ignore_eos=True, frequency_penalty=2.0, logprobs=3),
                 SamplingParams(temperature=0, ignore_eos=True, logit_bias={300: 100.0}, logprobs=0),
                 GREEDY]
        return [EngineRequest(f"r{i}", p, kinds[i % 4], 16) for i, p in enumerate(ps)]

    def run(engine: Engine) -> tuple[dict[str, list[int]], dict[str, list]]:
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        for r in requests():
            engine.add(r)
        while engine.has_work():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
                logprobs.setdefault(o.request_id, []).extend(o.logprobs or [])
        return tokens, logprobs

    expected, want_lp = run(sync)
    assert all(v == [300] * 16 for k, v in expected.items() if int(k[1:]) % 4 == 2)  # +100 forces it
    assert all(len(want_lp[k]) == 16 for k in expected if int(k[1:]) % 4 in (1, 2))
    assert not any(want_lp[k] for k in expected if int(k[1:]) % 4 in (0, 3))
    fast = Engine(m32, device="cuda", dtype=torch.float32, kv_blocks=2048, max_running=32)
    assert fast.overlap
    got, got_lp = run(fast)
    assert got == expected
    for k, want in want_lp.items():
        assert [lp.top_ids for lp in got_lp[k]] == [lp.top_ids for lp in want]
        assert [lp.logprob for lp in got_lp[k]] == pytest.approx([lp.logprob for lp in want], abs=1e-3)
    for r in requests():
        fast.add(r)
    for _ in range(4):
        fast.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            fast.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while fast.has_work():
        fast.step()


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_speculative_overlap_and_graphs_change_nothing(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt lookup on the GPU in fp32 with overlap and CUDA graphs on (a step without drafts overlaps the next
    launch when the gate says so; draft-free decode steps replay graphs; verify steps run eager): the tokens of
    the synchronous, graph-free path without speculation. A batch of 16+ is "full" here: the adaptive policy
    drafts nothing there and overlaps."""
    from shared.engine import verify_policy

    monkeypatch.setattr(verify_policy, "LOAD_FULL", 4)
    monkeypatch.setattr(verify_policy, "LOAD_NONE", 16)
    m = random_llama(SHAPES["smollm2-135m"], "cuda", seed=1)
    ps = prompts(26, 4, lo=5, hi=200)
    sync = Engine(m, device="cuda", dtype=torch.float32, kv_blocks=2048, max_running=32, cuda_graphs=False)
    sync.overlap = False
    probe = run_to_completion(sync, reqs(ps[:4], 10, tag="p"))
    stop = [probe["p0"][3], probe["p1"][5], probe["p3"][1]]
    expected = overlap_run(sync, ps, stop)
    spec = Engine(m, device="cuda", dtype=torch.float32, kv_blocks=2048, max_running=32, speculative_tokens=3,
                  speculative_method="ngram", speculative_policy=policy)
    assert spec.overlap
    assert overlap_run(spec, ps, stop) == expected
    assert spec.spec_verifies > 0 and (spec.overlapped > 0 or policy == "fixed")
    assert spec.runner.graphs is not None and spec.runner.graphs.graphs  # draft-free steps replayed graphs
