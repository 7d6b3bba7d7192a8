"""Which device the engine runs on when nobody says: the GPU where torch sees one, else the CPU."""

from __future__ import annotations

import os

import torch


def default_device() -> str:
    """`DEEPINFER_DEVICE` if set, else "cuda" when available, else "cpu"."""
    return os.environ.get("DEEPINFER_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
