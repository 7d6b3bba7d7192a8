"""The engine worker that prefill and decode build on; the only package that imports the engine.

    service.py      EngineWorker: load the engine, take jobs from the work queue, heartbeat, cancels, health
    config.py       WorkerConfig and its command-line options
    kv_transfer.py  a held request's KV as bytes to and from the kvcache service (long-term blocks, snapshots)
    kvclient.py     the kvcache service's client: batched gets and puts, one-copy arena runs on one host
    short_term.py   content-addressed snapshots of a sequence's end (partial block, model state)
    kv_peer.py      prefill -> decode hand-over: decode pulls a prompt's KV straight from the prefill worker
    kv_peer_transport.py  how the hand-over's bytes go, by name: GPU to GPU by CUDA IPC, shared memory on one
                    host (a descriptor over NATS), else NATS; the place for RDMA libraries
    kv_cuda_ipc.py  the CUDA IPC hand-over: a device buffer's handle from prefill, a device copy at decode
    generate.py     `deepinfer generate`: the engine in one process, no mesh

The role handlers live in services/prefill and services/decode.
"""
