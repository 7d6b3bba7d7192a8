"""compose.yaml runs the same services, with the same entry points, as `deepinfer up`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.launcher import build_plan, parse_args

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def service_commands() -> dict[str, list[str]]:
    return {name: spec["command"] for name, spec in compose()["services"].items() if name != "nats"}


def test_every_command_is_a_real_entry_point() -> None:
    commands = service_commands()
    assert set(commands) == {"gateway", "recipe", "balancer", "prefill", "decode", "kvcache"}
    for name, command in commands.items():
        assert command[:3] == ["python", "-m", f"services.{name}"]
        assert (ROOT / "services" / name / "__main__.py").exists()
        # The flags compose passes are flags the service accepts.
        result = subprocess.run(
            [sys.executable, "-m", f"services.{name}", *command[3:], "--help"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 0, result.stderr
        for flag in (a for a in command[3:] if a.startswith("--")):
            assert flag in result.stdout


def test_launcher_runs_the_same_services(tmp_path: Path) -> None:
    plan = build_plan(parse_args([]), tmp_path, "nats://127.0.0.1:4222")
    launched = {c.service: c.argv for c in plan.children}
    for name, command in service_commands().items():
        assert launched[name][1:3] == command[1:3]
        extra = [a for a in command[3:] if a not in ("--host", "0.0.0.0", "--port", "8000")]
        for arg in extra:
            assert arg in launched[name]


def test_nats_gets_jetstream_and_big_payloads() -> None:
    nats = compose()["services"]["nats"]
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert "jetstream" in conf and "max_payload" in conf
    assert any("deploy/nats.conf" in v for v in nats["volumes"])


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (v1) not installed")
def test_docker_compose_accepts_the_file() -> None:
    result = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "compose.yaml"), "config", "-q"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_a_dead_service_is_restarted_until_it_keeps_dying(tmp_path: Path) -> None:
    import sys
    import time

    import pytest

    from shared.launcher import MAX_RESTARTS, Child, spawn, supervise

    child = Child("kvcache", "kvcache-0", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "k.log")
    spawn(child)
    for restart in range(MAX_RESTARTS):
        child.process.wait()
        first = child.process
        supervise(child)  # exited: a new process in its place
        assert child.process is not first and len(child.restarts) == restart + 1
    child.process.wait()
    with pytest.raises(RuntimeError, match="kvcache-0 exited with code 3"):
        supervise(child)
    assert time.monotonic() - child.restarts[0] < 60
