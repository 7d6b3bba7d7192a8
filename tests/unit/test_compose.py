"""compose.yaml runs the same services, with the same entry points, as `deepinfer up`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.launch.launcher import build_plan, parse_args

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


MESH = {"gateway", "recipe", "balancer", "prefill", "decode", "kvcache"}
LAUNCHER_ONLY = ("--host", "0.0.0.0", "--port", "8000")  # compose publishes the gateway on every address
DEVICE = ("--device", "cuda")  # the CUDA profile's workers say so; the launcher picks the device itself


def service_commands() -> dict[str, list[str]]:
    """Every mesh container's command, by compose service name (prefill, prefill-cuda, ...)."""
    return {name: spec["command"] for name, spec in compose()["services"].items() if name in MESH or
            spec.get("command", [""])[:2] == ["python", "-m"]}


def module(command: list[str]) -> str:
    return command[2].removeprefix("services.")


def test_every_command_is_a_real_entry_point() -> None:
    commands = service_commands()
    flags: dict[str, set[str]] = {}  # module -> the flags compose passes it, over its cpu and cuda services
    for command in commands.values():
        assert command[:2] == ["python", "-m"] and command[2].startswith("services.")
        assert (ROOT / "services" / module(command) / "__main__.py").exists()
        flags.setdefault(module(command), set()).update(a for a in command[3:] if a.startswith("--"))
    assert set(flags) == MESH
    for name, passed in flags.items():  # the flags compose passes are flags the service accepts
        result = subprocess.run(
            [sys.executable, "-m", f"services.{name}", "--help"], cwd=ROOT, capture_output=True, text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert [f for f in sorted(passed) if f not in result.stdout] == []


def test_launcher_runs_the_same_services(tmp_path: Path) -> None:
    plan = build_plan(parse_args([]), tmp_path, "nats://127.0.0.1:4222")
    launched = {c.service: c.argv for c in plan.children}
    assert set(launched) == MESH
    for name, command in service_commands().items():
        argv = launched[module(command)]
        assert argv[1:3] == command[1:3]
        extra = [a for a in command[3:] if a not in LAUNCHER_ONLY + DEVICE]
        for arg in extra:
            assert arg in argv


def test_workers_come_in_a_cpu_and_a_cuda_profile_the_cuda_one_reserving_a_gpu() -> None:
    services = compose()["services"]
    for role in ("prefill", "decode"):
        cpu, cuda = services[role], services[f"{role}-cuda"]
        assert cpu["profiles"] == ["cpu"] and cuda["profiles"] == ["cuda"]
        assert cpu["image"].endswith(":cpu") and cpu["build"]["args"]["TORCH"] == "cpu"
        assert cuda["image"].endswith(":cuda") and cuda["build"]["args"]["TORCH"] == "cuda"
        (device,) = cuda["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert "deploy" not in cpu
    # the services that hold no model run everywhere, on the small image
    for name in ("gateway", "recipe", "balancer", "kvcache"):
        assert "profiles" not in services[name] and services[name]["image"].endswith(":cpu")
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH=cpu" in dockerfile and "download.pytorch.org/whl/cpu" in dockerfile
    assert ".[test]" not in dockerfile and "[test]" not in dockerfile


def test_the_gateway_and_nats_have_healthchecks() -> None:
    services = compose()["services"]
    gateway = services["gateway"]["healthcheck"]
    assert "http://127.0.0.1:8000/health" in " ".join(gateway["test"])
    assert int(gateway["start_period"].rstrip("s")) >= 120  # the workers load the model meanwhile
    nats = services["nats"]["healthcheck"]
    assert "/healthz" in " ".join(nats["test"])
    assert "http_port: 8222" in (ROOT / "deploy" / "nats.conf").read_text()
    for name, spec in services.items():
        if name in service_commands():
            assert spec["depends_on"]["nats"]["condition"] == "service_healthy", name


def test_the_observability_profile_scrapes_metrics_and_receives_otlp() -> None:
    services = compose()["services"]
    prometheus, jaeger = services["prometheus"], services["jaeger"]
    assert prometheus["profiles"] == jaeger["profiles"] == ["observability"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["gateway:8000"]
    assert any("deploy/prometheus.yml" in v for v in prometheus["volumes"])
    assert "4318:4318" in jaeger["ports"] and jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name in service_commands():
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith("http://jaeger:4318}"), name
        assert "OTEL_TRACES_EXPORTER" in env


def test_nats_gets_jetstream_and_big_payloads() -> None:
    nats = compose()["services"]["nats"]
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert "jetstream" in conf and "max_payload" in conf
    assert any("deploy/nats.conf" in v for v in nats["volumes"])


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (v1) not installed")
@pytest.mark.parametrize("profiles", [[], ["cpu", "observability"], ["cuda"]])
def test_docker_compose_accepts_the_file(profiles: list[str]) -> None:
    flags = [f for p in profiles for f in ("--profile", p)]
    result = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "compose.yaml"), *flags, "config", "-q"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_a_service_that_keeps_dying_is_backed_off_and_never_stops_the_stack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shared.launch.backoff import CRASH_LOOP_EXITS, MAX_DELAY_S
    from shared.launch.launcher import Child, spawn, supervise

    child = Child("kvcache", "kvcache-0", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "k.log")
    spawn(child)
    now = child.started_at
    waits = []
    for _ in range(CRASH_LOOP_EXITS + 6):
        child.started_at = now  # the run began on the test's clock
        child.process.wait()
        dead = child.process
        supervise(child, now)
        if child.restart_at is None:  # restarted at once
            waits.append(0.0)
        else:
            wait = child.restart_at - now
            waits.append(wait)
            supervise(child, now + wait / 2)
            assert child.process is dead  # still backing off
            now += wait
            supervise(child, now)
        assert child.process is not dead and child.restart_at is None
    assert waits[:4] == [0.0, 1.0, 2.0, 4.0] and waits[-1] == MAX_DELAY_S
    assert child.restarts.crash_looping() and child.restarts.total == len(waits)
    said = capsys.readouterr().out
    assert "kvcache-0 exited with code 3; restarting it" in said
    assert f"crash loop ({CRASH_LOOP_EXITS} quick exits in a row): restarting it in" in said
    assert "the rest of the mesh serves on" in said
    child.process.wait()
