"""The KV pool under a GPU memory share (shared/engine/memory.py), on made-up devices: the share covers weights,
the measured activation peak, the per-request state and the pool; workers sharing a device fit side by side
whichever sizes its pool first. The profile step that measures the peak runs here on the CPU (it measures 0
there) and leaves the engine as it found it. Two real engines on one GPU: tests/gpu/test_engine_memory_gpu.py."""

from __future__ import annotations

import pytest

from shared.engine.config import ModelConfig
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.memory import GPU_KV_FRACTION, DeviceMemory, kv_pool_bytes
from shared.engine.random_model import random_llama
from shared.schemas.generate import SamplingParams

GiB = 1 << 30
TINY = ModelConfig("llama", 384, 128, 2, 4, 2, 32, 256, 10000.0, 1e-5, 256, False, 1, (2,))


def test_the_pool_is_the_share_less_weights_activations_and_request_state() -> None:
    mem = DeviceMemory(total=100 * GiB, free=89 * GiB, held=10 * GiB, activation_peak=3 * GiB)
    assert kv_pool_bytes(mem, 0.45, request_state=2 * GiB) == 45 * GiB - 10 * GiB - 3 * GiB - 2 * GiB
    assert kv_pool_bytes(mem, None) == int(89 * GiB * GPU_KV_FRACTION)  # no share: the old rule


def test_two_workers_on_one_device_fit_in_either_order() -> None:
    """Each worker's share is of the whole device, so the second finds room whatever the first took."""
    total, context = 140 * GiB, GiB // 2  # a CUDA context per process, outside any share
    weights, peak = 20 * GiB, 4 * GiB
    first_free = total - context - weights
    first = kv_pool_bytes(DeviceMemory(total, first_free, weights, peak), 0.45)
    second_free = first_free - first - context - weights  # the first's pool is allocated, its peak is not
    second = kv_pool_bytes(DeviceMemory(total, second_free, weights, peak), 0.45)
    assert first == second == int(total * 0.45) - weights - peak
    assert 2 * (context + weights + peak) + first + second <= total


def test_a_share_too_small_or_more_than_is_free_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"0.1 of 100.0 GiB: weights 9.0 GiB \+ activations 2.0 GiB"):
        kv_pool_bytes(DeviceMemory(100 * GiB, 80 * GiB, 9 * GiB, 2 * GiB), 0.1)
    # another process holds most of the device: a share of 0.9 no longer fits beside it
    with pytest.raises(ValueError, match="30.0 GiB free on the device"):
        kv_pool_bytes(DeviceMemory(100 * GiB, 32 * GiB, 9 * GiB, 2 * GiB), 0.9)


def test_the_profile_step_leaves_the_engine_as_it_found_it() -> None:
    """activation_peak runs one max_batch_tokens prompt on a throwaway pool (0 bytes measured on a CPU); a pool
    built after it generates what a fresh engine does, with no block, request or prefix entry left over."""
    model = random_llama(TINY, "cpu")
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    fresh = Engine(model, kv_blocks=32, max_batch_tokens=64)
    profiled = Engine(model, kv_blocks=32, max_batch_tokens=64)
    assert profiled.activation_peak() == 0
    assert not hasattr(profiled, "kv")  # no pool until the real one is built
    profiled._build_pool(32)
    assert profiled.blocks.num_free == 32 and profiled.blocks.cached_hashes() == []
    prompt = [i % TINY.vocab_size for i in range(64)]  # the profile's own prompt: no prefix hit may survive
    want = run_to_completion(fresh, [EngineRequest("a", prompt, greedy, 5)])
    assert run_to_completion(profiled, [EngineRequest("a", prompt, greedy, 5)]) == want
    assert profiled.stats().total_blocks == 32
