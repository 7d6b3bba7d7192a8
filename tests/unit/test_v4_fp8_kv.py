"""--kv-cache-dtype fp8 for DeepSeek-V4 (shared/engine/kv_quant.py, the V4 cache's packed stores).

The packing's error bound; blocks half the bytes (V4-Flash widths); cache ids and block hashes that name the
dtype, so bf16 and FP8 blobs never meet; a tiny random V4 whose fp8-KV logits stay within a bound of the fp32
ones; blocks and short-term state through export/import and a prefill -> decode hand-over, token-identical to
one fp8 engine; the memory report's tokens of context.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared import hashing
from shared.engine import memory
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.kv_quant import FP8, FP8_MAX, KV_CACHE_DTYPES, Fp8Rows, RowLayout, dequantize, kv_dtype, quantize
from shared.engine.models.deepseek_v4.cache import V4Cache
from shared.schemas.generate import SamplingParams
from tests import v4_checkpoints

# e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 2^-4 of a value (relative), and below the
# normal range (2^-6 of the scale) by half the subnormal step, 2^-10 of the scale. bf16's rope (8 bits): 2^-8 relative.
REL, SUB, ROPE_REL = 2.0**-4, 2.0**-10, 2.0**-8


def test_packing_round_trip_within_fp8_rounding() -> None:
    layout = RowLayout(512, 64)  # V4-Flash: head_dim 512, the last 64 RoPE's
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 6)[:, None]
    x[2] = 0  # an all-zero row (a fresh store) stays zero
    y = dequantize(quantize(x, layout), layout, torch.float32)
    nope = x[:, :448].view(6, 7, 64)
    scale = nope.abs().amax(-1, keepdim=True) / FP8_MAX
    err = (y[:, :448].view(6, 7, 64) - nope).abs()
    assert bool((err <= nope.abs() * REL + scale * SUB).all())
    assert bool(((y[:, 448:] - x[:, 448:]).abs() <= x[:, 448:].abs() * ROPE_REL).all())
    assert bool((y[2] == 0).all()) and bool((y != x).any())  # it does round


def test_rows_index_like_a_tensor() -> None:
    rows = Fp8Rows.zeros((3, 4), RowLayout(32, 8), torch.float32, torch.device("cpu"))
    assert rows.shape == (3, 4, 32) and rows.raw.shape == (3, 4, 24 + 4 * 3 + 16)
    value = torch.randn(2, 32)
    rows[torch.tensor([0, 2]), torch.tensor([1, 3])] = value
    ring = rows.row(2)  # a view: writes through it land in the pool
    ring[torch.tensor([0])] = value[:1]
    got = rows[torch.tensor([0, 2, 2]), torch.tensor([1, 3, 0])]
    assert torch.allclose(got, torch.cat([value, value[:1]]), rtol=REL, atol=1e-3)
    assert bool((rows[1] == 0).all())


def test_flash_widths_bytes_per_row() -> None:
    """A V4-Flash block's rows: an entry / window key 604 bytes for bf16's 1024, an indexer key 136 for 256."""
    assert RowLayout(512, 64).row_bytes == 448 + 7 * 4 + 64 * 2 == 604
    assert RowLayout(128, 0).row_bytes == 128 + 2 * 4 == 136
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_dtype("fp4", torch.bfloat16)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("v4-fp8kv")
    v4_checkpoints.build(path, "mixed")
    return {dt: Engine(str(path), kv_blocks=64, kv_cache_dtype=dt) for dt in ("auto", "fp8")}, path


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, v4_checkpoints.BASE["vocab_size"], (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, logprobs=logprobs)


def _generate(engine: Engine, rid: str, prompt: list[int], n: int) -> tuple[list[int], list[list[float]]]:
    """Greedy tokens and, per step, the top-5 log-probabilities."""
    engine.add(EngineRequest(rid, prompt, _greedy(n, logprobs=5), max_new_tokens=n))
    tokens: list[int] = []
    top: list[list[float]] = []
    while engine.has_work():
        for out in engine.step():
            tokens += out.token_ids
            top += [lp.top_logprobs for lp in out.logprobs or []]
    return tokens, top


def test_cache_ids_and_hashes_name_the_dtype(engines) -> None:
    full, fp8 = engines[0]["auto"], engines[0]["fp8"]
    assert "float8_e4m3fn" in fp8.cache_id and "float32" in full.cache_id
    ids = _ids(2 * fp8.block_tokens, seed=1)
    ours = hashing.block_hashes(ids, hashing.namespace(fp8.cache_id), fp8.block_tokens)
    theirs = hashing.block_hashes(ids, hashing.namespace(full.cache_id), full.block_tokens)
    assert len(ours) == 2 and not set(ours) & set(theirs)
    # the bytes differ too: each side refuses the other's blobs rather than reading them as its own
    assert fp8.block_bytes < full.block_bytes / 2  # fp32 here: 4 bytes a channel against ~1.5
    with pytest.raises(ValueError, match="KV blob"):
        fp8.kv.write_blocks([0], [bytes(full.block_bytes)])
    with pytest.raises(ValueError, match="prefix block"):
        fp8.add(EngineRequest("x", ids, _greedy(1), max_new_tokens=1, prefix_blocks=[bytes(full.block_bytes)] * 2,
                              prefix_tokens=len(ids)))


def test_logits_close_to_full_precision_kv(engines) -> None:
    """The same prompt with fp32, bf16 and fp8 KV. To first order a step's log-probabilities move in proportion
    to the relative rounding of the stored KV: 2^-4 for e4m3 against bf16's 2^-8, so fp8's deviation from fp32
    is bounded by 16x bf16's, twice that for the spread of random rounding (plus 0.01 nats of slack); greedy
    tokens the same on these weights."""
    full, fp8 = engines[0]["auto"], engines[0]["fp8"]
    bf16 = Engine(str(engines[1]), kv_blocks=64, kv_cache_dtype="bf16")
    prompt = _ids(150, seed=2)  # over a block: entries of closed windows, the indexer's keys, the ring wrapped
    tok_a, top_a = _generate(full, "a", prompt, 4)
    tok_b, top_b = _generate(bf16, "b", prompt, 4)
    tok_f, top_f = _generate(fp8, "f", prompt, 4)
    assert tok_a == tok_b == tok_f and len(top_a) == 4
    for a, b, f in zip(top_a, top_b, top_f):
        dev_b = max(abs(x - y) for x, y in zip(a, b))
        dev_f = max(abs(x - y) for x, y in zip(a, f))
        assert dev_f <= 32 * dev_b + 0.01
    assert top_f != top_b  # the fp8 run did round


def test_handover_and_round_trip_are_exact(engines) -> None:
    """fp8 blocks + state exported by a prefill engine, imported by a decode engine: the tokens of one fp8
    engine doing everything (the bytes move as they are: no re-quantization on the way)."""
    fp8, path = engines[0]["fp8"], engines[1]
    prompt = _ids(137, seed=3)
    whole = run_to_completion(fp8, [EngineRequest("w", prompt, _greedy(8), max_new_tokens=8)])["w"]
    first = run_to_completion(fp8, [EngineRequest("r", prompt, _greedy(1), max_new_tokens=1, hold_kv=True)])
    n_blocks = -(-len(prompt) // fp8.block_tokens)
    blocks = fp8.export_blocks("r", 0, n_blocks)
    state = fp8.export_state("r")
    assert len(blocks[0]) == fp8.block_bytes and len(state) == fp8.spec.per_request_state_bytes
    decode = Engine(str(path), kv_blocks=64, kv_cache_dtype="fp8")
    decode.add(EngineRequest("r", prompt + first["r"], _greedy(8), max_new_tokens=7, output_offset=1,
                             prefix_blocks=blocks, prefix_tokens=len(prompt), prefix_state=state))
    rest: list[int] = []
    while decode.has_work():
        for out in decode.step():
            rest += out.token_ids
    assert first["r"] + rest == whole
    # read_blocks / write_blocks: the bytes come back as they went
    decode.kv.write_blocks([5, 6], blocks[:2])
    assert decode.kv.read_blocks([5, 6]) == blocks[:2]


def test_memory_report_fits_more_tokens(engines) -> None:
    """The pool a budget buys holds as many more tokens as the blocks shrink: ~1.7x bf16's at V4-Flash's widths
    (FP8 pays its scales and bf16 RoPE channels); the tiny model's 16-channel rows pay them more (1.3x)."""
    full, fp8 = engines[0]["auto"], engines[0]["fp8"]
    flash = dataclasses.replace(fp8.model.spec, head_dim=512, rope_head_dim=64, index_head_dim=128)
    sizes = {dt: V4Cache(flash, 1, torch.device("cpu"), torch.bfloat16, slots=0, kv_dtype=dt).block_bytes
             for dt in (torch.bfloat16, FP8)}
    assert 1.7 < sizes[torch.bfloat16] / sizes[FP8] < 2.0
    bf16 = fp8.model.cache_spec(0, torch.bfloat16).bytes_per_block
    assert bf16 / fp8.spec.bytes_per_block > 1.3
    budget = fp8._default_blocks(None)  # the CPU's pool budget, in blocks
    # against fp32's 1792 bytes a block here
    assert budget == memory.CPU_KV_BYTES // fp8.block_bytes and budget > 2.5 * full._default_blocks(None)
    m = fp8.memory()
    assert m.kv_bytes == m.kv_blocks * fp8.block_bytes and m.tokens == 64 * fp8.block_tokens
    assert m.state_bytes < full.memory().state_bytes  # the window rings shrink too
    assert "KV pool 0.00 GiB of float8_e4m3fn (64 blocks of 16 tokens)" in m.line()


def test_worker_flag_names_the_engine_dtypes() -> None:
    from shared.worker import config

    assert config.KV_CACHE_DTYPES == KV_CACHE_DTYPES  # the worker's flag is checked without importing torch
    assert config.WorkerConfig(device="cpu", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        config.WorkerConfig(device="cpu", kv_cache_dtype="int8")
