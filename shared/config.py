"""Configuration common to every service, built once at the edge from CLI flags with env defaults."""

from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from shared.logs import LOG_FORMATS

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
# the workers' batch limits (shared/worker/service.py), here so `deepinfer up --help` shows them without importing torch
DEFAULT_MAX_BATCH_TOKENS = 512  # on a CPU; on a GPU, by role (default_batch_tokens)
GPU_BATCH_TOKENS = {"prefill": 16384, "decode": 2048}
DEFAULT_MAX_RUNNING = 64


def default_batch_tokens(role: str, device: str) -> int:
    """Tokens per engine step when nobody says. On a GPU a prefill worker takes long chunks: every step reads
    all the weights once, so a 77K-token prompt in 5 chunks of 16K costs 5 weight reads, not 150 at 512; a
    decode worker keeps a short step (2048), so a prefill chunk there never holds its running streams long."""
    return GPU_BATCH_TOKENS.get(role, DEFAULT_MAX_BATCH_TOKENS) if device.startswith("cuda") else DEFAULT_MAX_BATCH_TOKENS


@dataclass(frozen=True)
class ServiceConfig:
    nats_url: str
    instance: str
    state_dir: Path
    model: str
    served_model_names: tuple[str, ...] = ()  # what clients call the model (the first in replies); () = its own name
    max_model_len: int | None = None  # caps prompt + completion below the model's own context length
    log_format: str = "text"

    def __post_init__(self) -> None:
        if not self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(f"--nats-url must be a nats:// URL, got {self.nats_url!r}")
        if not self.instance or any(c in self.instance for c in " .*>"):
            raise ValueError(f"--instance must be a non-empty subject token, got {self.instance!r}")
        if self.served_model_names and "," in self.model:
            raise ValueError("--served-model-name names one model; --model lists several")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")

    def model_name(self, own_name: str) -> str:
        """The name the mesh routes the model by: the first served name, else the model's own."""
        return self.served_model_names[0] if self.served_model_names else own_name


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except the defaults that mean "unset" (the help says what then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def model_names(text: str | list[str] | None) -> tuple[str, ...]:
    """--served-model-name's values (several, as vLLM takes them), or its env default "a,b"."""
    values = [text] if isinstance(text, str) else list(text or [])
    names = tuple(n.strip() for v in values for n in v.split(",") if n.strip())
    if len(set(names)) != len(names):
        raise ValueError(f"--served-model-name lists a name twice: {' '.join(names)}")
    return names


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
    parser.add_argument("--served-model-name", nargs="+", default=env("DEEPINFER_SERVED_MODEL_NAME") or None,
                        help="the model's name(s) in the API (default: the model's own)")
    parser.add_argument("--max-model-len", type=int, default=env("DEEPINFER_MAX_MODEL_LEN") or None,
                        help="prompt + completion tokens allowed (default: the model's context length)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=env("DEEPINFER_LOG_FORMAT") or "text")


def common_config(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(
        nats_url=args.nats_url,
        instance=args.instance,
        state_dir=Path(args.state_dir),
        model=args.model,
        served_model_names=model_names(args.served_model_name),
        max_model_len=args.max_model_len,
        log_format=args.log_format,
    )
