"""`--nats-url`: one NATS server, or the members of a NATS cluster separated by commas. Apart from shared/bus.py
so that the CLI checks it without importing nats (`deepinfer --help` answers at once)."""

from __future__ import annotations

URL_SCHEMES = ("nats://", "tls://", "ws://", "wss://")


def server_urls(url: str) -> list[str]:
    """`--nats-url` as nats-py's server list: one URL, or several separated by commas (the members of a NATS
    cluster; the client picks one and moves to another when it fails)."""
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise ValueError("--nats-url names no server")
    for one in urls:
        if not one.startswith(URL_SCHEMES):
            raise ValueError(f"--nats-url must be nats:// URLs separated by commas, got {one!r}")
    return urls
