"""The shared-memory arena (shared/kv_arena.py): slots lent and given back, retired after a timeout, and the
store's side checking paths and tokens."""

from __future__ import annotations

import os

from shared.kv_arena import HEADER, Arena, ArenaMaps, arena_path, remove_stale


def test_slots_are_lent_given_back_and_retired() -> None:
    arena = Arena(arena_path(f"unit-{os.getpid()}"), slots=2, slot_bytes=64)
    try:
        a, b = arena.take(), arena.take()
        assert {a, b} == {HEADER, HEADER + 64} and arena.take() is None  # both lent
        assert arena.write(a, [b"abc", b"de"]) == [3, 2] and arena.read(a, [3, 2]) == [b"abc", b"de"]
        arena.give(a)
        arena.lose(b)  # its request timed out: a late write may land there, so it is never lent again
        assert arena.take() == a and arena.take() is None and arena.lost == 1
    finally:
        arena.close()
    assert not arena.path.exists()


def test_the_store_maps_only_arenas_with_their_token() -> None:
    maps = ArenaMaps()
    first = Arena(arena_path(f"unit-maps-{os.getpid()}"), slots=1, slot_bytes=64)
    try:
        assert maps.get(str(first.path), first.token) is not None
        assert maps.get(str(first.path), b"x" * 16) is None  # wrong token: not this arena
        assert maps.get("/etc/passwd", first.token) is None  # never a file that is not an arena
        assert maps.get(str(arena_path("nobody-here")), first.token) is None
        dead = Arena(arena_path(f"unit-maps-{os.getpid()}", pid=2**22 + 1), slots=1, slot_bytes=64)  # no such pid
        assert remove_stale(f"unit-maps-{os.getpid()}") == 1 and not dead.path.exists() and first.path.exists()
        second = Arena(first.path, slots=1, slot_bytes=64)  # a restarted worker: same name, new file
        mapped = maps.get(str(second.path), second.token)  # the stale map is replaced
        assert mapped is not None and mapped[:16] == second.token
        second.close()
        assert maps.sweep() == 1 and len(maps) == 0  # its file is gone: the map would keep its memory alive
    finally:
        first.close()
        maps.close()
