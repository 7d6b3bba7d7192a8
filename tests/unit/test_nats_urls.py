"""`--nats-url` as a list of servers (a NATS cluster), the reconnect backoff and the replicas a cluster gets, and
the compose file that runs the bus as a 3-node cluster."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shared.bus_state import RECONNECT_FIRST_S, RECONNECT_MAX_S, reconnect_delay, stream_replicas
from shared.launch import cli_up
from shared.launch.launcher import build_plan
from shared.nats_urls import server_urls

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "nats://n1:4222, nats://n2:4222,nats://n3:4222"


def test_one_url_or_a_comma_separated_list() -> None:
    assert server_urls("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]
    assert server_urls(CLUSTER) == ["nats://n1:4222", "nats://n2:4222", "nats://n3:4222"]
    assert server_urls("tls://a:4222,") == ["tls://a:4222"]
    with pytest.raises(ValueError, match="names no server"):
        server_urls(" , ")
    with pytest.raises(ValueError, match="got 'n2:4222'"):
        server_urls("nats://n1:4222,n2:4222")


def test_deepinfer_up_passes_the_list_to_every_service(tmp_path: Path) -> None:
    args = cli_up.parse(["--nats-url", CLUSTER])
    plan = build_plan(args, tmp_path, args.nats_url)
    for child in plan.children:
        assert child.argv[child.argv.index("--nats-url") + 1] == CLUSTER, child.instance
    with pytest.raises(SystemExit):
        cli_up.parse(["--nats-url", "nats://n1:4222,n2"])


def test_a_service_refuses_a_bad_list_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from shared import service

    with pytest.raises(SystemExit) as exited:  # before anything is built or connected
        service.main("kvcache", lambda config, args: pytest.fail("built"), argv=["--nats-url", "nats://a:1,b:2"])
    assert exited.value.code == 2 and "got 'b:2'" in capsys.readouterr().err


def test_reconnect_delays_grow_and_are_capped() -> None:
    delays = [reconnect_delay(n, jitter=1.0) for n in range(8)]
    assert delays[:3] == [0.0, RECONNECT_FIRST_S, 2 * RECONNECT_FIRST_S]
    assert delays == sorted(delays) and delays[-1] == RECONNECT_MAX_S
    assert reconnect_delay(3, jitter=0.5) == reconnect_delay(3, jitter=1.0) / 2


def test_a_cluster_of_three_gets_three_replicas() -> None:
    assert [stream_replicas(n) for n in (1, 2, 3, 5)] == [1, 1, 3, 3]


def test_the_cluster_override_runs_three_routed_nodes_and_gives_every_service_all_three() -> None:
    base = yaml.safe_load((ROOT / "compose.yaml").read_text())
    cluster = yaml.safe_load((ROOT / "deploy" / "compose.nats-cluster.yaml").read_text())
    nodes = ["nats", "nats-2", "nats-3"]
    conf = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    for node in nodes:
        assert f"nats-route://{node}:6222" in conf
        assert any("deploy/nats-cluster.conf" in v for v in cluster["services"][node]["volumes"])
    assert len({cluster["services"][n]["environment"]["NATS_SERVER_NAME"] for n in nodes}) == 3
    mesh = [name for name, spec in base["services"].items() if "services." in " ".join(spec.get("command", []))]
    urls = server_urls(cluster["services"]["gateway"]["environment"]["DEEPINFER_NATS_URL"])
    assert urls == [f"nats://{n}:4222" for n in nodes]
    for name in mesh:
        assert cluster["services"][name]["environment"]["DEEPINFER_NATS_URL"] == ",".join(urls), name


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (v1) not installed")
def test_docker_compose_accepts_the_cluster_override() -> None:
    result = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "deploy" / "compose.nats-cluster.yaml"),
         "--profile", "cpu", "config", "-q"], capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
