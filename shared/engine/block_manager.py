"""Which KV blocks are in use, by how many sequences, and which hold a reusable prefix.

A block is in exactly one of three states:

    in use     ref > 0, in some sequence's block table (shared when ref > 1, only ever for full prefix blocks)
    cached     ref == 0, on the free list, still indexed by its chained hash: a later request with the same
               prefix takes it back without recomputing
    empty      ref == 0, on the free list, no hash

The free list is LRU-ordered: freed blocks go to the tail and allocation takes from the head, so cached
prefixes survive as long as possible before being overwritten. Expected outcomes (no room) are return values,
never exceptions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

# what a prefix index outside the engine hears: ("stored" | "removed", chained hashes), in the order it happened
BlockListener = Callable[[str, list[bytes]], None]


class BlockManager:
    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"need at least one KV block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.listener: BlockListener | None = None  # told when a hash becomes findable here, or stops being

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def allocate(self, n: int) -> list[int] | None:
        """`n` private blocks, or None (nothing taken) when fewer than `n` are free."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._forget(block)  # its cached prefix (if any) is about to be overwritten
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend `table` in place to cover `num_tokens` tokens; False (table unchanged) when out of blocks."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        blocks = self.allocate(need)
        if blocks is None:
            return False
        table.extend(blocks)
        return True

    def free(self, blocks: list[int]) -> None:
        # Reversed so a sequence's last (least shareable) blocks are overwritten first.
        for block in reversed(blocks):
            assert self._ref[block] > 0, f"double free of block {block}"
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    def match(self, hashes: list[bytes]) -> list[int]:
        """Take a reference on the longest run of cached blocks for `hashes` (a chained prefix)."""
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
            blocks.append(block)
        return blocks

    def cached_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` are cached here (no references taken)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._by_hash:
            n += 1
        return n

    def publish(self, block: int, h: bytes) -> None:
        """Make a full, computed block findable by its chained hash. First writer wins on duplicates."""
        assert self._ref[block] > 0
        if self._hash[block] is None and h not in self._by_hash:
            self._hash[block] = h
            self._by_hash[h] = block
            if self.listener is not None:
                self.listener("stored", [h])

    def cached_hashes(self) -> list[bytes]:
        """Every hash findable here now (a snapshot for a prefix index that lost track)."""
        return list(self._by_hash)

    def drop_cached(self) -> None:
        """Forget every cached prefix no sequence holds (a warm-up's blocks: nobody else will ask for them)."""
        for block in self._free:
            self._forget(block)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def _forget(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            del self._by_hash[h]
            self._hash[block] = None
            if self.listener is not None:
                self.listener("removed", [h])
