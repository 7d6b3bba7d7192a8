"""`deepinfer up`: the whole mesh on one machine.

Starts nats-server (JetStream, loopback, state under --state-dir) unless --nats-url names an external one, then
one process per service (`python -m services.<name>`, the same commands compose.yaml runs), waits until every
instance answers its health subject ready (printing progress while models load), and serves until Ctrl-C or
SIGTERM. Then it stops the services front to back (gateway first, so no new work arrives) and the server last.
Children die with the launcher even if it is killed outright (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared import natsserver
from shared.process import die_with_parent
from shared.bus import Bus, BusTimeout
from shared.config import DEFAULT_MODEL
from shared.schemas.workers import HealthReply, HealthRequest
from shared.service import health_subject

STOP_ORDER = ["gateway", "recipe", "balancer", "prefill", "decode", "kvcache"]
MAX_RESTARTS = 5  # a service that exits more often than this in RESTART_WINDOW_S stops the stack
RESTART_WINDOW_S = 60.0


@dataclass
class Child:
    service: str
    instance: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    detail: str = "starting"
    ready: bool = False
    restarts: list[float] = field(default_factory=list)  # monotonic times it was restarted at


@dataclass
class Plan:
    children: list[Child] = field(default_factory=list)

    def add(self, service: str, instance: str, args: list[str], log_dir: Path) -> None:
        argv = [sys.executable, "-m", f"services.{service}", "--instance", instance, *args]
        self.children.append(Child(service, instance, argv, log_dir / f"{instance}.log"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deepinfer up", description="Run the whole mesh on this machine.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=DEFAULT_MODEL, help="packaged model name, .gguf file or HF checkpoint dir")
    p.add_argument("--nats-url", default=None, help="use this NATS server instead of starting one")
    p.add_argument("--state-dir", default=".state", help="NATS, KV store and logs live here")
    p.add_argument("--device", default=None, help="engine device (default: cuda when available, else cpu)")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--speculative-tokens", type=int, default=0,
                   help="MTP drafts per decode step for models with an MTP layer (DeepSeek-V4)")
    p.add_argument("--api-key", default=None, help="require this API key from clients")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    return p.parse_args(argv)


def build_plan(args: argparse.Namespace, state_dir: Path, nats_url: str) -> Plan:
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--nats-url", nats_url, "--state-dir", str(state_dir), "--model", args.model]
    worker = common + (["--device", args.device] if args.device else [])
    worker += ["--speculative-tokens", str(args.speculative_tokens)] if args.speculative_tokens else []
    gateway = common + ["--host", args.host, "--port", str(args.port)]
    if args.api_key:
        gateway += ["--api-key", args.api_key]
    plan = Plan()
    plan.add("kvcache", "kvcache-0", common, logs)
    plan.add("balancer", "balancer-0", common + ["--roles", "prefill,decode"], logs)
    for i in range(args.prefill_workers):
        plan.add("prefill", f"prefill-{i}", worker, logs)
    for i in range(args.decode_workers):
        plan.add("decode", f"decode-{i}", worker, logs)
    plan.add("recipe", "recipe-0", common, logs)
    plan.add("gateway", "gateway-0", gateway, logs)
    return plan


def spawn(child: Child) -> None:
    log = open(child.log_path, "ab")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child.process = subprocess.Popen(
        child.argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent, env=env
    )
    log.close()


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


def supervise(child: Child) -> None:
    """Restart a service that died once the stack was up (as compose's `restart: unless-stopped` does): the
    mesh is built to ride that out (a dead kvcache reads as misses, a dead worker's jobs are redelivered);
    a service that keeps dying stops the stack."""
    assert child.process is not None
    code = child.process.poll()
    if code is None:
        return
    now = time.monotonic()
    child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S]
    if len(child.restarts) >= MAX_RESTARTS:
        raise RuntimeError(f"{child.instance} exited with code {code}, {MAX_RESTARTS} times within "
                           f"{RESTART_WINDOW_S:.0f} s; see {child.log_path}")
    print(f"{child.instance} exited with code {code}; restarting it", flush=True)
    child.restarts.append(now)
    spawn(child)


async def wait_ready(plan: Plan, nats_url: str, timeout: float) -> None:
    bus = await Bus.connect(nats_url, "launcher")
    deadline = time.monotonic() + timeout
    shown = ""
    try:
        while True:
            for child in plan.children:
                assert child.process is not None
                if child.process.poll() is not None:
                    raise RuntimeError(
                        f"{child.instance} exited with code {child.process.returncode}; see {child.log_path}"
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
    finally:
        await bus.drain()


def how_to_call(args: argparse.Namespace, model_name: str) -> str:
    base = f"http://{args.host}:{args.port}"
    return f"""
DeepInfer mesh is up: {model_name} on {base}

  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model_name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model_name}', messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)"

Anthropic SDK: Anthropic(base_url='{base}', api_key='none').messages.create(...)
Press Ctrl-C to stop.
"""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from shared.models import ModelNotFound, resolve

    try:
        model_name = resolve(args.model).name
    except ModelNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    state_dir = Path(args.state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also when started in the background, where SIGINT starts ignored
    server = None
    plan = Plan()
    try:
        if args.nats_url:
            nats_url = args.nats_url
        else:
            server = natsserver.start(state_dir / "nats", log_file=state_dir / "nats.log")
            nats_url = server.url
            print(f"nats-server with JetStream on {nats_url}", flush=True)
        plan = build_plan(args, state_dir, nats_url)
        for child in plan.children:
            spawn(child)
        print(f"started {len(plan.children)} services; logs in {state_dir / 'logs'}", flush=True)
        asyncio.run(wait_ready(plan, nats_url, args.ready_timeout))
        print(how_to_call(args, model_name), flush=True)
        while True:
            for child in plan.children:
                supervise(child)
            time.sleep(0.5)
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
        if server is not None:
            server.stop()
        if stopping:
            print("stopped", flush=True)
