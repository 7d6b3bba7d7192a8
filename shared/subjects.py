"""Every NATS subject and stream name of the mesh, in one place.

    gateway --prepare (req/reply)--> recipe --work.route.prefill (JetStream)--> balancer
    balancer --work.prefill.<worker> (JetStream)--> prefill --kv.* (req/reply)--> kvcache
    prefill --tokens.<rid> (core)--> recipe;  prefill --work.route.decode (JetStream)--> balancer
    balancer --work.decode.<worker> (JetStream)--> decode --kv.peer.<prefill> (req/reply)--> prefill
                                                   decode --kv.get (what the peer could not give)--> kvcache
    decode --tokens.<rid> (core)--> recipe --events.<rid> (core)--> gateway
    anyone --requests.cancel (core, broadcast)--> everyone holding state for the request
    prefill/decode/kvcache --kv.events.<source> (core)--> balancer --kv.snapshot.<source> (req/reply)--> source
    prefill/decode --balancer.lost (req/reply, once at start)--> balancer: what moved on while it was lost
    prefill/decode --experts.load (core)--> balancer (experts role) --experts.plan (core, broadcast)--> workers
"""

from __future__ import annotations

# JetStream: durable work queues (survive restarts, acked, redelivered, deduplicated by message id).
WORK_STREAM = "DEEPINFER_WORK"
WORK_SUBJECTS = "work.>"
ROUTE_PREFILL = "work.route.prefill"
ROUTE_DECODE = "work.route.decode"


def prefill_work(worker_id: str) -> str:
    return f"work.prefill.{worker_id}"


def decode_work(worker_id: str) -> str:
    return f"work.decode.{worker_id}"


# Core NATS request/reply.
RECIPE_PREPARE = "recipe.prepare"
RECIPE_COUNT_TOKENS = "recipe.count_tokens"
RECIPE_TOKENIZE = "recipe.tokenize"  # TokenizeRequest -> JsonReply (vLLM's POST /tokenize)
RECIPE_DETOKENIZE = "recipe.detokenize"  # DetokenizeRequest -> JsonReply (vLLM's POST /detokenize)
RECIPE_MODELS = "recipe.models"  # ModelsRequest -> ModelsReply: the served models' context lengths
RECIPE_RESPONSE_GET = "recipe.responses.get"  # StoredResponseQuery -> JsonReply (GET /v1/responses/{id})
RECIPE_RESPONSE_DELETE = "recipe.responses.delete"  # StoredResponseQuery -> JsonReply (DELETE ...)
KV_LOOKUP = "kv.lookup"
KV_GET = "kv.get"
KV_PUT = "kv.put"
KV_GET_RUN = "kv.get.run"  # KvGetRun -> KvGetRunReply: a prefix run, many blocks per message
KV_PUT_BATCH = "kv.put.batch"  # KvPutBatch -> KvPutBatchReply: many blocks per message
KV_GET_SHM = "kv.get.shm"  # KvGetRunShm -> KvShmReply: kv.get.run, the bytes through the caller's shared memory
KV_PUT_SHM = "kv.put.shm"  # KvPutShm -> KvShmReply: kv.put.batch, the bytes through the caller's shared memory
KV_GET_HEAP = "kv.get.heap"  # KvGetHeap -> KvHeapReply: where a run lies in the store's shared heap, leased
KV_DELETE = "kv.delete"
KV_STATS = "kv.stats"  # KvStats -> KvStatsReply, for the gateway's /metrics (every instance answers; first wins)
BALANCER_STATS = "balancer.stats"  # BalancerStats -> BalancerStatsReply, for /metrics (the same way)
BALANCER_LOST = "balancer.lost"  # LostQuery -> LostReply: a starting worker's Cancels, before it takes a job
LAUNCHER_STATS = "launcher.stats"  # LauncherStats -> LauncherStatsReply: what `deepinfer up` supervises, for /metrics


def kv_snapshot(source: str) -> str:
    """KvSnapshotRequest -> KvSnapshot: every hash a KV event source holds (shared/schemas/events.py)."""
    return f"kv.snapshot.{source}"


def kv_heap_release(instance: str) -> str:
    """KvHeapRelease (core): a same-host reader ends its read lease on kvcache `instance`'s heap early."""
    return f"kv.heap.release.{instance}"


def kv_peer(worker_id: str) -> str:
    """KvPeerPull -> KvPeerReply: a prefill worker hands a request's prompt KV to its decode worker."""
    return f"kv.peer.{worker_id}"


def kv_peer_done(worker_id: str) -> str:
    """KvPeerDone (core): the decode worker's pull is over; the prefill worker drops the hand-over."""
    return f"kv.peer.{worker_id}.done"


def health(service: str) -> str:
    return f"health.{service}"


# Core NATS streams and broadcasts.
HEARTBEAT = "workers.heartbeat"
PRESENCE = "services.presence"  # Presence: recipes and balancers, for the gateway's readiness
WORKER_DONE = "workers.done"  # RequestDone: a request left a worker (the balancer forgets the assignment)
CANCEL = "requests.cancel"
KV_EVENTS_ALL = "kv.events.>"  # KvEvent from every source
EXPERT_LOAD = "experts.load"  # ExpertLoad: a worker's per-expert routing counts of the last window
EXPERT_PLAN = "experts.plan"  # ExpertPlan: a worker group's expert placement (each worker takes its group's)


def kv_events(source: str) -> str:
    return f"kv.events.{source}"


def tokens(request_id: str) -> str:
    return f"tokens.{request_id}"


def events(request_id: str) -> str:
    return f"events.{request_id}"


# Published again after a bus outage (shared/bus.py: replay): each receiver drops what it already has (tokens by
# index, events by seq; a cancel twice is a cancel), so a stream resumes where the outage cut it.
REPLAYED = ("tokens.", "events.", CANCEL, WORKER_DONE)


# JetStream key-value buckets.
RESPONSES_BUCKET = "deepinfer_responses"  # response id -> StoredResponse (Responses API `store`), with a TTL


# Queue groups: one member of the group handles each request/reply message.
RECIPE_GROUP = "recipe"
KVCACHE_GROUP = "kvcache"
BALANCER_PREFILL_DURABLE = "balancer-prefill"
BALANCER_DECODE_DURABLE = "balancer-decode"
