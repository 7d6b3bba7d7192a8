"""Gateway settings, built once from CLI flags (the API key may come from the environment)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (tests); the bound one is `GatewayService.port`
    api_key: str | None = None  # None = no authentication
    request_timeout_s: float = 30.0  # for the recipe's PrepareReply (tokenizing a long prompt takes a while)
    event_timeout_s: float = 300.0  # longest silence between two events of one request
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # client connections (protocol.py): idle between requests (or before the first), from a request's first byte
    # to its last header, and for the whole body: a slow or silent client cannot hold a connection for ever
    client_idle_timeout_s: float = 75.0
    client_header_timeout_s: float = 30.0
    client_body_timeout_s: float = 120.0

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
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("DEEPINFER_API_KEY") or None,
        help="require this key from clients (Authorization: Bearer or x-api-key); env DEEPINFER_API_KEY",
    )
    parser.add_argument("--request-timeout", type=float, default=30.0, help="seconds to wait for the recipe")
    parser.add_argument("--event-timeout", type=float, default=300.0, help="max seconds between events")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    env = os.environ.get
    parser.add_argument("--client-idle-timeout", type=float, default=float(env("DEEPINFER_CLIENT_IDLE_TIMEOUT", "75")),
                        help="seconds a client connection may stay open with no request (before the first or "
                        "between two); then it is closed")
    parser.add_argument("--client-header-timeout", type=float,
                        default=float(env("DEEPINFER_CLIENT_HEADER_TIMEOUT", "30")),
                        help="seconds from a request's first byte to its last header; then the connection is closed")
    parser.add_argument("--client-body-timeout", type=float, default=float(env("DEEPINFER_CLIENT_BODY_TIMEOUT", "120")),
                        help="seconds to read a request's whole body; then a 408 in the API's error JSON")


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout,
        event_timeout_s=args.event_timeout,
        max_body_bytes=args.max_body_bytes,
        client_idle_timeout_s=args.client_idle_timeout,
        client_header_timeout_s=args.client_header_timeout,
        client_body_timeout_s=args.client_body_timeout,
    )
