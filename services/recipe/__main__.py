"""`python -m services.recipe`: the token codec between the gateway and the engine workers.

Two offline commands share the entry point (they start fast: no service, no NATS):
    python -m services.recipe render --api chat|responses|messages --encoding v4|v41|MODEL  < request.json
    python -m services.recipe parse  --api chat|responses|messages --encoding v4|v41|MODEL  < {"request", "output"}
"""

from __future__ import annotations

import argparse
import os
import sys

if sys.argv[1:2] == ["render"]:
    from services.recipe.cli_render import main as render

    sys.exit(render(sys.argv[2:]))
if sys.argv[1:2] == ["parse"]:
    from services.recipe.cli_parse import main as parse

    sys.exit(parse(sys.argv[2:]))

from services.recipe.admission import AdmissionLimits  # noqa: E402 - the commands above must not pay for it
from services.recipe.service import RecipeService  # noqa: E402
from shared.config import ServiceConfig  # noqa: E402
from shared.service import main  # noqa: E402


def add_args(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--request-ttl", type=float, default=float(env("DEEPINFER_RECIPE_TTL", "600")),
        help="seconds a request may go without a token event before it is failed (504) and its state dropped",
    )
    parser.add_argument(
        "--stop-grace", type=float, default=float(env("DEEPINFER_RECIPE_STOP_GRACE", "5")),
        help="seconds to let requests in flight finish on shutdown",
    )
    parser.add_argument(
        "--response-ttl", type=float, default=float(env("DEEPINFER_RESPONSE_TTL", "3600")),
        help="seconds a Responses API response created with `store` is kept for previous_response_id and "
        "GET /v1/responses/{id} (shared by every recipe instance, kept across restarts)",
    )
    parser.add_argument(
        "--allow-control-tokens-in-user-text", action="store_true",
        default=env("DEEPINFER_ALLOW_CONTROL_TOKENS_IN_USER_TEXT", "") == "1",
        help="chat-template models: read control tokens spelled in client text (<|im_end|>...) as control tokens, "
        "as vLLM does; unsafe (a user can forge turns). By default they are encoded as text",
    )
    parser.add_argument(
        "--max-migrations", type=int, default=int(env("DEEPINFER_MAX_MIGRATIONS", "2")),
        help="times one request may resume on another worker, from the tokens it streamed, after losing its "
        "worker (exact: the stream goes on unchanged); past it the request ends with a 503. 0 = never",
    )
    parser.add_argument(
        "--max-queued-requests", type=int, default=int(env("DEEPINFER_MAX_QUEUED_REQUESTS", "0")),
        help="requests in flight per model (waiting or running) past which a new one gets a 429 with Retry-After; "
        "0 = unbounded",
    )
    parser.add_argument(
        "--max-queued-tokens", type=int, default=int(env("DEEPINFER_MAX_QUEUED_TOKENS", "0")),
        help="prompt tokens in flight per model past which a new request gets a 429 with Retry-After; "
        "0 = unbounded",
    )


def build(config: ServiceConfig, args: argparse.Namespace) -> RecipeService:
    # --model may list several models, comma-separated; each is served under its ModelFiles.name.
    specs = [s.strip() for s in config.model.split(",") if s.strip()]
    if args.response_ttl <= 0:
        raise ValueError(f"--response-ttl must be positive, got {args.response_ttl}")
    admission = AdmissionLimits(args.max_queued_requests, args.max_queued_tokens)  # raises on negatives
    return RecipeService(specs, ttl_s=args.request_ttl, stop_grace_s=args.stop_grace, response_ttl_s=args.response_ttl,
                         served_names=config.served_model_names, max_model_len=config.max_model_len,
                         trust_client_control_tokens=args.allow_control_tokens_in_user_text, admission=admission,
                         max_migrations=args.max_migrations)


if __name__ == "__main__":
    main("recipe", build, add_args)
