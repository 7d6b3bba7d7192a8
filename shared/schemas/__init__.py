"""Every message that crosses the bus, one module per hop (as mini-sglang's `message/`: a module holds what one
receiver takes, with the replies and events that answer it). Wire format: `shared.codec` (msgpack, validated
against these dataclasses where a message arrives).

    hop                                      module        types
    gateway <-> recipe                       gateway.py    PrepareRequest -> PrepareReply, then ApiEvent;
                                                           CountTokensRequest -> CountTokensReply; TokenizeRequest,
                                                           DetokenizeRequest, StoredResponseQuery -> JsonReply;
                                                           ModelsRequest -> ModelsReply (ModelCard)
    recipe -> balancer -> workers, and back  generate.py   GenerateRequest (SamplingParams), PrefillJob, DecodeJob;
                                                           TokenEvent (workers, or the balancer failing a request,
                                                           -> recipe); Cancel (anyone -> every hop of the request)
    workers -> balancer (and gateway)        workers.py    Heartbeat, RequestDone
    workers <-> balancer (expert placement)  experts.py    ExpertLoad (routing counts), ExpertPlan
    prefill/decode (and gateway) -> kvcache  kv.py         KvLookup, KvGet, KvPut, KvGetRun, KvPutBatch, KvPutShm,
                                                           KvGetRunShm, KvGetHeap, KvDelete and their replies;
                                                           KvHeapRelease (core); KvStats ->
                                                           KvStatsReply (KvTierStats), for /metrics
    decode -> prefill (the KV hand-over)     kv_peer.py    KvPeerPull -> KvPeerReply (KvPeerShm | KvPeerCuda); KvPeerDone
    caches -> balancer (who holds what)      events.py     KvEvent; KvSnapshotRequest -> KvSnapshot
    gateway -> balancer                      balancer.py   BalancerStats -> BalancerStatsReply, for /metrics
    launcher -> every service; -> gateway    health.py     HealthRequest -> HealthReply; Presence
    gateway -> launcher                      launcher.py   LauncherStats -> LauncherStatsReply (ProcessState)
    recipe -> JetStream KV (not a message)   responses.py  StoredResponse

Subjects are in shared/subjects.py.
"""
