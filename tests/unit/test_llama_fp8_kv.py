"""--kv-cache-dtype fp8 for the Llama family (torch kernels): each token's head packed as e4m3 + a float32 scale
(kv_quant.py, one scale per head at head_dim <= 64), on test_engine_tiny's random checkpoint."""

from __future__ import annotations

import pytest
import torch

from shared import hashing
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.loader import LoadedModel
from shared.schemas.generate import SamplingParams
from tests.unit.test_engine_tiny import PROMPTS, checkpoint, loaded, prompt_logits  # noqa: F401 (fixtures)

GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def test_logits_within_the_bound_of_fp8_rounding(loaded: LoadedModel) -> None:
    """As the V4 test's bound: fp8's deviation from fp32 KV at most 32x bf16 KV's (2^-4 against 2^-8 relative
    rounding, twice that for its spread), plus 0.01 nats."""
    lp = {dt: torch.log_softmax(prompt_logits(Engine(loaded, kv_blocks=16, kv_cache_dtype=dt), PROMPTS[1]), -1)
          for dt in ("auto", "bf16", "fp8")}
    dev_b = (lp["bf16"] - lp["auto"]).abs().max().item()
    dev_f = (lp["fp8"] - lp["auto"]).abs().max().item()
    assert 0 < dev_f <= 32 * dev_b + 0.01


def test_blocks_bytes_ids_and_a_hand_over(loaded: LoadedModel) -> None:
    full = Engine(loaded, kv_blocks=32)
    fp8 = Engine(loaded, kv_blocks=32, kv_cache_dtype="fp8")
    # 3 layers x K and V x 16 tokens x 2 heads x (32 e4m3 + one float32 scale), against 4 bytes a channel
    assert fp8.block_bytes == 3 * 2 * 16 * 2 * 36 and full.block_bytes == 3 * 2 * 16 * 2 * 32 * 4
    assert "float8_e4m3fn" in fp8.cache_id and fp8.cache_id != full.cache_id
    ns = {e: hashing.namespace(e.cache_id) for e in (full, fp8)}
    assert not set(hashing.block_hashes(PROMPTS[1], ns[full])) & set(hashing.block_hashes(PROMPTS[1], ns[fp8]))
    alone = run_to_completion(fp8, [EngineRequest("a", PROMPTS[1], GREEDY, 6)])["a"]
    first = run_to_completion(fp8, [EngineRequest("h", PROMPTS[1], GREEDY, 1, hold_kv=True)])["h"]
    blobs = fp8.export_blocks("h", 0, 4)
    other = Engine(loaded, kv_blocks=32, kv_cache_dtype="fp8")
    rest = run_to_completion(other, [EngineRequest("c", PROMPTS[1] + first, GREEDY, 5, output_offset=1,
                                                   prefix_blocks=blobs, prefix_tokens=len(PROMPTS[1]))])["c"]
    assert first + rest == alone
    assert other.kv.read_blocks([0])[0] in blobs  # the bytes moved as they were
    with pytest.raises(ValueError, match="prefix block"):
        full.add(EngineRequest("x", PROMPTS[1], GREEDY, 1, prefix_blocks=blobs, prefix_tokens=len(PROMPTS[1])))


def test_the_triton_kernels_refuse_fp8_clearly(loaded: LoadedModel) -> None:
    with pytest.raises(ValueError, match="--kernels torch"):
        Engine(loaded, kv_blocks=8, kernels="triton", kv_cache_dtype="fp8")
