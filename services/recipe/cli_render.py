"""`python -m services.recipe render`: an API request on stdin -> its prompt and token ids on stdout.

    echo '{"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "hi"}]}' \\
      | python -m services.recipe render --api chat --encoding v4
    {"prompt": "<｜begin▁of▁sentence｜>...<｜Assistant｜><think>", "token_ids": [0, ...]}

--encoding v4 | v41 renders the converted request in that DeepSeek format (V4.1 has no tokenizer: token_ids
is null); any other value is a model (what `shared.models.resolve` accepts), rendered as the recipe serves it:
a DeepSeek-V4 checkpoint in the V4 format with its tokenizer (see services/recipe/model.py), any other model
with its chat template and tokenizer (the request must name it: its file or directory name). A refused request
prints the API's own error body and exits 1. Imports stay lazy: no torch, and no model machinery unless a model
is named, so a render takes well under a second.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

import orjson

from services.recipe.convert import APIS, ConvertOptions, convert
from services.recipe.convert.options import DEEPSEEK_MODELS
from services.recipe.errors import ConversionError, api_error


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.recipe render", description=__doc__.split("\n")[0])
    parser.add_argument("--api", required=True, choices=APIS)
    parser.add_argument("--encoding", required=True, help="v4, v41, or a model (name, .gguf file, HF directory)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["render"]:
        argv = argv[1:]
    args = _args(argv)
    body = sys.stdin.buffer.read()
    try:
        result = render_request(args.api, args.encoding, body)
    except ConversionError as exc:
        sys.stdout.buffer.write(api_error(args.api, exc).body + b"\n")
        return 1
    sys.stdout.buffer.write(orjson.dumps(result) + b"\n")
    return 0


def render_request(api: str, encoding: str, body: bytes) -> dict[str, Any]:
    """{"prompt", "token_ids"} for one request; raises ConversionError as the service would refuse it."""
    from services.recipe.formats import render  # tokenizers load here, after the request passed conversion

    if encoding in ("v4", "v41"):
        prepared = replace(convert(api, body, ConvertOptions(models=DEEPSEEK_MODELS)), encoding=encoding)
        prompt, ids = render(prepared)
    else:
        from services.recipe.model import ServedModel

        model = ServedModel.load(encoding, lazy=True)  # a V4 prompt needs only the encoder, not the detokenizer
        prepared = convert(api, body, ConvertOptions(models={model.name: model.encoding}))
        prompt, ids = render(prepared, model)
    return {"prompt": prompt, "token_ids": ids}


if __name__ == "__main__":
    raise SystemExit(main())
