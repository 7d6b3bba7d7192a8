"""Configuration common to every service, built once at the edge from CLI flags with env defaults."""

from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True)
class ServiceConfig:
    nats_url: str
    instance: str
    state_dir: Path
    model: str

    def __post_init__(self) -> None:
        if not self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(f"--nats-url must be a nats:// URL, got {self.nats_url!r}")
        if not self.instance or any(c in self.instance for c in " .*>"):
            raise ValueError(f"--instance must be a non-empty subject token, got {self.instance!r}")


def add_common_args(parser: argparse.ArgumentParser, service: str) -> None:
    env = os.environ.get
    parser.add_argument("--nats-url", default=env("DEEPINFER_NATS_URL", DEFAULT_NATS_URL))
    parser.add_argument(
        "--instance",
        default=env("DEEPINFER_INSTANCE", f"{service}-{uuid.uuid4().hex[:8]}"),
        help="unique name of this process in the mesh",
    )
    parser.add_argument("--state-dir", default=env("DEEPINFER_STATE_DIR", ".state"))
    parser.add_argument("--model", default=env("DEEPINFER_MODEL", DEFAULT_MODEL))


def common_config(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(
        nats_url=args.nats_url,
        instance=args.instance,
        state_dir=Path(args.state_dir),
        model=args.model,
    )
