"""A model's own tokenizer, torch-free: text <-> token ids, plus each token's raw bytes for streaming.

Two sources:
- a GGUF file: a `tokenizers` BPE is rebuilt from the metadata (`tokenizer.ggml.tokens`, `.merges`,
  `.token_type`, `.pre`); only byte-level BPE ("gpt2" model) is supported, with a pre-tokenizer chosen by
  name from `PRE_TOKENIZERS`. Metadata comes through `shared.model_info.gguf_metadata` (cached).
- an HF checkpoint directory: `tokenizer.json`, with BOS/EOS from tokenizer_config.json,
  generation_config.json and config.json. (DeepSeek-V4 checkpoints often ship none: `shared.deepseek_tokenizer`
  falls back to the packaged V4 tokenizer.)

`encode` maps special-token text (e.g. `<|im_start|>`) to its id, as HF does when it tokenizes a rendered
chat template (add_special_tokens=False: the template writes BOS itself when the model wants one).
`encode_marked` is the injection-safe form for a rendered chat template: only the spans the caller marks (the
template's own) become control tokens, so client text that spells `<|im_end|>` stays the ordinary pieces of
those characters.
`token_bytes` gives the exact bytes a token stands for, so a streaming detokenizer can join them and never
emit half a UTF-8 character.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import orjson
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from shared.model_info import gguf_metadata, read_json, token_content
from shared.models import ModelFiles


class UnsupportedTokenizer(ValueError):
    pass


# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp also treats as end-of-generation when a GGUF marks them as control tokens.
_EOG_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>", "<|eom_id|>",
     "<｜end▁of▁sentence｜>"}
)


@dataclass(frozen=True)
class Tokenizer:
    tk: tokenizers.Tokenizer
    bos_id: int | None
    eos_ids: frozenset[int]
    special_ids: frozenset[int]  # control tokens: never rendered as text by decode(skip_special=True)
    _bytes: tuple[bytes, ...]  # token id -> the bytes it stands for

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    @cached_property
    def control_texts(self) -> tuple[str, ...]:
        """The control tokens' spellings, longest first (so one that contains another is matched whole)."""
        added = self.tk.get_added_tokens_decoder()
        return tuple(sorted({added[i].content for i in self.special_ids if i in added}, key=len, reverse=True))

    @cached_property
    def markup_ids(self) -> frozenset[int]:
        """Added tokens that are not control tokens (DeepSeek's ｜DSML｜, </think>): markup the output parser reads
        by id, while decode() shows their text."""
        return frozenset(self.tk.get_added_tokens_decoder()) - self.special_ids

    def encode_marked(self, text: str, control_ranges: Sequence[tuple[int, int]]) -> list[int]:
        """`text` with exactly `control_ranges` (ascending [start, end) offsets, each one control token's
        spelling) read as control tokens and everything else as text, in ONE encode: the template's tokens split
        the text where `encode` splits it, so a prompt whose other text spells no control token gets `encode`'s
        ids, and merges and a Metaspace prefix fall as they would there."""
        guard = self._guard
        parts: list[str] = []
        pos = 0
        for start, end in control_ranges:
            parts += [text[pos:start], guard.spelling[text[start:end]]]
            pos = end
        parts.append(text[pos:])
        ids = guard.tk.encode("".join(parts), add_special_tokens=False).ids
        return [guard.original.get(i, i) for i in ids]

    @cached_property
    def _guard(self) -> _Guard:
        return _Guard.of(self.tk, self.special_ids)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a special token's are its text; skipping it is the caller's choice);
        b"" for ids outside the vocabulary (an engine's logits may be padded past it)."""
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def token_id(self, text: str) -> int | None:
        return self.tk.token_to_id(text)


@dataclass(frozen=True)
class _Guard:
    """The tokenizer with each control token respelled as a sentinel no text contains (private-use characters
    around a per-process random number): text spelling `<|im_end|>` is then plain BPE, and a sentinel put where
    the template wrote a control token is matched as an added token at the same place, with the same
    lstrip/rstrip, as the original spelling. Rebuilt, the added tokens get ids anew (sentinels and any added token
    outside the model's vocabulary, past it, in order); `original` maps each back to the id it has in `tk`."""

    tk: tokenizers.Tokenizer
    spelling: dict[str, str]  # control text -> its sentinel
    original: dict[int, int]  # added token's id here -> its id in the original

    @classmethod
    def of(cls, tk: tokenizers.Tokenizer, special_ids: frozenset[int]) -> _Guard:
        data = orjson.loads(tk.to_str())
        nonce = secrets.randbelow(10**12)
        spelling: dict[str, str] = {}
        for token in data["added_tokens"]:
            if token["id"] in special_ids:
                sentinel = f"\ue000{nonce}.{token['id']}\ue001"
                spelling[token["content"]] = sentinel
                token["content"] = sentinel
        guarded = tokenizers.Tokenizer.from_str(orjson.dumps(data).decode())
        original = {guarded.token_to_id(t["content"]): t["id"] for t in data["added_tokens"]}
        assert None not in original, "every added token is one of the guarded tokenizer"
        return cls(guarded, spelling, original)


def load_tokenizer(files: ModelFiles) -> Tokenizer:
    if files.format == "gguf":
        return _from_gguf(gguf_metadata(files.path))
    return _from_hf(files.path)


# --- byte tables -----------------------------------------------------------------------------------------------


@cache
def _byte_alphabet() -> tuple[dict[int, int], re.Pattern[str]]:
    """GPT-2's byte-level alphabet: each of the 256 bytes is drawn as one printable unicode char. Returns a
    str.translate table (char -> the byte's latin-1 char) and a pattern matching strings of alphabet chars."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shown = {b: b for b in printable}
    for b in range(256):
        if b not in shown:
            shown[b] = 256 + len(shown) - len(printable)
    table = {char: b for b, char in shown.items()}
    alphabet = "".join(re.escape(chr(c)) for c in table)
    return table, re.compile(f"[{alphabet}]*")


def _byte_level_bytes(piece: str) -> bytes:
    table, alphabet = _byte_alphabet()
    if alphabet.fullmatch(piece):
        return piece.translate(table).encode("latin-1")
    return piece.encode("utf-8")  # not in the byte alphabet: an added token spelled as plain text


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _metaspace_bytes(piece: str) -> bytes:
    """SentencePiece-style vocabularies: "▁" is a space, "<0xNN>" a raw byte (byte fallback)."""
    m = _BYTE_FALLBACK.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("▁", " ").encode("utf-8")


def _byte_table(tk: tokenizers.Tokenizer, to_bytes: Callable[[str], bytes]) -> tuple[bytes, ...]:
    added = {i: t.content for i, t in tk.get_added_tokens_decoder().items()}
    table = [b""] * tk.get_vocab_size(with_added_tokens=True)
    for piece, i in tk.get_vocab(with_added_tokens=True).items():
        # added tokens are stored as their literal text, vocabulary pieces in the model's alphabet
        table[i] = added[i].encode("utf-8") if i in added else to_bytes(piece)
    return tuple(table)


def _decoder_kind(tokenizer_json: dict[str, Any]) -> Callable[[str], bytes]:
    decoder = tokenizer_json.get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) if isinstance(d, dict)]
    if "ByteLevel" in kinds:
        return _byte_level_bytes
    if "Metaspace" in kinds or "ByteFallback" in kinds or "Replace" in kinds:
        return _metaspace_bytes
    raise UnsupportedTokenizer(f"unsupported tokenizer decoder {kinds}")


# --- GGUF ------------------------------------------------------------------------------------------------------

# Pre-tokenizers by `tokenizer.ggml.pre`, as llama.cpp names them (llama-vocab.cpp), in HF terms.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _byte_level(regex: str | None) -> pre_tokenizers.PreTokenizer:
    if regex is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level(None)]
    ),
    "gpt2": lambda: _byte_level(None),
    "default": lambda: _byte_level(None),
    "llama-bpe": lambda: _byte_level(_LLAMA3_REGEX),
    "llama3": lambda: _byte_level(_LLAMA3_REGEX),
}


def _from_gguf(meta: dict[str, Any]) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedTokenizer(f"GGUF tokenizer model {model!r}: only byte-level BPE ('gpt2') is supported")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizer(f"GGUF pre-tokenizer {pre!r}: known ones are {sorted(PRE_TOKENIZERS)}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tk = tokenizers.Tokenizer(bpe)
    tk.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tk.decoder = decoders.ByteLevel()
    control = [i for i, t in enumerate(types) if t == _CONTROL]
    user = [i for i, t in enumerate(types) if t == _USER_DEFINED]
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    special = frozenset(control)

    eos = {meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if isinstance(meta.get(k), int)}
    eos |= {i for i in control if tokens[i] in _EOG_TEXTS}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(
        tk=tk,
        bos_id=bos if isinstance(bos, int) else None,
        eos_ids=frozenset(eos),
        special_ids=special,
        _bytes=_byte_table(tk, _byte_level_bytes),
    )


# --- HF checkpoint ---------------------------------------------------------------------------------------------


def ids_of(value: Any) -> set[int]:
    """Token ids as config files spell them: one int or a list (anything else: none)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _from_hf(root: Path) -> Tokenizer:
    path = root / "tokenizer.json"
    if not path.exists():
        raise UnsupportedTokenizer(f"{root}: no tokenizer.json")
    tokenizer_json = orjson.loads(path.read_bytes())
    tk = tokenizers.Tokenizer.from_file(str(path))
    config = read_json(root / "config.json")
    generation = read_json(root / "generation_config.json")
    tok_config = read_json(root / "tokenizer_config.json")

    special = frozenset(i for i, t in tk.get_added_tokens_decoder().items() if t.special)
    eos = ids_of(generation.get("eos_token_id")) | ids_of(config.get("eos_token_id"))
    eos_text = token_content(tok_config.get("eos_token"))
    if eos_text and tk.token_to_id(eos_text) is not None:
        eos.add(tk.token_to_id(eos_text))
    bos_text = token_content(tok_config.get("bos_token"))
    bos = tk.token_to_id(bos_text) if bos_text else None
    if bos is None:
        bos = next(iter(ids_of(config.get("bos_token_id"))), None)
    return Tokenizer(
        tk=tk,
        bos_id=bos,
        eos_ids=frozenset(eos),
        special_ids=special,
        _bytes=_byte_table(tk, _decoder_kind(tokenizer_json)),
    )
