"""A tiny random Llama HF checkpoint on every device there is: CPU always, CUDA when present (marked gpu), and
against transformers' own LlamaForCausalLM when it is installed (the oracle for our model code)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shared import hashing
from shared.engine import verify_policy
from shared.engine.engine import Engine, EngineRequest, RequestError, run_to_completion
from shared.engine.loader import LoadedModel, load
from shared.models import resolve
from shared.schemas.generate import SamplingParams

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 384, "hidden_size": 128,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]
PROMPTS = [[1, 5, 9, 77, 3], list(range(3, 60)), [1] + list(range(100, 140))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-llama")
    c = CONFIG
    g = torch.Generator().manual_seed(0)
    hd, H, KV, D, I = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"], \
        c["intermediate_size"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08  # small enough that activations stay tame

    weights = {"model.embed_tokens.weight": rand(c["vocab_size"], D), "lm_head.weight": rand(c["vocab_size"], D),
               "model.norm.weight": 1 + rand(D)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + rand(D), p + "post_attention_layernorm.weight": 1 + rand(D),
            p + "self_attn.q_proj.weight": rand(H * hd, D), p + "self_attn.k_proj.weight": rand(KV * hd, D),
            p + "self_attn.v_proj.weight": rand(KV * hd, D), p + "self_attn.o_proj.weight": rand(D, H * hd),
            p + "mlp.gate_proj.weight": rand(I, D), p + "mlp.up_proj.weight": rand(I, D),
            p + "mlp.down_proj.weight": rand(D, I),
        }
    save_file(weights, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(c))
    return root


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> LoadedModel:
    return load(resolve(str(checkpoint)))


def prompt_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    engine.add(EngineRequest("logits", ids, SamplingParams(temperature=0), 1))
    logits = engine.runner.run(engine.scheduler.schedule())[0]
    engine.abort("logits")
    return logits.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_batched_chunked_and_imported_runs_agree(loaded: LoadedModel, device: str) -> None:
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    engine = Engine(loaded, device=device, dtype=torch.float32, kv_blocks=32)
    alone = [run_to_completion(engine, [EngineRequest(f"a{i}", p, greedy, 6)])[f"a{i}"]
             for i, p in enumerate(PROMPTS)]
    chunked = Engine(loaded, device=device, dtype=torch.float32, kv_blocks=32, max_batch_tokens=9)
    together = run_to_completion(chunked, [EngineRequest(f"b{i}", p, greedy, 6) for i, p in enumerate(PROMPTS)])
    assert [together[f"b{i}"] for i in range(len(PROMPTS))] == alone
    first = run_to_completion(engine, [EngineRequest("h", PROMPTS[1], greedy, 1, hold_kv=True)])["h"]
    blobs = engine.export_blocks("h", 0, 4)
    engine.release("h")
    rest = run_to_completion(chunked, [EngineRequest("c", PROMPTS[1] + first, greedy, 5, output_offset=1,
                                                     prefix_blocks=blobs, prefix_tokens=len(PROMPTS[1]))])["c"]
    assert first + rest == alone[1]
    hot = SamplingParams(temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    seeded = [run_to_completion(e, [EngineRequest("s", PROMPTS[2], hot, 8)])["s"] for e in (engine, chunked)]
    assert seeded[0] == seeded[1]
    assert engine.stats().free_blocks == 32 and chunked.stats().free_blocks == 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(loaded: LoadedModel) -> None:
    cpu = prompt_logits(Engine(loaded, kv_blocks=8), PROMPTS[1])
    fp32 = prompt_logits(Engine(loaded, device="cuda", dtype=torch.float32, kv_blocks=8), PROMPTS[1])
    bf16 = prompt_logits(Engine(loaded, device="cuda", kv_blocks=8), PROMPTS[1])  # default dtype on a GPU
    assert torch.allclose(cpu, fp32, atol=1e-3, rtol=1e-3)
    assert (cpu - bf16).abs().max() < 0.1 * cpu.abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_matches_transformers(checkpoint: Path, loaded: LoadedModel, device: str) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.float32)
    ref = ref.to(device).eval()
    engine = Engine(loaded, device=device, dtype=torch.float32, kv_blocks=8)
    for ids in PROMPTS:
        with torch.no_grad():
            expected = ref(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
        assert torch.allclose(prompt_logits(engine, ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_ops_match_torch_ops(loaded: LoadedModel, device: str) -> None:
    """The Triton path (fused kernels, batched metadata; on CUDA also decode CUDA graphs) against the torch ops:
    same logits, same tokens through batching, chunked prefill over a cached prefix and a KV import. On a CPU
    the kernels run in Triton's interpreter (fp32)."""
    pytest.importorskip("triton")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU tensors need the interpreter (set where there is no GPU)")
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    ref = Engine(loaded, device=device, dtype=torch.float32, kv_blocks=32, kernels="torch")
    fast = Engine(loaded, device=device, dtype=torch.float32, kv_blocks=32, kernels="triton")
    chunked = Engine(loaded, device=device, dtype=torch.float32, kv_blocks=32, kernels="triton", max_batch_tokens=9)
    for ids in PROMPTS:
        assert torch.allclose(prompt_logits(fast, ids), prompt_logits(ref, ids), atol=1e-4, rtol=1e-4)
    reqs = [EngineRequest(f"r{i}", p, greedy, 6) for i, p in enumerate(PROMPTS)]
    expected = run_to_completion(ref, reqs)
    for engine in (fast, chunked):
        assert run_to_completion(engine, [EngineRequest(f"r{i}", p, greedy, 6) for i, p in enumerate(PROMPTS)]) \
            == expected
    first = run_to_completion(ref, [EngineRequest("h", PROMPTS[1], greedy, 1, hold_kv=True)])["h"]
    blobs = ref.export_blocks("h", 0, 4)
    ref.release("h")
    rest = run_to_completion(chunked, [EngineRequest("c", PROMPTS[1] + first, greedy, 5, output_offset=1,
                                                     prefix_blocks=blobs, prefix_tokens=len(PROMPTS[1]))])["c"]
    assert first + rest == expected["r1"]
    assert fast.stats().free_blocks == 32 and chunked.stats().free_blocks == 32


def overlap_workload(engine: Engine, stop: list[int]) -> dict[str, list[int]]:
    """Mixed lengths and finishes (stop tokens, max_new_tokens, an abort), requests joining mid-run; every
    output is checked for the one-step lag's rule: nothing after a finish, a finish exactly once."""
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    hot = SamplingParams(temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    first = [EngineRequest(f"a{i}", p, greedy, n, stop_token_ids=stop) for i, (p, n) in
             enumerate(zip(PROMPTS, (9, 3, 12)))]
    later = [EngineRequest("b0", PROMPTS[0] + [7], hot, 6, stop_token_ids=stop),
             EngineRequest("b1", PROMPTS[1][:20], greedy, 1), EngineRequest("x", PROMPTS[2], greedy, 30)]
    out: dict[str, list[int]] = {}
    finished: set[str] = set()
    for r in first:
        engine.add(r)
    step = 0
    while engine.has_work():
        if step == 2:
            for r in later:
                engine.add(r)
        if step == 6:
            engine.abort("x")
        for o in engine.step():
            assert o.request_id not in finished, "an output after the finish"
            out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finish_reason is not None:
                finished.add(o.request_id)
                assert len(out[o.request_id]) <= 30 and (o.finish_reason == "length") != (o.token_ids[-1] in stop)
        step += 1
    assert finished == {"a0", "a1", "a2", "b0", "b1"}
    assert engine.stats().free_blocks == engine.stats().total_blocks and engine.stats().running == 0
    out.pop("x", None)  # aborted: how far it got depends on the lag
    return out


@pytest.fixture(scope="module")
def synchronous(loaded: LoadedModel) -> tuple[list[int], dict[str, list[int]]]:
    """The overlap workload's stop tokens and its outputs on the synchronous path without speculation."""
    sync = Engine(loaded, dtype=torch.float32, kv_blocks=32)
    probe = run_to_completion(sync, [EngineRequest(f"p{i}", p, SamplingParams(temperature=0, ignore_eos=True), 12)
                                     for i, p in enumerate(PROMPTS)])
    stop = [probe["p0"][4], probe["p2"][2]]  # tokens these prompts produce mid-run: some stop early
    expected = overlap_workload(sync, stop)
    assert any(len(v) < n for v, n in ((expected["a0"], 9), (expected["a2"], 12)))  # a stop did happen
    return stop, expected


def test_overlapped_steps_match_synchronous(loaded: LoadedModel,
                                            synchronous: tuple[list[int], dict[str, list[int]]]) -> None:
    """The overlapped path (one-step lag, placeholders read from the device copy of the last tokens), run on
    the CPU here with the torch ops: the same tokens and finishes as the synchronous path."""
    stop, expected = synchronous
    fast = Engine(loaded, dtype=torch.float32, kv_blocks=32)
    fast.overlap = True
    assert overlap_workload(fast, stop) == expected
    assert fast.overlapped > 0


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_speculative_overlapped_steps_match_synchronous(loaded: LoadedModel, policy: str,
                                                        synchronous: tuple[list[int], dict[str, list[int]]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt lookup with overlap on: steps with drafts resolve before the next launch, steps without overlap it
    (a batch of 3+ is "full" here, so the adaptive policy drafts nothing there and overlaps; fixed K overlaps
    only after passes that found nothing). Greedy and seeded rows, stops, an abort: plain decoding's tokens."""
    monkeypatch.setattr(verify_policy, "LOAD_FULL", 1)
    monkeypatch.setattr(verify_policy, "LOAD_NONE", 3)
    stop, expected = synchronous
    engine = Engine(loaded, dtype=torch.float32, kv_blocks=32, speculative_tokens=3, speculative_method="ngram",
                    speculative_policy=policy)
    engine.overlap = True
    assert overlap_workload(engine, stop) == expected
    assert engine.spec_verifies > 0  # some steps verified drafts ...
    if policy == "adaptive":
        assert engine.overlapped > 0  # ... and some overlapped the next launch
    assert not engine.policy_state()


def test_local_prefix_cache_is_shared_only_within_a_salt(checkpoint: Path) -> None:
    """Tenant isolation: a prompt cached for one salt (tenant / cache_salt) is recomputed for another."""
    engine = Engine(str(checkpoint), kv_blocks=64)
    prompt = list(range(3, 60))

    def cached(rid: str, salt: str) -> int:
        engine.add(EngineRequest(rid, prompt, SamplingParams(temperature=0), max_new_tokens=2, cache_salt=salt))
        reported = 0
        while engine.has_work():
            for out in engine.step():
                reported = out.num_cached_tokens
        return reported

    assert cached("a1", "tenant-a") == 0
    assert cached("a2", "tenant-a") == 48  # three full blocks of the first request, found again
    assert cached("b1", "tenant-b") == 0  # same tokens, another tenant: never shared
    assert cached("a3", "tenant-a") == 48


def test_prefix_blocks_the_engine_holds_need_not_travel(checkpoint: Path) -> None:
    """b"" in prefix_blocks stands for a block the engine's own prefix cache holds: it is not imported; where the
    engine no longer holds it, the imported prefix stops there and the rest is computed. Tokens never change."""
    greedy = SamplingParams(temperature=0)
    prompt = list(range(3, 60))  # 57 tokens: 3 full blocks + 9
    source = Engine(str(checkpoint), kv_blocks=64)
    want = run_to_completion(source, [EngineRequest("src", prompt, greedy, 6, hold_kv=True)])["src"]
    blobs = source.export_blocks("src", 0, 4)
    engine = Engine(str(checkpoint), kv_blocks=64)
    run_to_completion(engine, [EngineRequest("warm", prompt[:40], greedy, 1)])  # caches blocks 0 and 1 here
    hashes = hashing.block_hashes(prompt, hashing.namespace(engine.cache_id), engine.block_tokens)
    assert engine.cached_blocks(hashes) == 2

    def run(rid: str, prefix: list[bytes]) -> tuple[list[int], int]:
        engine.add(EngineRequest(rid, prompt, greedy, 6, prefix_blocks=prefix, prefix_tokens=len(prompt)))
        tokens, cached = [], 0
        while engine.has_work():
            for out in engine.step():
                tokens += out.token_ids
                cached = out.num_cached_tokens
        return tokens, cached

    assert run("gone", [b"", b"", b"", blobs[3]]) == (want, 32)  # block 2 is not here: computed from 32 on
    assert run("held", [b"", b"", b"", blobs[3]]) == (want, 56)  # now it is (the last request left it)


# --- repetition penalty, min_tokens, min_p through the engine --------------------------------------------------

FEW = list(range(200, 216))  # the only tokens that are not stop ids in the min_tokens tests below
ALL_BUT_FEW = [t for t in range(CONFIG["vocab_size"]) if t not in FEW]


def test_greedy_repetition_penalty_is_the_reference_and_stops_the_repeats(loaded: LoadedModel) -> None:
    prompt, n, penalty = PROMPTS[0], 24, 5.0
    engine = Engine(loaded, dtype=torch.float32, kv_blocks=32)
    plain = run_to_completion(engine, [EngineRequest("p", prompt, SamplingParams(temperature=0, ignore_eos=True),
                                                     n)])["p"]
    assert len(set(plain)) < len(plain)  # the plain greedy run repeats itself
    sampling = SamplingParams(temperature=0, ignore_eos=True, repetition_penalty=penalty)
    got = run_to_completion(engine, [EngineRequest("r", prompt, sampling, n)])["r"]
    want: list[int] = []
    for _ in range(n):  # the definition: every token id held so far penalised, then argmax
        logits = prompt_logits(engine, prompt + want).clone()
        for t in set(prompt + want):
            logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        want.append(int(logits.argmax()))
    assert got == want
    assert len(set(got)) == len(got) and not set(got) & set(prompt)  # this strong a penalty: no repeats at all


def test_greedy_presence_frequency_and_logit_bias_are_the_reference(loaded: LoadedModel) -> None:
    """OpenAI's definition step by step on the model's own logits: the bias added, then each output id's
    logit lowered by frequency x its count + presence; the prompt's ids are not counted."""
    prompt, n = PROMPTS[0], 16
    engine = Engine(loaded, dtype=torch.float32, kv_blocks=32)
    plain = run_to_completion(engine, [EngineRequest("p", prompt, SamplingParams(temperature=0, ignore_eos=True),
                                                     n)])["p"]
    bias = {plain[0]: -100.0, 17: 3.0}  # the plain run's first token banned
    sampling = SamplingParams(temperature=0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.75,
                              logit_bias=bias)
    got = run_to_completion(engine, [EngineRequest("r", prompt, sampling, n)])["r"]
    want: list[int] = []
    for _ in range(n):
        logits = prompt_logits(engine, prompt + want).clone()
        for t, b in bias.items():
            logits[t] += b
        for t in set(want):
            logits[t] -= 0.75 * want.count(t) + 1.5
        want.append(int(logits.argmax()))
    assert got == want and plain[0] not in got and got != plain


def test_logit_bias_plus_100_forces_a_token(loaded: LoadedModel) -> None:
    engine = Engine(loaded, dtype=torch.float32, kv_blocks=32)
    sampling = SamplingParams(temperature=1.0, seed=3, ignore_eos=True, logit_bias={250: 100.0})
    assert run_to_completion(engine, [EngineRequest("f", PROMPTS[2], sampling, 8)])["f"] == [250] * 8


def test_a_logit_bias_outside_the_vocabulary_is_a_request_error(loaded: LoadedModel) -> None:
    engine = Engine(loaded, dtype=torch.float32, kv_blocks=32)
    with pytest.raises(RequestError, match="logit_bias token ids"):
        engine.add(EngineRequest("x", PROMPTS[0], SamplingParams(logit_bias={CONFIG["vocab_size"]: 1.0}), 4))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_min_tokens_holds_the_stop_ids_back_then_lets_them_stop(loaded: LoadedModel, overlap: bool) -> None:
    """Nearly every token is a stop id: the plain run stops at once; with min_tokens the first min_tokens
    tokens come from the few others and the next one stops."""
    engine = Engine(loaded, dtype=torch.float32, kv_blocks=32)
    engine.overlap = overlap
    base = {"temperature": 0, "stop_token_ids": ALL_BUT_FEW}
    assert len(run_to_completion(engine, [EngineRequest("p", PROMPTS[1], SamplingParams(**base), 20)])["p"]) == 1
    for min_tokens in (1, 5):
        engine.add(EngineRequest("m", PROMPTS[1], SamplingParams(**base, min_tokens=min_tokens), 20))
        outs = []
        while engine.has_work():
            outs += engine.step()
        tokens = [t for o in outs for t in o.token_ids]
        assert len(tokens) == min_tokens + 1 and set(tokens[:-1]) <= set(FEW) and outs[-1].finish_reason == "stop"


def penalised_sampling(temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=21, min_p=0.05, top_k=50, repetition_penalty=3.0,
                          min_tokens=6, stop_token_ids=ALL_BUT_FEW)


def counted_sampling(temperature: float) -> SamplingParams:
    """Every processor that reads the output so far, and a bias."""
    return SamplingParams(temperature=temperature, seed=22, ignore_eos=True, presence_penalty=1.2,
                          frequency_penalty=0.9, repetition_penalty=1.3, logit_bias={201: 4.0, 5: -100.0})


def _handed_over(loaded: LoadedModel, prompt: list[int], sampling: SamplingParams,
                 tokens: int) -> tuple[Engine, Engine, list[int], list[int]]:
    """One request split as the mesh splits it: a prefill engine samples output position 0 and exports the
    prompt's blocks; a second engine decodes the other `tokens - 1` from output_offset 1 on those blocks."""
    prefill = Engine(loaded, dtype=torch.float32, kv_blocks=32)
    first = run_to_completion(prefill, [EngineRequest("r", prompt, sampling, 1, hold_kv=True)])["r"]
    blobs = prefill.export_blocks("r", 0, -(-len(prompt) // prefill.block_tokens))
    prefill.release("r")
    decode = Engine(loaded, dtype=torch.float32, kv_blocks=32)
    rest = run_to_completion(decode, [EngineRequest("r", prompt + first, sampling, tokens - 1, output_offset=1,
                                                    prefix_blocks=blobs, prefix_tokens=len(prompt))])["r"]
    return prefill, decode, first, rest


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_prefill_to_decode_hand_over_keeps_min_tokens_and_the_penalty(loaded: LoadedModel,
                                                                        temperature: float) -> None:
    """Prefill samples output position 0, decode the rest from output_offset 1: the same tokens as one engine
    running the whole request, so the penalty sees the prompt and the first token, and min_tokens counts
    the first token as generated."""
    sampling, prompt = penalised_sampling(temperature), PROMPTS[1]
    one = run_to_completion(Engine(loaded, dtype=torch.float32, kv_blocks=32),
                            [EngineRequest("r", prompt, sampling, 20)])["r"]
    assert len(one) == 7 and len(set(one[:-1])) == 6 and not set(one[:-1]) & set(prompt)
    prefill, decode, first, rest = _handed_over(loaded, prompt, sampling, 20)
    assert first + rest == one
    assert not prefill.processors.slots and not decode.processors.slots  # every token set freed


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_output_counts_survive_the_hand_over_and_a_migration(loaded: LoadedModel, temperature: float) -> None:
    """Prefill samples position 0 with the penalties and the bias, decode goes on from output_offset 1, and a
    continuation after k streamed tokens (its prompt ends with them, output_offset k) counts them as output:
    each gives the tokens one engine gives for the whole request."""
    sampling, prompt, n = counted_sampling(temperature), PROMPTS[1], 14
    one = run_to_completion(Engine(loaded, dtype=torch.float32, kv_blocks=32),
                            [EngineRequest("r", prompt, sampling, n)])["r"]
    assert 5 not in one
    prefill, decode, first, rest = _handed_over(loaded, prompt, sampling, n)
    assert first + rest == one
    k = 6
    resumed = run_to_completion(decode, [EngineRequest("m", prompt + one[:k], sampling, n - k, output_offset=k)])
    assert one[:k] + resumed["m"] == one
    assert not prefill.processors.slots and not decode.processors.slots


def test_overlapped_steps_match_synchronous_with_processors(loaded: LoadedModel) -> None:
    """The overlapped path extends the penalty's token sets on the device, from tokens the host has not seen yet."""
    def run(overlap: bool) -> dict[str, list[int]]:
        engine = Engine(loaded, dtype=torch.float32, kv_blocks=32)
        engine.overlap = overlap
        reqs = [EngineRequest("g", PROMPTS[0], SamplingParams(temperature=0, ignore_eos=True,
                                                              repetition_penalty=1.8), 16),
                EngineRequest("h", PROMPTS[2], penalised_sampling(0.9), 16),
                EngineRequest("b", PROMPTS[1], SamplingParams(temperature=0.7, seed=4, min_p=0.1,
                                                              ignore_eos=True), 16),
                EngineRequest("c", PROMPTS[0], replace(counted_sampling(0.8), logprobs=2), 16)]
        return run_to_completion(engine, reqs)

    sync = run(False)
    assert sync == run(True)



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_ngram_speculation_matches_plain_decoding(loaded: LoadedModel, device: str, kernels: str) -> None:
    """Prompt-lookup drafts on both ops paths (Triton: the batched metadata verifies every draft row), greedy
    and seeded, fixed K and adaptive: the tokens are plain decoding's. Drafts are rejected (the random model
    ignores its prompt's repeats) and accepted (its greedy output falls into loops: 58 58 58 ...)."""
    if kernels == "triton":
        pytest.importorskip("triton")
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels on CPU tensors need the interpreter (set where there is no GPU)")
    prompts = [[1] + list(range(40, 52)) * 3, PROMPTS[0], PROMPTS[2]]
    tokens = 24
    interpreted = kernels == "triton" and device == "cpu"
    if interpreted:  # the interpreter is slow (two minutes for the whole case): fewer rows, the same paths
        prompts, tokens = prompts[:2], 20

    def requests() -> list[EngineRequest]:
        return [EngineRequest(f"r{i}-{t}", p, SamplingParams(temperature=t, seed=5 + i, ignore_eos=True), tokens)
                for i, p in enumerate(prompts) for t in (0.0, 0.9)]

    # Interpreted, plain decoding runs on the torch ops: the same tokens (test_triton_ops_match_torch_ops holds
    # the two paths to them) at a fraction of the interpreter's time, which is then spent on the verify rows only.
    reference_kernels = "torch" if interpreted else kernels
    plain = Engine(loaded, device=device, dtype=torch.float32, kv_blocks=32, kernels=reference_kernels)
    expected = run_to_completion(plain, requests())
    # (the interpreter is slow: on a CPU, Triton runs one policy; the verify rows are the same for both)
    for policy in ("fixed",) if interpreted else ("fixed", "adaptive"):
        spec = Engine(loaded, device=device, dtype=torch.float32, kv_blocks=32, kernels=kernels,
                      speculative_tokens=4, speculative_method="ngram", speculative_policy=policy)
        assert run_to_completion(spec, requests()) == expected
        assert spec.spec_drafted > spec.spec_accepted > 0 and spec.stats().free_blocks == 32


# --- the reasoning budget ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_with_budget_3_the_4th_output_token_is_the_end_of_thinking_token(loaded: LoadedModel, overlap: bool,
                                                                         device: str) -> None:
    """The end token is one the plain run never makes: the budget forces it at output position 3, then the run
    goes on free (the 5th token is the model's own again). An end token the model makes itself within the budget
    is not forced a second time. On a GPU the batched sampler and the device-side check of the output counts."""
    engine = Engine(loaded, device=device, dtype=torch.float32, kv_blocks=32)
    engine.overlap = overlap
    base = {"temperature": 0, "ignore_eos": True}
    plain = run_to_completion(engine, [EngineRequest("p", PROMPTS[0], SamplingParams(**base), 8)])["p"]
    end = next(t for t in range(10, CONFIG["vocab_size"]) if t not in plain)
    budget = SamplingParams(**base, reasoning_budget=3, reasoning_end=end)
    got = run_to_completion(engine, [EngineRequest("b", PROMPTS[0], budget, 8)])["b"]
    assert got[:3] == plain[:3] and got[3] == end and got.count(end) == 1
    assert got[4] == int(prompt_logits(engine, PROMPTS[0] + got[:4]).argmax())
    own = replace(budget, reasoning_end=plain[1])  # the model closes its reasoning itself at position 1
    assert run_to_completion(engine, [EngineRequest("o", PROMPTS[0], own, 8)])["o"] == plain


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_the_reasoning_budget_counts_across_the_hand_over(loaded: LoadedModel, temperature: float) -> None:
    """Prefill samples position 0; the decode engine, from output_offset 1, forces the end at the same position
    as one engine running the whole request (budget 2: the 3rd token)."""
    prompt = PROMPTS[1]
    probe = SamplingParams(temperature=temperature, seed=5, ignore_eos=True)
    plain = run_to_completion(Engine(loaded, dtype=torch.float32, kv_blocks=32),
                              [EngineRequest("p", prompt, probe, 6)])["p"]
    end = next(t for t in range(10, CONFIG["vocab_size"]) if t not in plain)
    sampling = replace(probe, reasoning_budget=2, reasoning_end=end)
    one = run_to_completion(Engine(loaded, dtype=torch.float32, kv_blocks=32),
                            [EngineRequest("r", prompt, sampling, 6)])["r"]
    assert one[2] == end and one.count(end) == 1
    *_, first, rest = _handed_over(loaded, prompt, sampling, 6)
    assert first + rest == one
    # a migration after the end was forced: the continuation's output (in its prompt) already holds it
    cont = run_to_completion(Engine(loaded, dtype=torch.float32, kv_blocks=32),
                             [EngineRequest("m", prompt + one[:4], sampling, 2, output_offset=4)])["m"]
    assert one[:4] + cont == one
