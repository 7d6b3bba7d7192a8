"""Gateway settings, built once from CLI flags (the API key and the client timeouts may come from the environment).
The fields are the flags (shared/config.py `option`); `deepinfer up` takes its defaults from here."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.config import add_flags, from_args, option

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    host: str = option("127.0.0.1")
    port: int = option(8000)  # 0 = any free port (tests); the bound one is `GatewayService.port`
    api_key: str | None = option(  # None = no authentication
        None, env=True,
        help="require this key from clients (Authorization: Bearer or x-api-key); env DEEPINFER_API_KEY")
    # for the recipe's PrepareReply (tokenizing a long prompt takes a while)
    request_timeout_s: float = option(30.0, help="seconds to wait for the recipe")
    event_timeout_s: float = option(300.0, help="max seconds between events")  # longest silence within a request
    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES)
    # client connections (protocol.py): idle between requests (or before the first), from a request's first byte
    # to its last header, and for the whole body: a slow or silent client cannot hold a connection for ever
    client_idle_timeout_s: float = option(
        75.0, env=True, help="seconds a client connection may stay open with no request (before the first or "
        "between two); then it is closed")
    client_header_timeout_s: float = option(
        30.0, env=True, help="seconds from a request's first byte to its last header; then the connection is closed")
    client_body_timeout_s: float = option(
        120.0, env=True, help="seconds to read a request's whole body; then a 408 in the API's error JSON")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0..65535, got {self.port}")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty (leave it out to disable authentication)")
        timeouts = (self.request_timeout_s, self.event_timeout_s, self.client_idle_timeout_s,
                    self.client_header_timeout_s, self.client_body_timeout_s)
        if min(timeouts) <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_body_bytes <= 0:
            raise ValueError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")


def add_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, GatewayConfig)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return from_args(GatewayConfig, args)
