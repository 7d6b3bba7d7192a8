"""The shared-memory arena (shared/kv_arena.py): slots lent and given back, retired after a timeout until their
deadline has passed, lent to views until the last is gone; dead owners' arenas found by their lock; the store's
side checking paths and tokens."""

from __future__ import annotations

import gc
import os

import numpy as np

from shared.kv_arena import GRACE_S, HEADER, Arena, ArenaMaps, arena_path, owner_alive, remove_stale


def test_slots_are_lent_given_back_and_retired_until_their_deadline(monkeypatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("shared.kv_arena.time.monotonic", lambda: now[0])
    arena = Arena(arena_path(f"unit-{os.getpid()}"), slots=2, slot_bytes=64)
    try:
        a, b = arena.take(), arena.take()
        assert {a, b} == {HEADER, HEADER + 64} and arena.take() is None  # both lent
        assert arena.write(a, [b"abc", b"de"]) == [3, 2] and arena.read(a, [3, 2]) == [b"abc", b"de"]
        arena.give(a)
        arena.lose(b, deadline=now[0] + 5)  # its request timed out: the store may write there until the deadline
        assert arena.take() == a and arena.take() is None and arena.lost == 1 and arena.lent_slots == 1
        now[0] += 5 + GRACE_S / 2
        assert arena.take() is None  # still inside the grace
        now[0] += GRACE_S
        assert arena.take() == b and arena.reclaimed == 1  # no late write can land there any more
    finally:
        arena.close()
    assert not arena.path.exists()


def test_a_slot_lent_to_views_comes_back_with_the_last_of_them() -> None:
    arena = Arena(arena_path(f"unit-lend-{os.getpid()}"), slots=1, slot_bytes=64)
    try:
        offset = arena.take()
        assert offset is not None
        arena.view(offset, 5)[:] = b"abcde"  # what an exporter writes, in place
        first, second = arena.lend(offset, [3, 2])
        assert bytes(first) == b"abc" and bytes(second) == b"de" and arena.free_slots == 0
        assert first.readonly and np.frombuffer(second, np.uint8).tolist() == [100, 101]
        del first
        gc.collect()
        assert arena.free_slots == 0  # `second` still reads the slot
        del second
        assert arena.free_slots == 1 and arena.take() == offset
        views = arena.lend(offset, [4])
        arena.close()  # views still out: the file goes now, the map with the views
        assert bytes(views[0]) == b"abcd" and not arena.path.exists()
    finally:
        arena.close()


def _arena_of_a_dead_process(instance: str) -> tuple[str, bytes]:
    """An arena whose owner was killed (it never closed it): created in a forked child that exits at once."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no cleanup, as a SIGKILL would leave it
        arena = Arena(arena_path(instance), slots=1, slot_bytes=64)
        os.write(write, arena.token + str(arena.path).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    data = os.read(read, 4096)
    os.close(read)
    return data[16:].decode(), data[:16]


def test_the_store_maps_only_arenas_with_their_token_and_removes_dead_owners_arenas() -> None:
    maps = ArenaMaps()
    name = f"unit-maps-{os.getpid()}"
    first = Arena(arena_path(name), slots=1, slot_bytes=64)
    try:
        assert owner_alive(first.path)
        assert maps.get(str(first.path), first.token) is not None
        assert maps.get(str(first.path), b"x" * 16) is None  # wrong token: not this arena
        assert maps.get("/etc/passwd", first.token) is None  # never a file that is not an arena
        assert maps.get(str(arena_path("nobody-here")), first.token) is None
        dead, _ = _arena_of_a_dead_process(name)
        assert os.path.exists(dead) and not owner_alive(arena_path(name, int(dead.rsplit("-", 1)[1])))
        assert remove_stale(name) == 1 and not os.path.exists(dead) and first.path.exists()  # only the dead one

        second = Arena(first.path, slots=1, slot_bytes=64)  # a restarted worker: same name, new file
        mapped = maps.get(str(second.path), second.token)  # the stale map is replaced
        assert mapped is not None and mapped[:16] == second.token
        second.close()
        assert maps.sweep() == 1 and len(maps) == 0  # its file is gone: the map would keep its memory alive

        # a worker killed mid-transfer leaves its file behind: the store's sweep finds nobody holds it
        path, token = _arena_of_a_dead_process(f"{name}-killed")
        assert maps.get(path, token) is not None and len(maps) == 1
        assert maps.sweep() == 1 and len(maps) == 0 and not os.path.exists(path)
    finally:
        first.close()
        maps.close()
