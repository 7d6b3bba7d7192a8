"""`deepinfer up`: the whole mesh on one machine.

Starts nats-server (JetStream, loopback, state under --state-dir) unless --nats-url names an external one, then
one process per service (`python -m services.<name>`, the same commands compose.yaml runs), waits until every
instance answers its health subject ready (printing progress while models load), and serves until Ctrl-C or
SIGTERM. Then it stops the services front to back (gateway first, so no new work arrives) and the server last.
Children die with the launcher even if it is killed outright (PR_SET_PDEATHSIG).

Before it starts anything it locks the state dir, checks the gateway's port and reads the model's metadata
(shared/launch/preflight.py); a child that dies is reported with its own last error line, from its log.

Once up, whatever dies is started again, nats-server included (on the port kept in the state dir, with its
JetStream store, so every service's connection finds it again): at once the first time, with a growing delay
when it keeps dying (shared/launch/backoff.py). A crash loop degrades the stack, it does not stop it: the rest
serves on, the loop is said on the launcher's output and answered on `launcher.stats` (the gateway's /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared import subjects
from shared.launch import cli_up, natsserver
from shared.launch.backoff import STABLE_S, RestartPolicy
from shared.bus import Bus, BusTimeout
from shared.launch.preflight import PreflightError, check_model, check_port, lock_state_dir
from shared.launch.process import die_with_parent
from shared.schemas.health import HealthReply, HealthRequest
from shared.schemas.launcher import LauncherStats, LauncherStatsReply, ProcessState
from shared.service import health_subject

STOP_ORDER = ["gateway", "recipe", "balancer", "prefill", "decode", "kvcache"]
SUPERVISE_EVERY_S = 0.5


@dataclass
class Child:
    service: str
    instance: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's own (secrets stay off argv)
    process: subprocess.Popen[bytes] | None = None
    log_offset: int = 0  # where the log of the current run starts (logs are appended to across restarts)
    detail: str = "starting"
    ready: bool = False
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    started_at: float = 0.0  # monotonic time of the current run's start
    restart_at: float | None = None  # dead and backing off: start it again at this monotonic time


@dataclass
class Plan:
    children: list[Child] = field(default_factory=list)

    def add(self, service: str, instance: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None
            ) -> None:
        argv = [sys.executable, "-m", f"services.{service}", "--instance", instance, *args]
        self.children.append(Child(service, instance, argv, log_dir / f"{instance}.log", env or {}))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return cli_up.parse(argv)


def build_plan(args: argparse.Namespace, state_dir: Path, nats_url: str) -> Plan:
    """Each flag goes to the services that own it: the served names to the gateway (/v1/models), the recipe
    (what requests may name) and the workers (what they serve, by which the balancer routes); the context cap to
    the recipe (it refuses longer requests), the workers (they hold no longer sequence) and the gateway (it
    reports it); the admission bounds to the recipe (it sees every request it launched); each worker its share
    of the GPU they all run on (cli_up.worker_share: the launcher splits one GPU between them)."""
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--nats-url", nats_url, "--state-dir", str(state_dir), "--model", args.model]
    if args.log_format != "text":
        common += ["--log-format", args.log_format]
    named = common + (["--served-model-name", *args.served_model_name] if args.served_model_name else [])
    capped = named + (["--max-model-len", str(args.max_model_len)] if args.max_model_len else [])
    worker = capped + ["--max-num-seqs", str(args.max_num_seqs)]
    for flag, value in (("--device", args.device), ("--max-num-batched-tokens", args.max_num_batched_tokens),
                        ("--speculative-tokens", args.speculative_tokens or None),
                        ("--speculative-method", args.speculative_method if args.speculative_tokens else None),
                        ("--speculative-policy", args.speculative_policy if args.speculative_tokens else None),
                        ("--kv-blocks", args.kv_blocks), ("--kv-arena-mib", args.kv_arena_mib),
                        ("--gpu-memory-utilization", cli_up.worker_share(args)),
                        ("--quantization", args.quantization if args.quantization != "auto" else None),
                        ("--load-format", args.load_format if args.load_format != "auto" else None),
                        ("--expert-parallel", args.expert_parallel if args.expert_parallel > 1 else None),
                        ("--kv-cache-dtype", args.kv_cache_dtype if args.kv_cache_dtype != "auto" else None)):
        worker += [flag, str(value)] if value is not None else []
    worker += ["--enforce-eager"] if args.enforce_eager else []
    worker += ["--deterministic"] if args.deterministic else []  # every worker: prefill's token 0 too
    gateway = capped + ["--host", args.host, "--port", str(args.port),
                        "--client-idle-timeout", str(args.client_idle_timeout),
                        "--client-header-timeout", str(args.client_header_timeout),
                        "--client-body-timeout", str(args.client_body_timeout)]
    plan = Plan()
    plan.add("kvcache", "kvcache-0", common, logs)
    # expert-parallel workers apply the experts role's placements; others would only log them
    roles = "prefill,decode,experts" if args.expert_parallel > 1 else "prefill,decode"
    plan.add("balancer", "balancer-0", common + ["--roles", roles], logs)
    for i in range(args.prefill_workers):
        plan.add("prefill", f"prefill-{i}", worker, logs)
    for i in range(args.decode_workers):
        plan.add("decode", f"decode-{i}", worker, logs)
    admission = ["--max-queued-requests", str(args.max_queued_requests), "--max-queued-tokens", str(args.max_queued_tokens),
                 "--max-migrations", str(args.max_migrations)]
    plan.add("recipe", "recipe-0", capped + admission, logs)
    # the key travels in the environment, not on a command line every user of `ps` can read
    plan.add("gateway", "gateway-0", gateway, logs, {"DEEPINFER_API_KEY": args.api_key} if args.api_key else None)
    return plan


def spawn(child: Child) -> None:
    log = open(child.log_path, "ab")
    child.log_offset = log.tell()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **child.env)
    child.process = subprocess.Popen(
        child.argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent, env=env
    )
    log.close()
    child.started_at, child.restart_at = time.monotonic(), None


def stop_all(children: list[Child], timeout: float = 15.0) -> None:
    rank = {name: i for i, name in enumerate(STOP_ORDER)}
    for child in sorted(children, key=lambda c: rank.get(c.service, len(rank))):
        if child.process is not None and child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
            try:
                child.process.wait(timeout)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def supervise(child: Child, now: float | None = None) -> None:
    """Restart a service that died once the stack was up (as compose's `restart: unless-stopped` does): the
    mesh is built to ride that out (a dead kvcache reads as misses, a dead worker's jobs are redelivered).
    One that keeps dying is restarted with a growing delay while the rest serves on (backoff.py)."""
    now = time.monotonic() if now is None else now
    if child.restart_at is not None:
        if now >= child.restart_at:
            spawn(child)
        return
    assert child.process is not None
    wait = _check_on(child.instance, child.process.poll(), child.restarts, child.started_at, now,
                     lambda: why_it_died(child))
    if wait is None:
        return
    if wait > 0:
        child.restart_at = now + wait
    else:
        spawn(child)


def _check_on(name: str, code: int | None, restarts: RestartPolicy, started_at: float, now: float,
              detail: Callable[[], str]) -> float | None:
    """None while the process runs (saying so once it has run long enough to be out of a crash loop); once it
    died, the wait before its restart, announced with `detail()` (where to look)."""
    if code is None:
        if restarts.settle(started_at, now):
            print(f"{name} has run {STABLE_S:.0f} s since its last restart: out of its crash loop", flush=True)
        return None
    wait = restarts.died(started_at, now)
    print(f"{name} exited with code {code}; {restart_note(restarts, wait)}{detail()}", flush=True)
    return wait


def restart_note(policy: RestartPolicy, wait: float) -> str:
    if policy.crash_looping():
        return (f"crash loop ({policy.streak} quick exits in a row): restarting it in {wait:g} s, the rest of the "
                f"mesh serves on")
    return f"restarting it in {wait:g} s" if wait > 0 else "restarting it"


@dataclass
class SupervisedNats:
    """The nats-server `up` started, restarted like a service when it dies (on its port, with its store)."""

    server: natsserver.NatsServer
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None

    @property
    def running(self) -> bool:
        return self.restart_at is None and self.server.process.poll() is None


def supervise_nats(nats: SupervisedNats, now: float) -> None:
    if nats.restart_at is None:
        wait = _check_on("nats-server", nats.server.process.poll(), nats.restarts, nats.started_at, now,
                         lambda: f" on {nats.server.url} (log: {nats.server.log_file})")
        if wait is None:
            return
        nats.restart_at = now + wait
    if now < nats.restart_at:
        return
    try:
        # On this thread, not a worker thread: PR_SET_PDEATHSIG fires when the *thread* that started a child
        # ends, so a server started from a pool thread would die with that thread. It waits (< 15 s) until the
        # server listens; nothing else needs supervising meanwhile.
        nats.server.restart()
    except (RuntimeError, TimeoutError, OSError) as exc:  # e.g. its port taken meanwhile: try again later
        wait = nats.restarts.died(now, time.monotonic())
        nats.restart_at = time.monotonic() + max(wait, 1.0)
        print(f"nats-server did not start again: {exc}; next try in {max(wait, 1.0):g} s", flush=True)
        return
    nats.started_at, nats.restart_at = time.monotonic(), None
    print(f"nats-server is back on {nats.server.url}", flush=True)


def stats(plan: Plan, nats: SupervisedNats | None, now: float) -> LauncherStatsReply:
    processes = [
        ProcessState(c.instance, c.service, running=c.restart_at is None and c.process is not None
                     and c.process.poll() is None, restarts=c.restarts.total,
                     crash_looping=c.restarts.crash_looping(),
                     restart_in_s=round(max(0.0, c.restart_at - now), 1) if c.restart_at is not None else 0.0)
        for c in plan.children
    ]
    if nats is not None:
        processes.append(ProcessState("nats-server", "nats", nats.running, nats.restarts.total,
                                      nats.restarts.crash_looping()))
    return LauncherStatsReply("launcher", processes)


async def serve(plan: Plan, nats: SupervisedNats | None, bus: Bus) -> None:
    """Supervise every process until cancelled (Ctrl-C, SIGTERM); answer `launcher.stats` meanwhile."""

    async def on_stats(_: LauncherStats) -> LauncherStatsReply:
        return stats(plan, nats, time.monotonic())

    await bus.serve(subjects.LAUNCHER_STATS, LauncherStats, on_stats)
    while True:
        now = time.monotonic()
        for child in plan.children:
            supervise(child, now)
        if nats is not None:
            supervise_nats(nats, now)
        await asyncio.sleep(SUPERVISE_EVERY_S)


async def up(plan: Plan, nats: SupervisedNats | None, nats_url: str, timeout: float, banner: str) -> None:
    bus = await Bus.connect(nats_url, "launcher")
    try:
        await wait_ready(plan, bus, timeout)
        for child in plan.children:  # what each worker holds: weights, KV pool, tokens of context that fit
            if (line := memory_line(child.log_path, child.log_offset)) is not None:
                print(f"{child.instance} {line}", flush=True)
        print(banner, flush=True)
        await serve(plan, nats, bus)
    finally:
        await bus.drain()


async def wait_ready(plan: Plan, bus: Bus, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    shown = ""
    while True:
        for child in plan.children:
            assert child.process is not None
            if child.process.poll() is not None:
                raise RuntimeError(
                    f"{child.instance} exited with code {child.process.returncode}{why_it_died(child)}"
                )
            if child.ready:
                continue
            try:
                reply = await bus.request(
                    health_subject(child.service, child.instance), HealthRequest(), HealthReply, timeout=1.0
                )
                child.ready, child.detail = reply.ready, reply.detail
            except BusTimeout:
                child.detail = "starting"
        waiting = [f"{c.instance} ({c.detail})" for c in plan.children if not c.ready]
        if not waiting:
            return
        line = "waiting for: " + ", ".join(waiting)
        if line != shown:
            print(line, flush=True)
            shown = line
        if time.monotonic() > deadline:
            raise TimeoutError(line)
        await asyncio.sleep(0.5)


def why_it_died(child: Child) -> str:
    """The child's own last error, as a suffix to "X exited with code N"."""
    lines = last_error(child.log_path, child.log_offset)
    shown = "".join(f"\n    {line}" for line in lines)
    return f":{shown}\n  (full log: {child.log_path})" if lines else f"; see {child.log_path}"


def last_error(log_path: Path, offset: int = 0, fallback_lines: int = 3) -> list[str]:
    """What a dead process said last about why: the ERROR line logged before its last traceback and the
    traceback's exception line (a crash); else its last ERROR/CRITICAL line or argparse's "error:" line; else
    its last few lines."""
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return []
    lines = [part for line in text.splitlines() for part in _plain(line).splitlines() if part.strip()]
    tb = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
             default=None)
    if tb is not None:
        exception = next((line for line in lines[tb + 1:] if not line[:1].isspace()), None)
        logged = [lines[tb - 1]] if tb and (" ERROR " in lines[tb - 1] or " CRITICAL " in lines[tb - 1]) else []
        return logged + ([exception] if exception else [])
    errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line or ": error: " in line]
    return errors[-1:] if errors else lines[-fallback_lines:]


MEMORY_MARK = "memory: weights "  # the line a worker logs at load (shared/engine/memory.py MemoryReport.line)


def memory_line(log_path: Path, offset: int = 0) -> str | None:
    """The last memory line a worker logged in this run (from its mark on), or None (not a worker)."""
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return None
    found = [line[line.index(MEMORY_MARK):] for line in map(_plain, text.splitlines()) if MEMORY_MARK in line]
    return found[-1] if found else None


def _plain(line: str) -> str:
    """A JSON log line (--log-format json) as its text line, its traceback unfolded after it."""
    if not line.startswith("{"):
        return line
    try:
        record = json.loads(line)
        text = f"{record['time']} {record['instance']} {record['level']} {record['logger']}: {record['message']}"
    except (ValueError, KeyError, TypeError):
        return line
    exception = record.get("exception")
    return f"{text}\n{exception}" if exception else text


def how_to_call(args: argparse.Namespace, model_name: str) -> str:
    base = f"http://{args.host}:{args.port}"
    # The key itself is not printed (terminals get logged and shared): the examples read it from the environment.
    auth, sdk_key, export = "", "'none'", ""
    if args.api_key:
        auth = " -H \"Authorization: Bearer $DEEPINFER_API_KEY\""
        sdk_key = "os.environ['DEEPINFER_API_KEY']"
        if os.environ.get("DEEPINFER_API_KEY") != args.api_key:
            export = "\n  export DEEPINFER_API_KEY=...   # the key given with --api-key; clients must send it\n"
    return f"""
DeepInfer mesh is up: {model_name} on {base}
{export}
  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model_name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c "import os; from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key={sdk_key}); \\
print(c.chat.completions.create(model='{model_name}', messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)"

Anthropic SDK: Anthropic(base_url='{base}', api_key={sdk_key}).messages.create(...)
Press Ctrl-C to stop.
"""


def main(argv: list[str] | None = None) -> int:
    return run(cli_up.parse(argv))


def run(args: argparse.Namespace) -> int:
    """`deepinfer up` with parsed flags (shared/launch/cli_up.py): check, start, wait, serve until signalled, stop."""
    state_dir = Path(args.state_dir).resolve()
    try:
        lock = lock_state_dir(state_dir, args.state_dir)  # first: a running `up` holds the port as well
        check_port(args.host, args.port)
        files = check_model(args.model, args.max_model_len, args.load_format)
    except PreflightError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_name = args.served_model_name[0] if args.served_model_name else files.name
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also when started in the background, where SIGINT starts ignored
    nats: SupervisedNats | None = None
    plan = Plan()
    try:
        if args.nats_url:
            nats_url = args.nats_url
        else:
            store = state_dir / "nats"
            server = natsserver.start(store, port=natsserver.persisted_port(store), log_file=state_dir / "nats.log")
            nats, nats_url = SupervisedNats(server), server.url
            print(f"nats-server with JetStream on {nats_url}", flush=True)
        plan = build_plan(args, state_dir, nats_url)
        for child in plan.children:
            spawn(child)
        print(f"started {len(plan.children)} services; logs in {state_dir / 'logs'}", flush=True)
        asyncio.run(up(plan, nats, nats_url, args.ready_timeout, how_to_call(args, model_name)))
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_all(plan.children)
        if nats is not None:
            nats.server.stop()
        lock.close()
        if stopping:
            print("stopped", flush=True)
