"""Configuration: each service's settings are a frozen dataclass, validated on creation, and its command-line
flags are built from that dataclass (`add_flags`, `from_args`): the default, the type and the help of a flag are
written once, on the field. ServiceConfig holds what every service takes; each service adds its own record
(services/<name>/config.py, shared/worker/config.py). `deepinfer up` reads its defaults from the same records
(`default_of`).

A field becomes a flag through `option(...)`:

    port: int = option(8000, help="...")                   # --port, an int (from the annotation)
    request_timeout_s: float = option(30.0, help="...")     # --request-timeout: a trailing _s (seconds) is dropped
    api_key: str | None = option(None, env=True)            # also read from DEEPINFER_API_KEY
    max_running: int = option(64, flag="--max-running", aliases=("--max-num-seqs",))  # vLLM's second spelling

An environment variable (env=True: DEEPINFER_<FLAG>, or a name) replaces the default; empty means unset; the
command line wins. Fields without `option` are not flags (tests and callers set them).
"""

from __future__ import annotations

import argparse
import os
import types
import typing
import uuid
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from shared.logs import LOG_FORMATS

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
# the workers' batch limits (shared/worker/service.py), here so `deepinfer up --help` shows them without importing torch
DEFAULT_MAX_BATCH_TOKENS = 512  # on a CPU; on a GPU, by role (default_batch_tokens)
GPU_BATCH_TOKENS = {"prefill": 16384, "decode": 2048}
DEFAULT_MAX_RUNNING = 64

ENV_PREFIX = "DEEPINFER_"
TRUE = ("1", "true", "yes", "on")  # what turns a switch on from the environment
_FLAG = "deepinfer.flag"  # the field metadata keys
_NESTED = "deepinfer.nested"
T = TypeVar("T")


def default_batch_tokens(role: str, device: str) -> int:
    """Tokens per engine step when nobody says. On a GPU a prefill worker takes long chunks: every step reads
    all the weights once, so a 77K-token prompt in 5 chunks of 16K costs 5 weight reads, not 150 at 512; a
    decode worker keeps a short step (2048), so a prefill chunk there never holds its running streams long."""
    return GPU_BATCH_TOKENS.get(role, DEFAULT_MAX_BATCH_TOKENS) if device.startswith("cuda") else DEFAULT_MAX_BATCH_TOKENS


# --- fields as flags -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """How one config field is set from the command line (the field's metadata)."""

    flag: str = ""  # "" = from the field's name
    aliases: tuple[str, ...] = ()  # second spellings (vLLM's)
    help: str | None = None
    env: bool | str = False  # True: DEEPINFER_<FLAG>; a str: that variable
    parse: Callable[[str], Any] | None = None  # argparse's `type`; None: from the annotation (int, float)
    convert: Callable[[Any], Any] | None = None  # the parsed value -> the field's (e.g. Path)
    choices: Sequence[str] | None = None
    nargs: str | None = None
    group: str | None = None  # the --help section; None: the parser's own


def option(default: Any = MISSING, *, default_factory: Callable[[], Any] | None = None, **flag: Any) -> Any:
    """A dataclass field that is also a flag; `flag` takes Flag's fields (help, env, aliases...)."""
    metadata = {_FLAG: Flag(**flag)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def nested(cls: type, group: str | None = None) -> Any:
    """A field holding another settings record whose fields are flags too (in `group`, unless they say)."""
    return field(default_factory=cls, metadata={_NESTED: (cls, group)})


def flag_name(f: Field[Any]) -> str:
    return f.metadata[_FLAG].flag or "--" + f.name.removesuffix("_s").replace("_", "-")


def _dest(f: Field[Any]) -> str:
    return flag_name(f)[2:].replace("-", "_")  # argparse's own choice, from the first spelling


def _env_name(f: Field[Any]) -> str | None:
    env = f.metadata[_FLAG].env
    return env if isinstance(env, str) else ENV_PREFIX + _dest(f).upper() if env else None


def _record_default(f: Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def default_of(cls: type, name: str) -> Any:
    """A field's default (for `deepinfer up`, whose flags pass it on)."""
    (f,) = [f for f in fields(cls) if f.name == name]
    return _record_default(f)


def _kind(hint: Any) -> Any:
    """A field's type without `| None`: int, float, str, bool..."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else hint
    return hint


def add_flags(parser: argparse.ArgumentParser, cls: type, group: str | None = None, **defaults: Any) -> None:
    """One argparse option per `option` field of `cls`, in field order; `defaults` replace the record's (e.g. a
    default that depends on the service)."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if _NESTED in f.metadata:
            inner, inner_group = f.metadata[_NESTED]
            add_flags(parser, inner, inner_group or group)
            continue
        if _FLAG not in f.metadata:
            continue
        flag: Flag = f.metadata[_FLAG]
        default = defaults[f.name] if f.name in defaults else _record_default(f)
        kind = _kind(hints[f.name])
        if (env := _env_name(f)) is not None and os.environ.get(env):
            default = os.environ[env].lower() in TRUE if kind is bool else os.environ[env]  # argparse parses it
        where = _group(parser, flag.group or group)
        names = (flag_name(f), *flag.aliases)
        if kind is bool:
            where.add_argument(*names, action="store_true", default=default, help=flag.help)
            continue
        parse = flag.parse or (kind if kind in (int, float) else None)
        extra = {"nargs": flag.nargs} if flag.nargs is not None else {}
        where.add_argument(*names, type=parse, choices=flag.choices, default=default, help=flag.help, **extra)


def _group(parser: argparse.ArgumentParser, title: str | None) -> argparse.ArgumentParser | argparse._ArgumentGroup:
    if title is None:
        return parser
    for group in parser._action_groups:  # argparse has no lookup by title
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """The record from parsed flags (`add_flags`); `given` sets the fields that are not flags of this parser."""
    values = dict(given)
    for f in fields(cls):
        if f.name in values:
            continue
        if _NESTED in f.metadata:
            values[f.name] = from_args(f.metadata[_NESTED][0], args)
        elif _FLAG in f.metadata:
            value, convert = getattr(args, _dest(f)), f.metadata[_FLAG].convert
            values[f.name] = convert(value) if convert is not None else value
    return cls(**values)


# --- what every service takes --------------------------------------------------------------------------------


def model_names(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """--served-model-name's values (several, as vLLM takes them), or its env default "a,b"."""
    values = [text] if isinstance(text, str) else list(text or [])
    names = tuple(n.strip() for v in values for n in v.split(",") if n.strip())
    if len(set(names)) != len(names):
        raise ValueError(f"--served-model-name lists a name twice: {' '.join(names)}")
    return names


def _instance() -> str:
    return f"service-{uuid.uuid4().hex[:8]}"  # add_common_args names it after the service


@dataclass(frozen=True)
class ServiceConfig:
    nats_url: str = option(DEFAULT_NATS_URL, env=True)
    instance: str = option(default_factory=_instance, env=True, help="unique name of this process in the mesh")
    state_dir: Path = option(Path(".state"), env=True, convert=Path)
    model: str = option(DEFAULT_MODEL, env=True)
    # what clients call the model (the first in replies); () = its own name
    served_model_names: tuple[str, ...] = option(
        (), flag="--served-model-name", env=True, nargs="+", convert=model_names,
        help="the model's name(s) in the API (default: the model's own)")
    # caps prompt + completion below the model's own context length
    max_model_len: int | None = option(
        None, env=True, help="prompt + completion tokens allowed (default: the model's context length)")
    log_format: str = option("text", env=True, choices=LOG_FORMATS)

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


def add_common_args(parser: argparse.ArgumentParser, service: str) -> None:
    add_flags(parser, ServiceConfig, instance=f"{service}-{uuid.uuid4().hex[:8]}")


def common_config(args: argparse.Namespace) -> ServiceConfig:
    return from_args(ServiceConfig, args)
