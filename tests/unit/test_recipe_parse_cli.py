"""`python -m services.recipe parse`: request + generated output on stdin, the complete response on stdout."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

import pytest

from services.recipe.cli_parse import main
from shared.deepseek_tokenizer import load_deepseek_tokenizer

CHAT = {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
OUTPUT = ('Let me see.</think>Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
          '<｜DSML｜parameter name="home city" string="true">Paris</｜DSML｜parameter>\n'
          "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


def run(stdin: Any, *args: str) -> tuple[int, dict[str, Any]]:
    out = io.BytesIO()
    raw = stdin if isinstance(stdin, bytes) else json.dumps(stdin).encode()
    code = main(list(args), stdin=io.BytesIO(raw), stdout=out)
    return code, json.loads(out.getvalue())


def _converts(api: str, body: dict[str, Any]) -> bool:
    from services.recipe.convert import convert

    try:
        convert(api, body)
    except NotImplementedError:
        return False
    return True


def test_chat_text_output_gives_the_complete_response() -> None:
    code, body = run({"request": CHAT, "output": OUTPUT, "prompt_tokens": 20, "cached_tokens": 5},
                     "--api", "chat", "--encoding", "v4")
    assert code == 0
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")  # non-streaming shape
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure." and choice["message"]["reasoning_content"] == "Let me see."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"home city": "Paris"}
    tokens = len(load_deepseek_tokenizer().encode(OUTPUT))
    assert body["usage"]["completion_tokens"] == tokens and body["usage"]["prompt_cache_hit_tokens"] == 5


def test_output_ids_with_a_finish_reason() -> None:
    ids = load_deepseek_tokenizer().encode("Reasoning.</think>The answer is 42")
    code, body = run({"request": dict(CHAT, tools=[]), "output_ids": ids, "finish_reason": "length"},
                     "--api", "chat", "--encoding", "v4")
    assert code == 0
    assert body["choices"][0]["message"]["content"] == "The answer is 42"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize("stdin, message", [
    (b"not json", "stdin is not valid JSON"),
    ({"output": "x"}, "expected"),
    ({"request": CHAT, "output": "x", "output_ids": [1]}, "exactly one"),
    ({"request": CHAT, "output_ids": [1, "2"]}, "array of integers"),
    ({"request": CHAT, "output": "x", "finish_reason": "tired"}, "finish_reason"),
    ({"request": {"model": "DeepSeek-V4-Pro"}, "output": "x"}, "messages"),
])
def test_bad_input_is_an_error_body_and_exit_1(stdin: Any, message: str) -> None:
    code, body = run(stdin, "--api", "chat", "--encoding", "v4")
    assert code == 1 and message in body["error"]["message"]


def test_messages_errors_are_anthropic_shaped() -> None:
    code, body = run(b"{", "--api", "messages", "--encoding", "v4")
    assert code == 1 and body["type"] == "error" and "stdin" in body["error"]["message"]


@pytest.mark.parametrize("api, request_body, shape", [
    ("messages", {"model": "DeepSeek-V4-Pro", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]},
     "message"),
    ("responses", {"model": "DeepSeek-V4-Pro", "input": "hi"}, "response"),
])
def test_other_apis(api: str, request_body: dict[str, Any], shape: str) -> None:
    if not _converts(api, request_body):
        pytest.skip(f"the input side's {api} conversion is not there yet")
    code, body = run({"request": request_body, "output": "Hmm.</think>Hello"}, "--api", api, "--encoding", "v4")
    assert code == 0 and (body.get("type") or body.get("object")) == shape


def test_module_entry_point_starts_without_torch() -> None:
    probe = ("import io, sys, services.recipe.cli_parse as c; "
             "assert 'torch' not in sys.modules and 'services.recipe.service' not in sys.modules; "
             "print(c.main(['--api', 'chat', '--encoding', 'v4'], stdin=io.BytesIO(b'{}'), stdout=io.BytesIO()))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"
