"""What the engine may ask of a model and its cache beyond CausalLM (models/__init__.py): each capability one
Protocol, checked once with isinstance where the engine is built, never probed attribute by attribute.

    Cache        every KV cache (KVCache: Llama's pages; V4Cache: compressed entries + per-request rings)
    HasOwnCache  a model with its own long-term layout makes its cache (DeepSeek-V4); others get KVCache pages
    Drafts       a model with an MTP layer drafts speculative tokens (speculative.py runs them)
    GraphsDecode a model with its own decode graphs (DeepSeek-V4: its cache's per-request state in the graph)
    CountsExperts a mixture of experts that counts its routing choices (DeepSeek-V4: for expert placement)
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


class Cache(Protocol):
    """Long-term blocks as bytes, short-term per-request state, and how far a request can be taken back."""

    backtrack: int  # tokens a request's state can be taken back by (rejected drafts); 0: none
    replay_tokens: int  # tokens recomputed before a prefix restored without its state (0: nothing to rebuild)

    @property
    def block_bytes(self) -> int: ...

    def read_blocks(self, blocks: list[int]) -> list[bytes]: ...

    def write_blocks(self, blocks: list[int], blobs: list[bytes]) -> None: ...

    def begin(self, request_id: str, restored: int) -> int: ...

    def export_state(self, request_id: str, length: int) -> bytes: ...

    def import_state(self, request_id: str, blob: bytes) -> None: ...

    def drop_state(self, request_id: str) -> None: ...


@runtime_checkable
class HasOwnCache(Protocol):
    # a Cache (the model's own class, e.g. V4Cache); kv_dtype: its storage dtype (kv_quant.kv_dtype)
    def make_cache(self, num_blocks: int, max_running: int, kv_dtype: Any = None) -> Any: ...


@runtime_checkable
class Drafts(Protocol):
    """mtp: the draft layer's weights, None when the checkpoint has none (then it cannot draft)."""

    mtp: Any

    def mtp_advance(self, kv: Any, request_id: str, start: int, streams: torch.Tensor, next_tokens: list[int]
                    ) -> torch.Tensor | None: ...

    def mtp_draft(self, kv: Any, request_id: str, out: torch.Tensor, position: int, k: int, floor: float = 0.0
                  ) -> tuple[list[int], list[float]]:
        """Up to k drafts and their probabilities, stopping before one below `floor`."""
        ...


class DecodeGraphRunner(Protocol):
    """Replays decode steps (one sampled token per sequence) from captured CUDA graphs."""

    hidden: torch.Tensor | None  # the last replay's hidden rows (S, ...) when it keeps them (V4: for MTP), a
    # view of the graph's output that the next replay overwrites

    def fits(self, chunks: list) -> bool: ...

    def run(self, chunks: list) -> torch.Tensor: ...  # (S, V) float32 logits

    def warm_up(self) -> int: ...  # capture every bucket now; how many were captured


@runtime_checkable
class GraphsDecode(Protocol):
    def decode_graphs(self, kv: Any, device: torch.device, max_tokens: int, sizes: tuple[int, ...],
                      fed: torch.Tensor) -> DecodeGraphRunner | None: ...  # None: this configuration cannot


@runtime_checkable
class CountsExperts(Protocol):
    """expert_counts (layers, experts) int64 on the model's device: token-expert pairs routed since load."""

    expert_counts: torch.Tensor

    @property
    def expert_bytes(self) -> int: ...  # one routed expert's weights as loaded


def drafter(model: object) -> Drafts | None:
    """The model as a drafter, if it has a draft layer."""
    return model if isinstance(model, Drafts) and model.mtp is not None else None
