"""Recipe settings, built once from CLI flags with environment defaults (the fields are the flags:
shared/config.py `option`); `deepinfer up` takes its admission defaults from here."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.recipe.admission import AdmissionLimits
from services.recipe.images.fetch import FetchPolicy, fetch_policy
from shared.config import add_flags, from_args, option


@dataclass(frozen=True)
class RecipeConfig:
    request_ttl_s: float = option(
        600.0, env="DEEPINFER_RECIPE_TTL",
        help="seconds a request may go without a token event before it is failed (504) and its state dropped")
    stop_grace_s: float = option(
        5.0, env="DEEPINFER_RECIPE_STOP_GRACE", help="seconds to let requests in flight finish on shutdown")
    response_ttl_s: float = option(
        3600.0, env=True,
        help="seconds a Responses API response created with `store` is kept for previous_response_id and "
        "GET /v1/responses/{id} (shared by every recipe instance, kept across restarts)")
    allow_control_tokens_in_user_text: bool = option(
        False, env=True,
        help="chat-template models: read control tokens spelled in client text (<|im_end|>...) as control tokens, "
        "as vLLM does; unsafe (a user can forge turns). By default they are encoded as text")
    max_queued_requests: int = option(
        0, env=True,
        help="requests in flight per model (waiting or running) past which a new one gets a 429 with Retry-After; "
        "0 = unbounded")
    max_queued_tokens: int = option(
        0, env=True,
        help="prompt tokens in flight per model past which a new request gets a 429 with Retry-After; 0 = unbounded")
    max_migrations: int = option(
        2, env=True,
        help="times one request may resume on another worker, from the tokens it streamed, after losing its "
             "worker (exact: the stream goes on unchanged); past it the request ends with a 503. 0 = never")

    image_fetch_hosts: str = option(
        "", env=True,
        help="V4.1 image URLs: comma-separated host names the recipe may fetch images from ('*' = any host); "
             "empty (the default) = fetching off, only data URLs and base64 images are read (a recipe that "
             "fetches any URL a client names can be aimed at the mesh's own network)")
    image_fetch_max_bytes: int = option(
        32 * 1024 * 1024, env=True, help="V4.1 image URLs: the largest image body fetched, in bytes")
    image_fetch_timeout_s: float = option(
        60.0, env=True, help="V4.1 image URLs: seconds one fetch may take, connection to last byte")

    def __post_init__(self) -> None:
        if self.response_ttl_s <= 0:
            raise ValueError(f"--response-ttl must be positive, got {self.response_ttl_s}")
        self.admission()  # raises on negatives
        self.fetch_policy()  # raises on non-positive limits

    def fetch_policy(self) -> FetchPolicy:
        return fetch_policy(self.image_fetch_hosts, self.image_fetch_max_bytes, self.image_fetch_timeout_s)

    def admission(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_queued_requests, self.max_queued_tokens)


def add_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, RecipeConfig)


def recipe_config(args: argparse.Namespace) -> RecipeConfig:
    return from_args(RecipeConfig, args)
