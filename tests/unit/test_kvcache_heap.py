"""The store's shared heap (services/kvcache/heap.py) and a reader's map of it (shared/kv_heap.py): the allocator
(alloc / free / reuse, merging, capacity, no fragmentation for one blob size), frees deferred while a view or a
read lease holds a blob (the RAM tier evicting, expiring, deleting or replacing a leased entry keeps its bytes
until the lease ends), leases ended by their reader or at their deadline only once no reader still holds a read
lock, and a reader's map checking the heap's token."""

from __future__ import annotations

import gc
import os
import random
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kvcache.heap import Heap, HeapPayloads, HeapRef
from services.kvcache.tiers.ram import ENTRY_OVERHEAD, RamTier
from shared.kv_arena import GRACE_S, HEADER
from shared.kv_heap import ALIGN, HeapMap, heap_path

KiB = 1024


@pytest.fixture
def heap():
    h = Heap(heap_path(f"test-heap-{random.getrandbits(32)}"), 64 * KiB)
    yield h
    h.close()


def _invariants(h: Heap, live: dict[int, int]) -> None:
    """Free extents sorted, merged (no two touching) and disjoint from the live blobs; all of it adds up."""
    free = h.extents()
    assert all(a + n < b for (a, n), (b, _) in zip(free, free[1:]))
    spans = sorted([*free, *((at, -(-n // ALIGN) * ALIGN or ALIGN) for at, n in live.items())])
    assert spans[0][0] == HEADER and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] == HEADER + h.capacity


def test_blobs_are_allocated_freed_merged_and_reused(heap: Heap) -> None:
    a, b, c = heap.alloc(1000), heap.alloc(ALIGN), heap.alloc(5000)
    assert None not in (a, b, c) and a == HEADER and b == a + 4 * ALIGN  # rounded up to ALIGN
    assert heap.alloc(heap.capacity) is None  # past the capacity
    heap.free(b)
    assert heap.alloc(2 * ALIGN) != b  # too big for the hole: from the free end
    heap.free(a)  # merges with b's hole
    assert heap.alloc(5 * ALIGN) == a
    _invariants(heap, {a: 5 * ALIGN, c: 5000, heap.extents()[0][0] - 2 * ALIGN: 2 * ALIGN})


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9000)), max_size=80))
def test_the_allocator_keeps_its_invariants(ops: list[tuple[bool, int]]) -> None:
    h = Heap(heap_path(f"test-heap-prop-{os.getpid()}"), 64 * KiB)
    try:
        live: dict[int, int] = {}
        for grow, n in ops:
            if grow or not live:
                at = h.alloc(n)
                assert (at is None) == (h.largest_free < -(-n // ALIGN) * ALIGN)  # fails only without a fit
                if at is not None:
                    live[at] = n
            else:
                at = sorted(live)[n % len(live)]
                del live[at]
                h.free(at)
            _invariants(h, live)
        for at in list(live):
            h.free(at)
        assert h.extents() == [(HEADER, h.capacity)]  # everything merged back into one extent
    finally:
        h.close()


def test_blobs_of_one_size_never_fragment_it(heap: Heap) -> None:
    """A model's KV blocks are all one size: whatever was freed, the next block fits while any room is left."""
    size = 3 * ALIGN
    rng = random.Random(7)
    live = list(iter(lambda: heap.alloc(size), None))
    assert len(live) == heap.capacity // size
    for _ in range(300):
        rng.shuffle(live)
        k = rng.randint(1, 8)
        for at in live[:k]:
            heap.free(at)
        live = live[k:]
        for _ in range(rng.randint(0, k)):
            at = heap.alloc(size)
            assert at is not None
            live.append(at)
    more = [heap.alloc(size) for _ in range(heap.free_bytes // size)]
    assert None not in more and heap.free_bytes < size


def test_a_free_while_held_waits_for_the_last_holder(heap: Heap) -> None:
    at = heap.alloc(1000)
    assert at is not None
    heap.write(at, b"x" * 1000)
    view = heap.pinned(at, 1000)
    heap.hold(at)  # and a read lease
    heap.free(at)
    assert heap.deferred == 1 and bytes(view) == b"x" * 1000 and heap.free_bytes == heap.capacity - 4 * ALIGN
    del view
    gc.collect()
    assert heap.deferred == 1  # the lease still holds it
    heap.unhold(at)
    assert heap.deferred == 0 and heap.held == 0 and heap.extents() == [(HEADER, heap.capacity)]


def _tier(heap: Heap, entries: int, size: int) -> tuple[RamTier, HeapPayloads]:
    payloads = HeapPayloads(heap)
    return RamTier(capacity_bytes=entries * (32 + size + ENTRY_OVERHEAD), payloads=payloads), payloads


def test_evicting_expiring_deleting_or_replacing_a_leased_entry_keeps_its_bytes_until_the_lease_ends(heap: Heap
                                                                                                       ) -> None:
    size = 4 * KiB
    ram, payloads = _tier(heap, 4, size)
    now = time.time()
    keys = [bytes([i]) * 32 for i in range(8)]
    for i, key in enumerate(keys[:4]):
        assert ram.put(key, bytes([i]) * size, now + 60 if i == 1 else 0.0, now)
    lease, refs = ram.lend(keys[:4], now, time.monotonic() + 30)
    assert lease and [r.length for r in refs] == [size] * 4
    reader = HeapMap.open(str(heap.path), heap.token)  # a worker's map, and its views under the lease
    assert reader is not None
    views = reader.lend([r.offset for r in refs], [r.length for r in refs], time.monotonic() + 30, lambda: None)
    assert views is not None
    ram.delete([keys[0]])  # deleted
    ram.sweep(now + 120)  # keys[1] expired
    ram.put(keys[2], b"\xee" * size, 0.0, now)  # a long-term key's content is its name: kept as it was
    ram.put(keys[3], b"\xdd" * size, now + 60, now)  # replaced (a short-term key is rewritten)
    for key in keys[4:]:
        ram.put(key, b"\xff" * size, 0.0, now)  # evictions for room
    assert [bytes(v) for v in views] == [bytes([i]) * size for i in range(4)]
    assert heap.deferred == 4  # every one of them gone from the tier (keys[2] evicted for room at last)
    del views
    assert payloads.release(lease) and not payloads.release(lease)
    gc.collect()
    assert heap.deferred == 0 and heap.held == 0  # freed now: only the tier's live entries take room
    assert heap.free_bytes == heap.capacity - ram.stats().entries * size
    assert all(e is not None and bytes(e[0]) == b"\xff" * size for e in ram.get(keys[4:], now))


def test_a_lease_ends_at_its_deadline_only_once_no_reader_holds_its_bytes(heap: Heap) -> None:
    size = 4 * KiB
    ram, payloads = _tier(heap, 2, size)
    now = time.time()
    key = b"k" * 32
    ram.put(key, b"a" * size, 0.0, now)
    deadline = time.monotonic() + 5
    lease, refs = ram.lend([key], now, deadline)
    reader = HeapMap.open(str(heap.path), heap.token)
    assert reader is not None
    ended: list[bool] = []
    views = reader.lend([r.offset for r in refs], [r.length for r in refs], deadline, lambda: ended.append(True))
    assert views is not None and bytes(views[0]) == b"a" * size
    ram.delete([key])
    assert payloads.expire(deadline + GRACE_S + 1) == 0  # past the deadline, but a reader still has it locked
    assert heap.deferred == 1 and not heap.probe(refs[0].offset)
    del views
    gc.collect()
    assert ended == [True] and reader.locks_held == 0
    assert payloads.expire(deadline + GRACE_S - 0.5) == 0  # not past the grace yet
    assert payloads.expire(deadline + GRACE_S + 1) == 1 and heap.deferred == 0 and payloads.leases == 0


def test_a_reader_maps_only_a_heap_with_its_token_and_refuses_an_ended_lease(heap: Heap) -> None:
    at = heap.alloc(100)
    assert at is not None
    heap.write(at, b"z" * 100)
    assert HeapMap.open(str(heap.path), os.urandom(16)) is None  # another heap's token (a restarted store)
    assert HeapMap.open("/etc/passwd", heap.token) is None  # only heaps
    reader = HeapMap.open(str(heap.path), heap.token)
    assert reader is not None and reader.names(str(heap.path), heap.token)
    assert reader.lend([at], [100], time.monotonic() - 0.01, lambda: None) is None  # the lease had ended
    assert reader.locks_held == 0 and heap.probe(at)
    assert reader.lend([heap.capacity + HEADER], [100], time.monotonic() + 5, lambda: None) is None  # outside
    views = reader.lend([at], [100], time.monotonic() + 5, lambda: None)
    assert views is not None and bytes(views[0]) == b"z" * 100 and views[0].readonly


def test_a_heap_ref_has_its_length() -> None:
    assert len(HeapRef(HEADER, 123)) == 123


def test_a_put_from_a_slot_copies_once_and_is_undone_when_the_slot_was_not_ours(heap: Heap, tmp_path: Path) -> None:
    """`put_hot_from` (a kv.put.shm): each blob copied once into the heap, the home write reading that copy; when
    the worker's slot was given up during the copy, no reader ever finds those copies."""
    from services.kvcache.store import KvStore
    from services.kvcache.tiers.lmdb import LmdbTier

    ram, _ = _tier(heap, 8, 4 * KiB)
    store = KvStore(ram=ram, short_term=LmdbTier(tmp_path / "lmdb", capacity_bytes=4 << 20, map_size=16 << 20),
                    max_ttl_s=60.0)
    slot = bytearray(b"a" * 4 * KiB + b"b" * 4 * KiB)
    views = [memoryview(slot)[: 4 * KiB], memoryview(slot)[4 * KiB :]]
    keys = [b"x" * 32, b"y" * 32]
    staged = store.put_hot_from(keys, views, 0.0, lambda: True)
    assert staged is not None and [e for e, _ in staged] == [0.0, 0.0]
    slot[:] = b"\xee" * len(slot)  # the slot is the worker's again: the copies must not change with it
    assert [bytes(b) for _, b in staged] == [b"a" * 4 * KiB, b"b" * 4 * KiB]
    assert all(isinstance(b, memoryview) for _, b in staged)  # the RAM copy itself, held while the home write runs
    assert all(store.put_home(k, b, e) for k, (e, b) in zip(keys, staged))
    del staged
    late = store.put_hot_from([b"z" * 32], [memoryview(slot)[: 4 * KiB]], 0.0, lambda: False)
    assert late is None and store.hot_run([b"z" * 32], 1 << 20, 1 << 20) == ([], True)
    run, _ = store.hot_run(keys, 1 << 20, 1 << 20)
    assert [bytes(b) for b in run] == [b"a" * 4 * KiB, b"b" * 4 * KiB]
    del run
    gc.collect()
    assert heap.held == 0 and heap.free_bytes == heap.capacity - 2 * 4 * KiB
    store.close()


def test_two_leases_of_one_reader_on_one_blob_keep_it_locked_until_both_views_go(heap: Heap) -> None:
    """Open-file-description locks do not nest: the reader counts its views per blob, so the first import to end
    does not unlock a blob another request of the same worker still reads."""
    at = heap.alloc(300)
    assert at is not None
    reader = HeapMap.open(str(heap.path), heap.token)
    assert reader is not None
    done: list[int] = []
    first = reader.lend([at], [300], time.monotonic() + 5, lambda: done.append(1))
    second = reader.lend([at], [300], time.monotonic() + 5, lambda: done.append(2))
    assert first is not None and second is not None and reader.locks_held == 1
    del first
    gc.collect()
    assert done == [1] and reader.locks_held == 1 and not heap.probe(at)
    del second
    gc.collect()
    assert done == [1, 2] and reader.locks_held == 0 and heap.probe(at)
