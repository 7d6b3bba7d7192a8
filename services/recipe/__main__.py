"""`python -m services.recipe`: the token codec between the gateway and the engine workers."""

from __future__ import annotations

import argparse
import os

from services.recipe.service import RecipeService
from shared.config import ServiceConfig
from shared.service import main


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


def build(config: ServiceConfig, args: argparse.Namespace) -> RecipeService:
    # --model may list several models, comma-separated; each is served under its ModelFiles.name.
    specs = [s.strip() for s in config.model.split(",") if s.strip()]
    return RecipeService(specs, ttl_s=args.request_ttl, stop_grace_s=args.stop_grace)


if __name__ == "__main__":
    main("recipe", build, add_args)
