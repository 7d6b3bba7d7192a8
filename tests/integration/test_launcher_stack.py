"""`deepinfer serve` with the vLLM-style flags through a running stack: the served names, the context cap, the
API key from the environment, JSON logs; and a second launcher on the live stack's state dir or port.

One mesh for the module (its own: the flags change what every other mesh test relies on, the model's name
among them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.mesh import Mesh, start_mesh

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "launcher-test-key"
NAMES = ["smol", "smol-alias"]
MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("served")
    env = {"DEEPINFER_API_KEY": KEY, "DEEPINFER_SERVED_MODEL_NAME": ",".join(NAMES), "DEEPINFER_LOG_FORMAT": "json"}
    mesh = start_mesh(state, "--max-model-len", str(MAX_MODEL_LEN), env=env)
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def oai(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_models_lists_the_served_names_and_requests_use_them(oai: openai.OpenAI, mesh: Mesh) -> None:
    assert [m.id for m in oai.models.list().data] == NAMES
    for name in NAMES:  # the alias reaches the same workers, which serve the first name
        reply = oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    # the model's own name is not served once names are given (the recipe's 400 for an unknown model)
    with pytest.raises(openai.BadRequestError, match="model names are smol, smol-alias"):
        oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
                                    max_tokens=3)
    banner = "".join(mesh.output)
    assert "DeepInfer mesh is up: smol on" in banner and "Authorization: Bearer $DEEPINFER_API_KEY" in banner
    assert KEY not in banner
    # each worker's memory at load, from its (JSON) log, before the banner
    for worker in ("prefill-0", "decode-0"):
        assert re.search(rf"^{worker} memory: weights 0\.\d\d GiB, KV pool .* tokens of context fit", banner, re.M)


def test_a_prompt_past_max_model_len_is_a_400(oai: openai.OpenAI) -> None:
    long = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_MODEL_LEN} tokens"):
        oai.chat.completions.create(model="smol", messages=long, max_tokens=4)
    short = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_MODEL_LEN} tokens"):
        oai.chat.completions.create(model="smol", messages=short, max_tokens=MAX_MODEL_LEN)  # prompt + completion


def test_the_key_is_required(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_every_service_logs_json_lines(mesh: Mesh) -> None:
    logs = sorted((mesh.state_dir / "logs").glob("*.log"))
    assert {p.stem for p in logs} == {"gateway-0", "recipe-0", "balancer-0", "prefill-0", "decode-0", "kvcache-0"}
    for path in logs:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        assert lines, path
        assert all(r["instance"] == path.stem and r["service"] == path.stem.split("-")[0] for r in lines)
        assert all({"time", "level", "logger", "message"} <= set(r) for r in lines)


def test_a_second_launcher_on_the_live_state_dir_or_port_fails_at_once(mesh: Mesh, tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}

    def up(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shared.launch.cli", "up", *args], cwd=ROOT, env=clean,
                              capture_output=True, text=True, timeout=60)

    same_dir = up("--port", "0", "--state-dir", str(mesh.state_dir))
    assert same_dir.returncode == 2
    assert f"state dir {mesh.state_dir} is in use by deepinfer up pid {mesh.process.pid}" in same_dir.stderr
    port = mesh.base_url.rsplit(":", 1)[1]
    same_port = up("--port", port, "--state-dir", str(tmp_path / "other"))
    assert same_port.returncode == 2
    assert f"127.0.0.1:{port} is already in use by pid" in same_port.stderr
    assert "services.gateway" in same_port.stderr  # what holds it
