"""What the codec needs to know about a model: context length, chat template, special tokens.

Torch-free (the recipe and the offline CLI use it). GGUF metadata is read once with `gguf.GGUFReader` (about
2.5 s for the packaged model) and cached as JSON under the cache dir, keyed by the file's path, size and mtime,
so later loads take milliseconds. HF checkpoints are read from config.json / tokenizer_config.json /
generation_config.json directly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from shared.models import ModelFiles

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the cached JSON's layout changes


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the API model id
    architecture: str  # "llama", "deepseek_v4", ... (GGUF general.architecture, HF config.json model_type)
    context_length: int  # prompt + completion tokens the model can hold
    chat_template: str | None  # jinja source; None = the model has none
    bos_token: str  # token text, for templates that write {{ bos_token }}
    eos_token: str
    architectures: tuple[str, ...] = ()  # HF config.json "architectures", e.g. ("DeepseekV4ForCausalLM",)
    vocab_size: int = 0  # token ids the model knows (HF config.json vocab_size, a GGUF's token count); 0 = unknown

    @property
    def is_deepseek_v4(self) -> bool:
        return is_deepseek_v4(self.architecture, self.architectures)


DEEPSEEK_V4 = "DeepseekV4ForCausalLM"


def is_deepseek_v4(model_type: str, architectures: Sequence[str]) -> bool:
    """config.json's `architectures` say so, or (some exports list none) its `model_type` does: the one rule the
    recipe, the engine's loader and the CLI share."""
    return DEEPSEEK_V4 in architectures if architectures else model_type == "deepseek_v4"


def cache_dir() -> Path:
    env = os.environ.get
    if env("DEEPINFER_CACHE_DIR"):
        return Path(env("DEEPINFER_CACHE_DIR", ""))
    base = Path(env("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "deepinfer"


def load_model_info(files: ModelFiles) -> ModelInfo:
    if files.format == "gguf":
        return _gguf_info(files.name, gguf_metadata(files.path))
    return _hf_info(files.name, files.path)


# --- GGUF ----------------------------------------------------------------------------------------------------


def gguf_metadata(path: Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (tensor data excluded), from the cache when it is fresh."""
    stat = path.stat()
    key = hashlib.blake2b(
        f"{CACHE_FORMAT}\x00{path.resolve()}\x00{stat.st_size}\x00{stat.st_mtime_ns}".encode(), digest_size=12
    ).hexdigest()
    cached = cache_dir() / f"gguf-{key}.json"
    try:
        return orjson.loads(cached.read_bytes())
    except FileNotFoundError:
        pass
    except orjson.JSONDecodeError:
        log.warning("ignoring corrupt metadata cache %s", cached)
    meta = _read_gguf(path)
    _write_atomic(cached, orjson.dumps(meta))
    return meta


def _read_gguf(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader  # imported lazily: only a cache miss pays for it

    reader = GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        meta[key] = value.tolist() if hasattr(value, "tolist") else value
    return meta


def _write_atomic(target: Path, data: bytes) -> None:
    """Best effort: a read-only or full cache dir only costs speed."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except OSError as exc:
        log.warning("could not cache %s: %s", target, exc)


def _gguf_info(name: str, meta: dict[str, Any]) -> ModelInfo:
    arch = meta.get("general.architecture", "llama")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens", [])

    def token_text(key: str) -> str:
        tid = meta.get(key)
        return tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else ""

    return ModelInfo(
        name=name,
        architecture=arch,
        context_length=int(meta.get(f"{arch}.context_length", 0)),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=token_text("tokenizer.ggml.bos_token_id"),
        eos_token=token_text("tokenizer.ggml.eos_token_id"),
        vocab_size=len(tokens),
    )


# --- HF checkpoint directory ---------------------------------------------------------------------------------

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it is absent."""
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def token_content(value: Any) -> str:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _hf_info(name: str, root: Path) -> ModelInfo:
    config = read_json(root / "config.json")
    tok_config = read_json(root / "tokenizer_config.json")
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    context = next(
        (int(c[k]) for c in (config, text_config) for k in _CONTEXT_KEYS if isinstance(c.get(k), int)), 0
    )
    if not context:  # last resort: tokenizers often store a huge sentinel here, so only trust sane values
        limit = tok_config.get("model_max_length")
        context = int(limit) if isinstance(limit, (int, float)) and limit < 10**8 else 0
    architectures = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    vocab = next((c["vocab_size"] for c in (config, text_config) if isinstance(c.get("vocab_size"), int)), 0)
    return ModelInfo(
        name=name,
        architecture=str(config.get("model_type", "")),
        context_length=context,
        chat_template=_hf_chat_template(root, tok_config),
        bos_token=token_content(tok_config.get("bos_token")),
        eos_token=token_content(tok_config.get("eos_token")),
        architectures=tuple(a for a in architectures if isinstance(a, str)),
        vocab_size=vocab,
    )


def _hf_chat_template(root: Path, tok_config: dict[str, Any]) -> str | None:
    """Newer checkpoints keep the template in its own file; older ones inline it in tokenizer_config.json,
    either as a string or as a list of named templates of which "default" is the chat one."""
    jinja = root / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = read_json(root / "chat_template.json").get("chat_template") or tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
