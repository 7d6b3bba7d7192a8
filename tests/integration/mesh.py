"""Run the real mesh for a test module: `deepinfer up` in a subprocess, on a free port, with its own state."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

READY_MARK = "DeepInfer mesh is up"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids_mentioning(text: str) -> list[int]:
    """Processes whose command line contains `text` (the mesh's private state dir names all of them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@dataclass
class Mesh:
    process: subprocess.Popen[str]
    base_url: str
    state_dir: Path
    nats_url: str = ""
    output: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 60.0, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_mesh(state_dir: Path, *extra: str, timeout: float = 300.0, env: dict[str, str] | None = None) -> Mesh:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "shared.launch.cli", "up", "--port", str(port), "--state-dir", str(state_dir), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    mesh = Mesh(process, f"http://127.0.0.1:{port}", state_dir)
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            mesh.output.append(line)
            if line.startswith("nats-server with JetStream on "):
                mesh.nats_url = line.split()[-1]
            if READY_MARK in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            mesh.stop()
            logs = "".join(
                f"\n--- {p.name}\n" + p.read_text()[-3000:] for p in sorted((state_dir / "logs").glob("*.log"))
            )
            raise RuntimeError("mesh did not come up:\n" + "".join(mesh.output) + logs)
    return mesh
