"""A loaded engine's KV as bytes, to and from the kvcache service: export a held request's blocks, put them
(long-term, by hash) with a short-term snapshot of its end, fetch the leading run of a prompt's blocks.

The bytes go straight from the engine into the KV client's buffers (an arena slot on one host) on the engine
thread, one engine call per run of blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.async_engine import AsyncEngine
from shared.worker import short_term
from shared.worker.kvclient import KvClient

STATE_PART_OVERHEAD = 64 * 1024  # room for the key, msgpack framing and trace headers around one state part


@dataclass(frozen=True)
class ExportedKv:
    """A request's KV as bytes: full blocks from block `start` on, the partial last block, the model's state."""

    start: int
    blocks: list[bytes]
    tail: bytes  # b"": the tokens end on a block boundary
    state: bytes  # b"": a model without per-request state


class KvTransfer:
    def __init__(self, engine: AsyncEngine, kv: KvClient, max_payload: int,
                 cancelled: Callable[[str], bool]) -> None:
        self.engine = engine
        self.kv = kv
        self.state_part_bytes = max_payload - STATE_PART_OVERHEAD  # the largest part of a snapshot one message carries
        self._cancelled = cancelled  # whether a Cancel ended the request: stop at the next stage

    async def fetch_blocks(self, hashes: list[bytes], local: int | None = None) -> list[bytes]:
        """The blobs of the leading run of `hashes` this worker can have: b"" for the blocks its engine's own
        prefix cache holds (no transfer; the engine checks again at admission), then the kvcache service's,
        up to the first one missing. `local`: that count, when the caller has just asked the engine."""
        local = await self.engine.cached_blocks(hashes) if local is None else min(local, len(hashes))
        return [b""] * local + await self.kv.get_run(hashes[local:])

    async def export_kv(self, request_id: str, tokens: int, start: int) -> ExportedKv:
        """A held request's KV of its first `tokens` (all computed) as bytes, full blocks from block `start` on."""
        full = tokens // self.engine.layout.block_tokens
        blocks = await self.engine.export_blocks(request_id, start, full) if full > start else []
        tail = await self._tail(request_id, tokens)
        return ExportedKv(start, blocks, tail, await self.engine.export_state(request_id))

    async def _tail(self, request_id: str, tokens: int) -> bytes:
        """The partial block past the last full one (b"" when `tokens` ends on a block boundary)."""
        block = self.engine.layout.block_tokens
        if not tokens % block:
            return b""
        (tail,) = await self.engine.export_blocks(request_id, tokens // block, tokens // block + 1)
        return tail

    async def store_kv(self, request_id: str, tokens: list[int], ns: bytes, hashes: list[bytes], stored: int,
                       exported: ExportedKv | None = None) -> bytes:
        """Put a held request's KV of `tokens` (all computed) in the kvcache service: its full blocks from block
        `stored` on (long-term, under `hashes`), and a snapshot at the end (short-term: the partial block and
        the model's state). `exported`: those bytes, exported already (from block `stored` or before; the
        request need not be held then). Returns the snapshot's key, b"" when there was nothing beyond full
        blocks, or when a cancel ended the request on the way (what was stored stays: it is valid KV for the
        next request)."""
        layout = self.engine.layout
        block = layout.block_tokens
        full = len(tokens) // block
        if full > stored and not self._cancelled(request_id):
            if exported is not None:  # the bytes a peer hand-over exported already: no second export
                assert exported.start <= stored
                await self.kv.put_many(list(zip(hashes[stored:full], exported.blocks[stored - exported.start :])))
            else:
                async def export(parts: list[tuple[int, int, memoryview]]) -> None:  # straight into the arena
                    await self.engine.export_into(request_id, stored, parts)

                await self.kv.put_run(hashes[stored:full], export, layout.block_bytes)
        if self._cancelled(request_id):
            return b""
        if exported is not None:
            tail, state = exported.tail, exported.state
        else:
            tail, state = await self._tail(request_id, len(tokens)), await self.engine.export_state(request_id)
        if (not tail and not state) or self._cancelled(request_id):
            return b""
        snap = short_term.Snapshot(len(tokens), tail, state)
        return await short_term.save(self.kv, tokens, ns, hashes, block, snap, self.state_part_bytes)


# --- short-term state through the kvcache service ----------------------------------------------------------------
#
#     key        ->  u32 n | blob[0 : P]          part 0, under the key the DecodeJob carries
#     key#1      ->  blob[P : 2P]
#     ...
#     key#(n-1)  ->  blob[(n-1)P :]               P = the bus's max payload - STATE_PART_OVERHEAD
