"""Shared fixtures: a real, isolated nats-server per test module on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared import natsserver


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[natsserver.NatsServer]:
    state = tmp_path_factory.mktemp("nats")
    server = natsserver.start(state, log_file=state / "nats.log")
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: natsserver.NatsServer) -> str:
    return nats_server.url
