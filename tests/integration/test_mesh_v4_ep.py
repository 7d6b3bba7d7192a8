"""`deepinfer up --expert-parallel 2` on a tiny random DeepSeek-V4: each worker spreads its routed experts over
itself and one spawned gloo rank, the balancer's experts role plans each worker's group, the workers apply the
plans between two steps, and the same greedy request answers the same before and after (the engine-level
equality with one process is tests/unit/test_expert_parallel.py's)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from tests import v4_checkpoints
from tests.integration.mesh import Mesh, start_mesh

pytestmark = pytest.mark.slow

ASK = {"model": v4_checkpoints.SERVED_NAME, "messages": [{"role": "user", "content": "Name three colours."}],
       "temperature": 0.0, "max_tokens": 8, "extra_body": {"thinking": {"type": "disabled"}}}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    checkpoint = v4_checkpoints.build_served(tmp_path_factory.mktemp("v4-ep-ckpt"))
    mesh = start_mesh(tmp_path_factory.mktemp("v4-ep-mesh"), "--model", str(checkpoint), "--device", "cpu",
                      "--expert-parallel", "2")
    yield mesh
    mesh.stop()


def applied(mesh: Mesh, worker: str) -> bool:
    log = mesh.state_dir / "logs" / f"{worker}.log"
    return log.exists() and f"expert plan 1 for {worker} applied" in log.read_text()


def test_expert_parallel_workers_serve_and_apply_their_plans(mesh: Mesh) -> None:
    oai = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="k", max_retries=0, timeout=120)
    first = oai.chat.completions.create(**ASK)
    assert first.usage.completion_tokens == 8
    deadline = time.monotonic() + 120
    while not (applied(mesh, "prefill-0") and applied(mesh, "decode-0")):
        assert time.monotonic() < deadline, "no expert plan applied by both workers"
        time.sleep(0.5)
    again = oai.chat.completions.create(**ASK)
    assert again.choices[0].message.content == first.choices[0].message.content
