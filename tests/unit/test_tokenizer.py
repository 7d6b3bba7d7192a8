"""shared.tokenizer and shared.model_info on the packaged SmolLM2 GGUF, a tiny handmade GGUF and an HF dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import orjson
import pytest

from shared import model_info
from shared.model_info import gguf_metadata, load_model_info
from shared.models import ModelFiles, resolve
from shared.tokenizer import Tokenizer, UnsupportedTokenizer, load_tokenizer

TEXTS = [
    "What is the capital of France?",
    "  leading spaces, trailing\n\n\ttabs\t ",
    "numbers 1234567 and 3.14159",
    "unicode: 你好，世界 — naïve café 🙂👍🏽 Ω≈ç√",
    "code: def f(x):\n    return x**2  # square\n",
    "",
]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return load_tokenizer(resolve())


def test_smollm2_special_ids_and_eos(smol: Tokenizer) -> None:
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("<|im_end|>") == [2]
    assert smol.bos_id == 1
    assert 2 in smol.eos_ids and 0 in smol.eos_ids  # <|im_end|> and <|endoftext|>
    assert smol.vocab_size == 49152
    assert smol.is_special(1) and not smol.is_special(4093)


def test_smollm2_known_prompt_ids(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    assert ids == [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]


def test_digits_split_individually(smol: Tokenizer) -> None:
    ids = smol.encode("2024")
    assert len(ids) == 4
    assert [smol.decode([i]) for i in ids] == ["2", "0", "2", "4"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_token_bytes(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    assert smol.decode(ids) == text
    assert b"".join(smol.token_bytes(i) for i in ids).decode("utf-8") == text


def test_decode_skips_special_tokens_unless_asked(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert smol.decode(ids) == "assistant\nHi"
    assert smol.decode(ids, skip_special=False) == "<|im_start|>assistant\nHi<|im_end|>"
    assert smol.token_bytes(2) == b"<|im_end|>"
    assert smol.token_bytes(10**6) == b""  # beyond the vocabulary: nothing, not an error


def test_loading_is_torch_free() -> None:
    """In a fresh interpreter: other tests in this session may have imported torch already."""
    code = (
        "import sys; from shared.models import resolve; from shared.tokenizer import load_tokenizer; "
        "import services.recipe.service; load_tokenizer(resolve()); print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_model_info_from_gguf() -> None:
    info = load_model_info(resolve())
    assert info.name == "SmolLM2-135M-Instruct"
    assert info.context_length == 8192
    assert info.chat_template and "<|im_start|>" in info.chat_template
    assert (info.bos_token, info.eos_token) == ("<|im_start|>", "<|im_end|>")


# --- a tiny handmade GGUF: tokenizer from metadata, and the metadata cache --------------------------------------

TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "Ġ", "ab", "Ġab", "1", "2"]
TINY_MERGES = ["a b", "Ġ ab"]


def _write_tiny_gguf(path: Path, pre: str = "smollm", context: int = 512) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(context)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(TINY_TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (len(TINY_TOKENS) - 3))
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gguf_tokenizer_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    reads = []
    real_read = model_info._read_gguf
    monkeypatch.setattr(model_info, "_read_gguf", lambda p: reads.append(p) or real_read(p))

    tok = load_tokenizer(ModelFiles("tiny", "gguf", path))
    assert tok.encode("<|im_start|>ab ab12") == [1, 7, 8, 9, 10]
    assert tok.decode([1, 7, 8, 9, 10]) == "ab ab12"
    assert tok.eos_ids == {0, 2}
    info = load_model_info(ModelFiles("tiny", "gguf", path))
    assert info.context_length == 512 and info.eos_token == "<|im_end|>"
    assert len(reads) == 1  # the second load came from the cache
    assert list((tmp_path / "cache").glob("gguf-*.json"))

    _write_tiny_gguf(path, context=1024)  # a changed file (size/mtime) is re-read
    assert load_model_info(ModelFiles("tiny", "gguf", path)).context_length == 1024
    assert len(reads) == 2
    assert gguf_metadata(path)["llama.context_length"] == 1024


def test_unknown_gguf_pre_tokenizer_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "odd.gguf"
    _write_tiny_gguf(path, pre="some-future-model")
    with pytest.raises(UnsupportedTokenizer, match="some-future-model"):
        load_tokenizer(ModelFiles("odd", "gguf", path))


# --- an HF checkpoint directory -----------------------------------------------------------------------------------


def test_hf_directory(tmp_path: Path, smol: Tokenizer) -> None:
    smol.tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_bytes(
        orjson.dumps({"model_type": "llama", "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2})
    )
    (tmp_path / "generation_config.json").write_bytes(orjson.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}],
        "model_max_length": 10**30,
    }))
    files = ModelFiles("hf-smol", "hf", tmp_path)
    tok = load_tokenizer(files)
    assert (tok.bos_id, tok.eos_ids) == (1, frozenset({0, 2}))
    for text in TEXTS:
        assert tok.encode(text) == smol.encode(text)
        assert b"".join(tok.token_bytes(i) for i in tok.encode(text)).decode() == text
    info = load_model_info(files)
    assert (info.context_length, info.chat_template) == (2048, "{{ messages[0]['content'] }}")
    assert (info.bos_token, info.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_token_bytes_agree_with_decode_for_every_token(smol: Tokenizer) -> None:
    mismatched = [
        i for i in range(smol.vocab_size)
        if not smol.is_special(i) and smol.token_bytes(i).decode("utf-8", "replace") != smol.decode([i])
    ]
    assert mismatched == []
