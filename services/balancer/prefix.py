"""What each prefill worker already has of a prompt: its local prefix cache, and the shared store past that.

The prompt is hashed the way the workers hash it (shared/hashing.py: namespace(cache_id, the request's salt),
blocks of block_tokens, both from their heartbeats), once per distinct (cache_id, block_tokens) among the
candidates. Only blocks strictly before the last prompt token count: its logits must be computed anyway.

    local(w)    = w's run in its own cache (source w, tier "local")
    store(w, t) = blocks of the best shared-store run past local(w), in tier t

"The best shared-store run" is the longest among store sources: with one kvcache instance (the usual case) it
is simply that store's run. Hits are returned in tokens; policies weigh them (policies/prefill.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.balancer.registry import WorkerLoad
from shared import hashing
from services.balancer.prefix_index import PrefixIndex, Run


@dataclass(frozen=True)
class PrefixHits:
    local: dict[str, int] = field(default_factory=dict)  # worker id -> tokens in its local cache
    store: dict[str, dict[str, int]] = field(default_factory=dict)  # worker id -> tier -> tokens it would load


def prefix_hits(index: PrefixIndex, prompt: list[int], salt: str, workers: Sequence[WorkerLoad]) -> PrefixHits:
    hits = PrefixHits()
    groups: dict[tuple[str, int], list[WorkerLoad]] = {}
    for w in workers:
        if w.cache_id and w.block_tokens > 0:
            groups.setdefault((w.cache_id, w.block_tokens), []).append(w)
    stores = index.store_sources()
    for (cache_id, block), members in groups.items():
        usable = (len(prompt) - 1) // block
        if usable <= 0:
            continue
        hashes = hashing.block_hashes(prompt[: usable * block], hashing.namespace(cache_id, salt), block)
        store = max((index.run(s, hashes) for s in stores), key=lambda r: r.blocks, default=Run())
        for w in members:
            local = index.run(w.worker_id, hashes).blocks
            if local:
                hits.local[w.worker_id] = local * block
            loaded = {tier: n * block for tier, n in store.by_tier(local).items()}
            if loaded:
                hits.store[w.worker_id] = loaded
    return hits
