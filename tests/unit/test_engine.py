"""The engine on the real SmolLM2-135M weights (CPU): correctness, batching, chunking, KV import, sampling."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
import torch
from safetensors.torch import save_file

from shared.engine.engine import Engine, EngineRequest, StepOutput, run_to_completion
from shared.engine.loader import LoadedModel, load
from shared.models import ModelFiles, resolve
from shared.schemas.generate import SamplingParams
from shared.tokenizer import Tokenizer, load_tokenizer

GREEDY = SamplingParams(temperature=0.0)
PARIS_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
TEXTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. Then it ran into the forest and",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969, astronauts landed on the Moon for the first time. The mission was called Apollo 11, and the "
    "crew members were Neil Armstrong, Buzz Aldrin and Michael Collins. After landing, they",
]


@pytest.fixture(scope="module")
def files() -> ModelFiles:
    return resolve("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def loaded(files: ModelFiles) -> LoadedModel:
    return load(files)


@pytest.fixture(scope="module")
def tok(files: ModelFiles) -> Tokenizer:
    return load_tokenizer(files)


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Engine:
    return Engine(loaded, kv_blocks=256)


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def alone(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations of each prompt, each run on its own."""
    return [run_to_completion(engine, [req(f"alone{i}", p, 8)])[f"alone{i}"] for i, p in enumerate(prompts)]


@pytest.fixture(autouse=True)
def _engine_left_clean(engine: Engine) -> Iterator[None]:
    yield
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.held) == (0, 0, 0) and stats.free_blocks == stats.total_blocks


def req(rid: str, ids: list[int], n: int, sampling: SamplingParams = GREEDY, **kw: object) -> EngineRequest:
    return EngineRequest(rid, list(ids), sampling, max_new_tokens=n, **kw)  # type: ignore[arg-type]


def test_paris(engine: Engine, tok: Tokenizer) -> None:
    ids = tok.encode(PARIS_PROMPT)
    engine.add(req("paris", ids, 30))
    outs: list[StepOutput] = []
    while engine.has_work():
        outs += engine.step()
    tokens = [t for o in outs for t in o.token_ids]
    assert tok.decode(tokens) == "The capital of France is Paris."
    assert outs[-1].finish_reason == "stop" and tokens[-1] in engine.config.eos_ids


def test_batched_equals_alone(engine: Engine, prompts: list[list[int]], alone: list[list[int]]) -> None:
    assert len({len(p) for p in prompts}) == len(prompts)
    together = run_to_completion(engine, [req(f"b{i}", p, 8) for i, p in enumerate(prompts)])
    assert [together[f"b{i}"] for i in range(len(prompts))] == alone


def test_requests_join_a_running_batch(engine: Engine, prompts: list[list[int]], alone: list[list[int]]) -> None:
    got: dict[str, list[int]] = {"j0": [], "j1": []}
    engine.add(req("j0", prompts[0], 8))
    for _ in range(3):
        for o in engine.step():
            got[o.request_id] += o.token_ids
    engine.add(req("j1", prompts[3], 8))  # joins while j0 is decoding
    while engine.has_work():
        for o in engine.step():
            got[o.request_id] += o.token_ids
    assert [got["j0"], got["j1"]] == [alone[0], alone[3]]


def test_chunked_prefill_equals_unchunked(
    loaded: LoadedModel, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    small = Engine(loaded, kv_blocks=64, max_batch_tokens=7)
    small.add(req("c", prompts[3], 8))
    outs: list[StepOutput] = []
    while small.has_work():
        outs += small.step()
    chunks = -(-len(prompts[3]) // 7)
    assert all(o.token_ids == [] and o.finish_reason is None for o in outs[: chunks - 1])
    assert [t for o in outs for t in o.token_ids] == alone[3]


def test_prefix_import_continues_the_same(
    engine: Engine, loaded: LoadedModel, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    prompt = prompts[3]  # several full blocks and a partial tail
    # "prefill": first token only, KV held for export
    first = run_to_completion(engine, [req("pf", prompt, 1, hold_kv=True)])["pf"]
    assert first == alone[3][:1] and engine.stats().held == 1
    blobs = engine.export_blocks("pf", 0, -(-len(prompt) // engine.block_tokens))
    assert engine.export_state("pf") == b""
    engine.release("pf")
    assert all(len(b) == engine.block_bytes for b in blobs)
    # "decode" on another engine: nothing cached locally, so every prompt token comes from the blobs
    other = Engine(loaded, kv_blocks=64)
    other.add(req("dc", [*prompt, *first], 7, output_offset=1, prefix_blocks=blobs, prefix_tokens=len(prompt)))
    outs: list[StepOutput] = []
    while other.has_work():
        outs += other.step()
    assert first + [t for o in outs for t in o.token_ids] == alone[3]
    assert outs[0].num_cached_tokens == len(prompt)
    assert other.stats().free_blocks == other.stats().total_blocks
    with pytest.raises(ValueError):  # a blob of the wrong size
        other.add(req("bad", prompt, 1, prefix_blocks=[blobs[0][:-4]], prefix_tokens=16))
    with pytest.raises(ValueError):  # blob count does not match prefix_tokens
        other.add(req("bad", prompt, 1, prefix_blocks=blobs[:1], prefix_tokens=17))


def test_local_prefix_cache_reuses_blocks(engine: Engine, prompts: list[list[int]], alone: list[list[int]]) -> None:
    prompt = prompts[3]
    run_to_completion(engine, [req("warm", prompt, 1)])
    engine.add(req("hit", prompt, 8))
    outs: list[StepOutput] = []
    while engine.has_work():
        outs += engine.step()
    assert outs[0].num_cached_tokens == (len(prompt) - 1) // engine.block_tokens * engine.block_tokens > 0
    assert [t for o in outs for t in o.token_ids] == alone[3]


def test_seeded_sampling_reproducible_and_batch_independent(engine: Engine, prompts: list[list[int]]) -> None:
    hot = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    one = run_to_completion(engine, [req("s0", prompts[1], 10, hot)])["s0"]
    again = run_to_completion(engine, [req("s1", prompts[1], 10, hot)])["s1"]
    batch = run_to_completion(engine, [req("x", prompts[0], 5, hot), req("s2", prompts[1], 10, hot),
                                       req("y", prompts[2], 12, SamplingParams(temperature=0.7, seed=5))])
    assert one == again == batch["s2"]
    other_seed = run_to_completion(engine, [req("s3", prompts[1], 10, SamplingParams(temperature=1.0, seed=99))])
    assert other_seed["s3"] != one
    # split across "processes": token 0 here, the rest by a request that starts at output position 1
    head = run_to_completion(engine, [req("h", prompts[1], 1, hot)])["h"]
    tail = run_to_completion(engine, [req("t", prompts[1] + head, 9, hot, output_offset=1)])["t"]
    assert head + tail == one


def test_top_k_1_is_greedy(engine: Engine, prompts: list[list[int]], alone: list[list[int]]) -> None:
    top1 = SamplingParams(temperature=1.5, top_k=1)  # no seed: drawn at add()
    assert run_to_completion(engine, [req("k1", prompts[2], 8, top1)])["k1"] == alone[2]


def test_abort_frees_everything(engine: Engine, prompts: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        engine.add(req(f"a{i}", p, 50))
    engine.step()
    engine.step()
    assert engine.stats().running > 0 and engine.stats().free_blocks < engine.stats().total_blocks
    for i in range(len(prompts)):
        engine.abort(f"a{i}")
    engine.abort("never-added")
    assert not engine.has_work()  # the autouse fixture checks every block is back


def test_kv_exhaustion_preempts_and_finishes(
    loaded: LoadedModel, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    tiny = Engine(loaded, kv_blocks=6)  # 96 tokens of KV for four sequences of 12-61 tokens
    got = run_to_completion(tiny, [req(f"e{i}", p, 8) for i, p in enumerate(prompts)])
    assert [got[f"e{i}"] for i in range(len(prompts))] == alone
    assert tiny.stats().free_blocks == 6
    with pytest.raises(ValueError):  # can never fit in 6 blocks
        tiny.add(req("huge", [1] * 100, 1))


def test_bad_requests_are_value_errors(engine: Engine) -> None:
    ctx = engine.config.max_position
    for bad in (
        req("e", [], 1),  # empty prompt
        req("e", [1] * ctx, 1),  # no room left in the context
        req("e", [engine.config.vocab_size], 1),  # not a token
        req("e", [1, 2], 0),  # nothing to generate
        req("e", [1, 2], 1, SamplingParams(top_p=0.0)),
    ):
        with pytest.raises(ValueError):
            engine.add(bad)
    engine.add(req("dup", [1, 2], 1))
    with pytest.raises(ValueError):
        engine.add(req("dup", [1, 2], 1))
    engine.abort("dup")


def test_hf_checkpoint_gives_identical_logits(
    engine: Engine, loaded: LoadedModel, tmp_path: pytest.TempPathFactory, prompts: list[list[int]]
) -> None:
    c = loaded.config
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "intermediate_size": c.intermediate_size,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_eps, "max_position_embeddings": c.max_position,
        "tie_word_embeddings": False, "bos_token_id": c.bos_id, "eos_token_id": list(c.eos_ids),
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    body = {k: v.contiguous() for k, v in loaded.weights.items()}
    # untied on purpose (the GGUF exercises the tied path), and in two shards
    save_file({"lm_head.weight": body["model.embed_tokens.weight"].clone()}, str(tmp_path / "head.safetensors"))
    save_file(body, str(tmp_path / "model.safetensors"))
    hf_files = resolve(str(tmp_path))
    assert hf_files.format == "hf"
    hf = Engine(hf_files, kv_blocks=16)
    assert not hf.config.tie_embeddings and hf.config.eos_ids == c.eos_ids and hf.config.head_dim == c.head_dim
    fresh = [1, *prompts[2]]  # not in `engine`'s local prefix cache: both compute every position
    assert torch.equal(last_logits(hf, fresh), last_logits(engine, fresh))


def last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits of the prompt's last position, via one planned step (internals: tests only)."""
    engine.add(req("logits", ids, 1))
    plan = engine.scheduler.schedule()
    logits = engine.runner.run(plan)
    engine.abort("logits")
    return logits[0]


def _model_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The engine's own forward over `ids`: the logits at the last position."""
    engine.add(EngineRequest("ref", ids, GREEDY, 1))
    logits = engine.runner.run(engine.scheduler.schedule())[0]
    engine.abort("ref")
    return logits.cpu()


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, logprobs=5),
    # raw logprobs (vLLM's default): the bias, the penalties and the temperature change the draw, not the numbers
    SamplingParams(temperature=0.7, seed=3, top_k=20, logprobs=3, presence_penalty=1.0, logit_bias={28: 2.0}),
    SamplingParams(temperature=1.0, seed=4, logprobs=0),
], ids=["greedy", "processed", "none-top"])
def test_logprobs_are_the_models_own_and_rank_correctly(engine: Engine, tok: Tokenizer,
                                                        sampling: SamplingParams) -> None:
    prompt, n = tok.encode(PARIS_PROMPT), 6
    engine.add(EngineRequest("lp", prompt, sampling, n))
    outs: list[StepOutput] = []
    while engine.has_work():
        outs += engine.step()
    tokens = [t for o in outs for t in o.token_ids]
    logprobs = [lp for o in outs if o.token_ids for lp in o.logprobs or []]
    assert len(tokens) == len(logprobs) >= 1
    for i, (token, lp) in enumerate(zip(tokens, logprobs)):
        ref = torch.log_softmax(_model_logits(engine, prompt + tokens[:i]).double(), dim=-1)
        assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-4)
        assert len(lp.top_ids) == len(lp.top_logprobs) == sampling.logprobs
        assert lp.top_ids == ref.topk(sampling.logprobs).indices.tolist()  # the most likely first
        assert lp.top_logprobs == pytest.approx(ref[lp.top_ids].tolist(), abs=1e-4)
        assert all(a >= b for a, b in zip(lp.top_logprobs, lp.top_logprobs[1:]))
        assert sum(math.exp(x) for x in lp.top_logprobs) <= 1 + 1e-6
        if sampling.temperature == 0:
            assert lp.top_ids[0] == token and lp.logprob == lp.top_logprobs[0]
    engine.add(EngineRequest("no", prompt, GREEDY, 2))  # a request that did not ask gets none
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert all(o.logprobs is None for o in outs)
