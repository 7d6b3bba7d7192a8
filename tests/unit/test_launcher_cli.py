"""`deepinfer up` / `serve` before anything starts: its checks name the cause, its flags have environment
defaults and reach the services that own them; `--version`, fast help, a dead child's own error, JSON logs.

The launcher runs as a subprocess (`python -m shared.launch.cli up ...`); every case here fails before a model loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shared.launch import cli_up, natsserver
from shared.config import add_common_args
from shared.launch.launcher import build_plan, how_to_call, last_error
from shared.logs import JsonFormatter
from shared.launch.preflight import lock_state_dir
from shared.version import VERSION
from shared.worker.config import add_worker_args

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "README.md"  # every DEEPINFER_* default is documented there


def up(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    return subprocess.run(
        [sys.executable, "-m", "shared.launch.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**clean, **(env or {})},
    )


# --- the checks before starting ---------------------------------------------------------------------------------


def test_a_used_port_is_named_with_what_holds_it(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = up("up", "--port", str(port), "--state-dir", str(tmp_path / "state"))
    assert result.returncode == 2
    assert f"127.0.0.1:{port} is already in use by pid {os.getpid()}" in result.stderr
    assert not (tmp_path / "state" / "nats").exists()  # nothing was started


def test_a_second_up_on_a_state_dir_in_use_fails_at_once(tmp_path: Path) -> None:
    state = tmp_path / "state"
    lock = lock_state_dir(state, str(state))  # this process plays the running `up`
    try:
        result = up("up", "--port", "0", "--state-dir", str(state))
    finally:
        lock.close()
    assert result.returncode == 2
    assert f"state dir {state} is in use by deepinfer up pid {os.getpid()}" in result.stderr
    assert not (state / "nats").exists()


def test_a_model_directory_without_a_tokenizer_is_named(tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    (model / "model.safetensors").write_bytes(b"")
    result = up("serve", str(model), "--port", "0", "--state-dir", str(tmp_path / "state"))
    assert result.returncode == 2
    assert f"{model} has no tokenizer.json" in result.stderr


def test_max_model_len_beyond_the_models_context_is_refused(tmp_path: Path) -> None:
    result = up("up", "--port", "0", "--max-model-len", "100000", "--state-dir", str(tmp_path / "s"))
    assert result.returncode == 2
    assert "--max-model-len 100000 exceeds SmolLM2-135M-Instruct's context length 8192" in result.stderr


def test_two_nats_servers_never_share_a_store(tmp_path: Path) -> None:
    server = natsserver.start(tmp_path / "nats")
    try:
        with pytest.raises(RuntimeError, match=f"in use by the nats-server of pid {os.getpid()}"):
            natsserver.start(tmp_path / "nats")
    finally:
        server.stop()
    natsserver.start(tmp_path / "nats").stop()  # free again once stopped


def test_a_dead_nats_server_is_restarted_on_its_kept_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    from shared.launch.launcher import SupervisedNats, supervise_nats

    store = tmp_path / "nats"
    port = natsserver.persisted_port(store)
    nats = SupervisedNats(natsserver.start(store, port=port))
    try:
        assert nats.server.url.endswith(f":{port}")
        first = nats.server.process
        first.send_signal(signal.SIGKILL)
        first.wait()
        supervise_nats(nats, nats.started_at + 1)  # a quick first death: restarted at once
        assert nats.running and nats.server.process is not first and nats.server.url.endswith(f":{port}")
        assert nats.restarts.total == 1 and not nats.restarts.crash_looping()
        assert f"nats-server exited with code -9; restarting it on nats://127.0.0.1:{port}" in capsys.readouterr().out
    finally:
        nats.server.stop()
    assert natsserver.persisted_port(store) == port  # the next `up` listens where the last one did


# --- flags, environment, version, help -----------------------------------------------------------------------


def test_version() -> None:
    result = up("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"deepinfer {VERSION}"
    assert 'attr = "shared.version.VERSION"' in (ROOT / "pyproject.toml").read_text()  # one source of it


def test_every_flag_of_up_has_an_environment_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("DEEPINFER_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("DEEPINFER_PORT", "9123")
    monkeypatch.setenv("DEEPINFER_SERVED_MODEL_NAME", "smol, alias")
    monkeypatch.setenv("DEEPINFER_MAX_MODEL_LEN", "512")
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("DEEPINFER_LOG_FORMAT", "json")
    args = cli_up.parse([])
    assert (args.port, args.served_model_name, args.max_model_len) == (9123, ["smol", "alias"], 512)
    assert (args.max_num_seqs, args.log_format) == (7, "json")
    assert cli_up.parse(["--port", "9000", "--max-running", "3"]).port == 9000  # the command line wins
    assert cli_up.parse(["--max-running", "3"]).max_num_seqs == 3
    names = {cli_up.env_name(a) for a in cli_up.flag_actions(cli_up.parser())}
    assert {"DEEPINFER_API_KEY", "DEEPINFER_MODEL", "DEEPINFER_GPU_MEMORY_UTILIZATION"} <= names
    documented = NOTES.read_text()
    assert [n for n in sorted(names) if f"`{n}`" not in documented] == []


def test_a_bad_environment_value_is_named(tmp_path: Path) -> None:
    result = up("up", "--state-dir", str(tmp_path), env={"DEEPINFER_PORT": "eighty"})
    assert result.returncode == 2 and "DEEPINFER_PORT='eighty' is not a valid --port value" in result.stderr


def test_serve_takes_the_model_as_its_argument() -> None:
    assert cli_up.parse(["./some-model"], "deepinfer serve", positional_model=True).model == "./some-model"
    assert cli_up.parse(["--model", "m"], "deepinfer serve", positional_model=True).model == "m"


@pytest.mark.parametrize("command", ["up", "serve", "generate"])
def test_help_shows_defaults_without_importing_torch(command: str) -> None:
    code = (
        "import sys\nfrom shared.launch.cli import main\ntry:\n    main([sys.argv[1], '--help'])\n"
        "except SystemExit:\n    pass\nprint('torch loaded' if 'torch' in sys.modules else 'no torch')"
    )
    result = subprocess.run([sys.executable, "-c", code, command], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("no torch")
    assert "(default: " in result.stdout
    if command != "generate":
        assert "(default: 8000)" in result.stdout and "(default: SmolLM2-135M-Instruct)" in result.stdout


def test_each_flag_reaches_the_services_that_own_it(tmp_path: Path) -> None:
    args = cli_up.parse(["--served-model-name", "smol", "alias", "--max-model-len", "300", "--api-key", "k3y",
                         "--gpu-memory-utilization", "0.4", "--max-num-seqs", "9", "--kv-blocks", "100",
                         "--log-format", "json"])
    plan = build_plan(args, tmp_path, "nats://127.0.0.1:4222")
    argv = {c.service: " ".join(c.argv) for c in plan.children}
    for service in ("gateway", "recipe", "prefill", "decode"):
        assert "--served-model-name smol alias" in argv[service]
    for service in ("recipe", "prefill", "decode", "gateway"):
        assert "--max-model-len 300" in argv[service]
    for service in ("prefill", "decode"):
        assert "--gpu-memory-utilization 0.4" in argv[service] and "--kv-blocks 100" in argv[service]
        assert "--max-num-seqs 9" in argv[service]
    assert "--served-model-name" not in argv["kvcache"] and "--max-model-len" not in argv["balancer"]
    assert all("--log-format json" in a for a in argv.values())
    assert all("k3y" not in a for a in argv.values())  # the key is not on a command line
    (gateway,) = [c for c in plan.children if c.service == "gateway"]
    assert gateway.env == {"DEEPINFER_API_KEY": "k3y"}
    # every flag the launcher passes, the worker accepts
    parser = argparse.ArgumentParser()
    add_common_args(parser, "prefill")
    add_worker_args(parser)
    (prefill,) = [c for c in plan.children if c.service == "prefill"]
    parsed = parser.parse_args(prefill.argv[3:])
    assert (parsed.max_running, parsed.kv_blocks, parsed.gpu_memory_utilization) == (9, 100, 0.4)


def test_expert_parallel_reaches_the_workers_and_starts_the_experts_role(tmp_path: Path) -> None:
    argv = {c.service: c.argv[3:] for c in build_plan(cli_up.parse(["--expert-parallel", "2"]), tmp_path,
                                                      "nats://127.0.0.1:4222").children}
    parser = argparse.ArgumentParser()
    add_common_args(parser, "decode")
    add_worker_args(parser)
    assert parser.parse_args(argv["decode"]).expert_parallel == 2
    assert argv["balancer"][argv["balancer"].index("--roles") + 1] == "prefill,decode,experts"
    plain = {c.service: c.argv for c in build_plan(cli_up.parse([]), tmp_path, "nats://127.0.0.1:4222").children}
    assert "--expert-parallel" not in plain["decode"] and "prefill,decode" in plain["balancer"]
    with pytest.raises(SystemExit):
        cli_up.parse(["--expert-parallel", "0"])


def test_the_launcher_splits_one_gpu_between_its_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker runs on the one device: by default they share 0.9 of it evenly; a share given is each
    worker's own (vLLM's meaning), refused when the workers' shares add up past the whole device."""
    for key in [k for k in os.environ if k.startswith("DEEPINFER_")]:
        monkeypatch.delenv(key)

    def shares(*flags: str) -> list[str]:
        plan = build_plan(cli_up.parse(list(flags)), tmp_path, "nats://127.0.0.1:4222")
        argvs = [c.argv for c in plan.children if c.service in ("prefill", "decode")]
        return [a[a.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in a else "-" for a in argvs]

    assert shares() == ["0.45", "0.45"]
    assert shares("--prefill-workers", "2") == ["0.3", "0.3", "0.3"]
    assert shares("--gpu-memory-utilization", "0.3") == ["0.3", "0.3"]
    assert shares("--device", "cpu") == ["-", "-"]  # no GPU, no share
    monkeypatch.setenv("DEEPINFER_GPU_MEMORY_UTILIZATION", "0.2")
    assert shares() == ["0.2", "0.2"]
    monkeypatch.delenv("DEEPINFER_GPU_MEMORY_UTILIZATION")
    with pytest.raises(SystemExit):
        cli_up.parse(["--gpu-memory-utilization", "0.6"])  # 2 x 0.6 of one GPU
    assert cli_up.parse(["--gpu-memory-utilization", "0.6", "--device", "cpu"]).gpu_memory_utilization == 0.6


def test_admission_and_client_timeouts_reach_the_recipe_and_the_gateway(tmp_path: Path) -> None:
    from services.gateway.config import add_args as add_gateway_args
    from services.gateway.config import gateway_config
    from services.recipe.__main__ import add_args as add_recipe_args

    args = cli_up.parse(["--max-queued-requests", "5", "--max-queued-tokens", "900", "--client-idle-timeout", "7",
                         "--client-header-timeout", "3", "--client-body-timeout", "11"])
    children = {c.service: c.argv[3:] for c in build_plan(args, tmp_path, "nats://127.0.0.1:4222").children}
    recipe = argparse.ArgumentParser()
    add_common_args(recipe, "recipe")
    add_recipe_args(recipe)
    parsed = recipe.parse_args(children["recipe"])
    assert (parsed.max_queued_requests, parsed.max_queued_tokens) == (5, 900)
    gateway = argparse.ArgumentParser()
    add_common_args(gateway, "gateway")
    add_gateway_args(gateway)
    config = gateway_config(gateway.parse_args(children["gateway"]))
    assert (config.client_idle_timeout_s, config.client_header_timeout_s, config.client_body_timeout_s) == (7, 3, 11)
    for bad in (["--max-queued-requests", "-1"], ["--client-body-timeout", "0"]):
        with pytest.raises(SystemExit):
            cli_up.parse(bad)


def test_the_banner_sends_the_key_when_one_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPINFER_API_KEY", raising=False)
    plain = how_to_call(cli_up.parse([]), "m")
    assert "Authorization" not in plain and "api_key='none'" in plain
    keyed = how_to_call(cli_up.parse(["--api-key", "s3cret"]), "m")
    assert 'Authorization: Bearer $DEEPINFER_API_KEY' in keyed
    assert "api_key=os.environ['DEEPINFER_API_KEY']" in keyed and "export DEEPINFER_API_KEY" in keyed
    assert "s3cret" not in keyed


# --- what a dead child said, and the log format ----------------------------------------------------------------


def test_the_last_error_of_a_crash_is_its_exception_line(tmp_path: Path) -> None:
    log = tmp_path / "gateway-0.log"
    log.write_text("an earlier run\nTraceback (most recent call last):\n  x\nValueError: old\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("2026-12-01 10:00:00,000 gateway-0 INFO shared.service: starting\n"
                "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n    bind()\n"
                "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address "
                "already in use\n")
    assert last_error(log, offset) == [
        "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already in use"
    ]
    logged = tmp_path / "prefill-0.log"
    logged.write_text("x INFO a: loading\nx prefill-0 ERROR shared.worker: could not load model m\n"
                      "Traceback (most recent call last):\n  File \"e.py\"\nFileNotFoundError: no weights\n")
    assert last_error(logged) == ["x prefill-0 ERROR shared.worker: could not load model m",
                                  "FileNotFoundError: no weights"]
    usage = tmp_path / "recipe-0.log"
    usage.write_text("usage: python -m services.recipe [-h]\npython -m services.recipe: error: bad --model\n")
    assert last_error(usage) == ["python -m services.recipe: error: bad --model"]


def test_json_logs_are_one_object_per_line_and_read_back_as_errors(tmp_path: Path) -> None:
    formatter = JsonFormatter("prefill", "prefill-0")
    try:
        raise FileNotFoundError("no weights")
    except FileNotFoundError:
        record = logging.LogRecord("shared.worker", logging.ERROR, "w.py", 1, "could not load %s", ("m",),
                                   sys.exc_info())
    line = formatter.format(record)
    assert "\n" not in line
    data = json.loads(line)
    assert {k: data[k] for k in ("level", "service", "instance", "logger", "message")} == {
        "level": "ERROR", "service": "prefill", "instance": "prefill-0", "logger": "shared.worker",
        "message": "could not load m",
    }
    assert data["time"].endswith("Z") and data["exception"].endswith("FileNotFoundError: no weights")
    log = tmp_path / "prefill-0.log"
    log.write_text(line + "\n")
    assert last_error(log)[-1] == "FileNotFoundError: no weights"
    assert "ERROR shared.worker: could not load m" in last_error(log)[0]


def test_up_shows_each_workers_memory_line_of_this_run(tmp_path: Path) -> None:
    """`deepinfer up` prints what each worker logged at load (MemoryReport.line), from this run's part of its
    log, text or JSON; a service that logs none shows nothing."""
    from shared.engine.memory import MemoryReport
    from shared.launch.launcher import memory_line

    old = MemoryReport(1, 2, 3, 16, 0, 64).line()
    new = MemoryReport(3 << 30, 1 << 30, 512, 128, 0, 4096).line()
    log = tmp_path / "decode-0.log"
    log.write_text(f"2026-12-01 10:00:00,000 decode-0 INFO shared.worker.service: {old}\n")
    offset = log.stat().st_size
    record = {"time": "t", "instance": "decode-0", "level": "INFO", "logger": "shared.worker.service", "message": new}
    with open(log, "a") as f:
        f.write("x decode-0 INFO shared.worker.service: loaded m in 1.0s\n" + json.dumps(record) + "\n")
    assert memory_line(log, offset) == new and memory_line(log) == new
    assert memory_line(log, 0).startswith("memory: weights 3.00 GiB, KV pool 1.00 GiB (512 blocks of 128 tokens)")
    gateway = tmp_path / "gateway-0.log"
    gateway.write_text("x gateway-0 INFO shared.service: ready\n")
    assert memory_line(gateway) is None and memory_line(tmp_path / "missing.log") is None


def test_deterministic_reaches_every_worker_and_only_them(tmp_path: Path) -> None:
    """Prefill samples token 0 and decode the rest: both must run the batch-invariant kernels."""
    plan = build_plan(cli_up.parse(["--deterministic"]), tmp_path, "nats://127.0.0.1:4222")
    argv = {c.service: c.argv[3:] for c in plan.children}
    parser = argparse.ArgumentParser()
    add_common_args(parser, "decode")
    add_worker_args(parser)
    for service in ("prefill", "decode"):
        assert parser.parse_args(argv[service]).deterministic is True
    assert all("--deterministic" not in argv[s] for s in ("gateway", "recipe", "balancer", "kvcache"))
    plain = build_plan(cli_up.parse([]), tmp_path, "nats://127.0.0.1:4222")
    assert all("--deterministic" not in c.argv for c in plain.children)


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("false", False)])
def test_a_switch_from_the_environment_reads_as_a_switch(monkeypatch: pytest.MonkeyPatch, value: str,
                                                         expected: bool) -> None:
    monkeypatch.setenv("DEEPINFER_DETERMINISTIC", value)
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", value)
    args = cli_up.parse([])
    assert args.deterministic is expected and args.enforce_eager is expected
