"""The recipe's text pieces for chat-template models: template rendering, incremental detokenization."""

from __future__ import annotations

import random

import pytest

from services.recipe.chat_template import ChatTemplate
from services.recipe.errors import TemplateError
from services.recipe.parse.detok import TokenPieces, TokenTable
from shared.model_info import load_model_info
from shared.models import resolve
from shared.tokenizer import Tokenizer, load_tokenizer

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return load_tokenizer(resolve())


@pytest.fixture(scope="module")
def smol_template() -> ChatTemplate:
    info = load_model_info(resolve())
    assert info.chat_template is not None
    return ChatTemplate(info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token)


# --- chat template -------------------------------------------------------------------------------------------


def test_smollm2_template_adds_default_system_prompt(smol_template: ChatTemplate) -> None:
    text = smol_template.render([{"role": "user", "content": "Hi"}])
    assert text == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_template_keeps_given_system_prompt(smol_template: ChatTemplate) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = smol_template.render(messages, add_generation_prompt=False)
    assert SMOL_SYSTEM not in text
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    )


def test_continue_final_message_leaves_the_turn_open(smol_template: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    assert smol_template.render(messages, continue_final_message=True).endswith("<|im_start|>assistant\n1, 2,")


def test_hf_environment_helpers() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m | tojson }}{% endfor %}{% generation %}[{{ strftime_now('%Y') | length }}]"
        "{% endgeneration %}",
        bos_token="<s>",
    )
    assert template.render([{"role": "user", "content": "café"}]) == '<s>{"role": "user", "content": "café"}[4]'
    with pytest.raises(TemplateError, match="no tools"):
        template.render([{"role": "tool", "content": "x"}])


def test_trim_and_lstrip_blocks() -> None:
    template = ChatTemplate(
        "{% for m in messages %}\n    {% if true %}\n{{ m['content'] }}\n    {% endif %}\n{% endfor %}"
    )
    assert template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"


def test_sandbox_refuses_unsafe_access() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}{{ messages.append(1) }}")
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "x"}])


# --- detokenizer (parse/detok.py, as chat-template models use it) ----------------------------------------------


def _splits_a_character(smol: Tokenizer, ids: list[int]) -> bool:
    try:
        [smol.token_bytes(i).decode("utf-8") for i in ids]
    except UnicodeDecodeError:
        return True
    return False


@pytest.fixture(scope="module")
def smol_table(smol: Tokenizer) -> TokenTable:
    return TokenTable.from_tokenizer(smol)


def _text(pieces: list) -> str:
    return "".join(p if isinstance(p, str) else p[1] for p in pieces)


@pytest.mark.parametrize("text", ["🙂👍🏽 family: 👨‍👩‍👧", "你好，世界！日本語のテキスト", "mixed é ß Ω 𝄞 ∮ ⟨ψ⟩ ꙮ 123"])
def test_detokenizer_never_emits_half_a_character(smol: Tokenizer, smol_table: TokenTable, text: str) -> None:
    ids = smol.encode(text)
    assert _splits_a_character(smol, ids)  # the case under test: characters spread over several tokens
    detok = TokenPieces(smol_table, skip_special=True)
    pieces = [_text(detok.feed([i])) for i in ids] + [_text(detok.flush())]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == smol.decode(ids) == text


def test_detokenizer_skips_special_tokens_and_flushes_broken_tail(smol: Tokenizer, smol_table: TokenTable) -> None:
    ids = smol.encode("<|im_start|>Hi 🙂<|im_end|>")
    detok = TokenPieces(smol_table, skip_special=True)
    assert "".join(_text(detok.feed([i])) for i in ids) + _text(detok.flush()) == "Hi 🙂"
    emoji = smol.encode("🙂")
    detok = TokenPieces(smol_table, skip_special=True)
    assert _text(detok.feed(emoji[:1])) == ""
    assert _text(detok.flush()) == "\ufffd"  # generation ended mid-character, as a full decode shows it


def test_detokenizer_matches_full_decode_on_random_tokens(smol: Tokenizer, smol_table: TokenTable) -> None:
    rng = random.Random(7)
    ids = [rng.randrange(17, smol.vocab_size) for _ in range(400)]
    detok = TokenPieces(smol_table, skip_special=True)
    assert "".join(_text(detok.feed([i])) for i in ids) + _text(detok.flush()) == smol.decode(ids)
