"""Shared fixtures: a real, isolated nats-server per test module on a free loopback port."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.launch import natsserver

# Without a GPU, Triton kernels run in Triton's interpreter. The flag must be set before anything imports
# triton (transformers and torch may do so during collection), so it is set here, first.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu are skipped where torch sees no CUDA device."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[natsserver.NatsServer]:
    state = tmp_path_factory.mktemp("nats")
    server = natsserver.start(state, log_file=state / "nats.log")
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: natsserver.NatsServer) -> str:
    return nats_server.url
