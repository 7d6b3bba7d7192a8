"""`python -m services.recipe`: the token codec between the gateway and the engine workers.

Two offline commands share the entry point (they start fast: no service, no NATS):
    python -m services.recipe render --api chat|responses|messages --encoding v4|v41|MODEL  < request.json
    python -m services.recipe parse  --api chat|responses|messages --encoding v4|v41|MODEL  < {"request", "output"}
"""

from __future__ import annotations

import argparse
import sys

if sys.argv[1:2] == ["render"]:
    from services.recipe.cli_render import main as render

    sys.exit(render(sys.argv[2:]))
if sys.argv[1:2] == ["parse"]:
    from services.recipe.cli_parse import main as parse

    sys.exit(parse(sys.argv[2:]))

from services.recipe.config import add_args, recipe_config  # noqa: E402 - the commands above must not pay for it
from services.recipe.service import RecipeService  # noqa: E402
from shared.config import ServiceConfig  # noqa: E402
from shared.service import main  # noqa: E402

__all__ = ["add_args", "build"]


def build(config: ServiceConfig, args: argparse.Namespace) -> RecipeService:
    # --model may list several models, comma-separated; each is served under its ModelFiles.name.
    specs = [s.strip() for s in config.model.split(",") if s.strip()]
    recipe = recipe_config(args)  # raises on a bad TTL or negative admission bounds
    return RecipeService(specs, ttl_s=recipe.request_ttl_s, stop_grace_s=recipe.stop_grace_s,
                         response_ttl_s=recipe.response_ttl_s, served_names=config.served_model_names,
                         max_model_len=config.max_model_len,
                         trust_client_control_tokens=recipe.allow_control_tokens_in_user_text,
                         admission=recipe.admission(), max_migrations=recipe.max_migrations,
                         image_fetch=recipe.fetch_policy())


if __name__ == "__main__":
    main("recipe", build, add_args)
