"""--kv-cache-dtype fp8 for DeepSeek-V4 on a GPU (marked gpu: skipped without CUDA): the Triton prefill kernels,
the batched decode path (the FP8 stores dequantized by its torch gathers) under CUDA graphs and torch.compile's
fused pieces, and the blobs moving GPU -> host -> GPU. The tokens of an fp8 engine on CUDA in fp32 compute equal
those of the same on the CPU (the packing is the same bytes: bf16 RoPE channels, fp32 scales); a prefill -> decode
hand-over of fp8 blocks + state is token-identical to one fp8 engine; bf16 compute with fp8 KV runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.schemas.generate import SamplingParams
from tests import v4_checkpoints

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return v4_checkpoints.build_hub(tmp_path_factory.mktemp("v4-fp8kv"))


def _requests(n_new: int = 12) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(i)).tolist(),
                          GREEDY, max_new_tokens=n_new, stop_token_ids=[]) for i, n in enumerate((5, 140, 23))]


def test_fp8_kv_on_cuda_equals_cpu_in_fp32(hub: Path) -> None:
    cpu = run_to_completion(Engine(str(hub), kv_blocks=64, kv_cache_dtype="fp8"), _requests())
    engine = Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64, kv_cache_dtype="fp8")
    assert run_to_completion(engine, _requests()) == cpu
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # decode steps replayed from graphs


def test_fp8_handover_on_cuda_is_exact(hub: Path) -> None:
    prompt = _requests()[1].token_ids
    whole = run_to_completion(Engine(str(hub), device="cuda", kv_blocks=64, kv_cache_dtype="fp8"),
                              [EngineRequest("w", prompt, GREEDY, max_new_tokens=8, stop_token_ids=[])])["w"]
    prefill = Engine(str(hub), device="cuda", kv_blocks=64, kv_cache_dtype="fp8")
    first = run_to_completion(prefill, [EngineRequest("r", prompt, GREEDY, max_new_tokens=1, hold_kv=True,
                                                      stop_token_ids=[])])
    blocks = prefill.export_blocks("r", 0, -(-len(prompt) // prefill.block_tokens))
    state = prefill.export_state("r")
    decode = Engine(str(hub), device="cuda", kv_blocks=64, kv_cache_dtype="fp8")
    decode.add(EngineRequest("r", prompt + first["r"], GREEDY, max_new_tokens=7, output_offset=1, stop_token_ids=[],
                             prefix_blocks=blocks, prefix_tokens=len(prompt), prefix_state=state))
    rest: list[int] = []
    while decode.has_work():
        for out in decode.step():
            rest += out.token_ids
    assert first["r"] + rest == whole


def test_bf16_compute_with_fp8_kv_first_tokens(hub: Path) -> None:
    """bf16 compute: the first generated token of each request equals bf16 KV's (later ones may part at the
    near-ties of a random model, as the quantized engine's GPU test found)."""
    bf16 = run_to_completion(Engine(str(hub), device="cuda", kv_blocks=64), _requests(4))
    fp8 = run_to_completion(Engine(str(hub), device="cuda", kv_blocks=64, kv_cache_dtype="fp8"), _requests(4))
    assert {r: t[0] for r, t in fp8.items()} == {r: t[0] for r, t in bf16.items()}
