"""The prefill worker: prompt in, first token and the prompt's KV out.

For each job: find what the kvcache service already has of the prompt (the longest run of full blocks, and the
longest short-term snapshot on top of it: a previous turn's end, shared/worker/short_term.py), import that, compute the
rest (chunked, batched with other prompts), sample the first token, hand the request to the decode balancer
and send the token to the client, export the prompt's KV once and hold those bytes for the decode worker's pull
(shared/worker/kv_peer.py: until it says done, a lease ends or a cancel comes; on one host in a region of the
worker's peer arena, shared/worker/kv_peer_transport.py), and store the new full blocks under
their chained hashes and a snapshot at the prompt's end (partial last block + the model's per-request state)
for later turns. With `--kv-handover store` the job goes after the store instead, and decode reads it there.
"""

from __future__ import annotations

import logging
import time

from shared import hashing, subjects
from shared.bus import Envelope
from shared.config import ServiceConfig
from shared.worker.kv_peer import Handovers
from shared.kv_arena import Arena
from shared.worker.kv_cuda_ipc import CudaExporter
from shared.worker.kv_peer_transport import peer_transport
from shared.worker.kvclient import MiB
from shared.schemas.generate import Cancel, DecodeJob, GenerateRequest, PrefillJob, TokenEvent, TokenLogprob
from shared.schemas.kv_peer import KvPeerDone, KvPeerPull
from shared.worker import short_term
from shared.worker.config import WorkerConfig
from shared.worker.kv_transfer import ExportedKv
from shared.worker.service import EngineRequest, EngineWorker

log = logging.getLogger(__name__)

LEASE_S = 10.0  # how long the store keeps a looked-up run for this worker's gets


class PrefillService(EngineWorker):
    role = "prefill"
    job_type = PrefillJob

    def __init__(self, config: ServiceConfig, worker: WorkerConfig) -> None:
        super().__init__(config, worker)
        self.handovers = Handovers()  # prompts' KV held for their decode workers' pulls (shared/worker/kv_peer.py)

    async def handle(self, job: PrefillJob, env: Envelope) -> None:
        assert self.engine is not None and self.transfer is not None and self.kv is not None and self.bus is not None
        layout = self.engine.layout
        req = job.request
        prompt = req.prompt_ids
        block = layout.block_tokens
        ns = hashing.namespace(layout.cache_id, req.cache_salt)
        hashes = hashing.block_hashes(prompt, ns, block)
        started = time.monotonic()
        prefix, prefix_tokens, state = await self._restore(prompt, ns, hashes)
        restored = time.monotonic()
        if self.cancelled(req.request_id):
            return  # the client left while the prefix was fetched: nothing is in the engine yet
        engine_req = EngineRequest(
            request_id=req.request_id,
            cache_salt=req.cache_salt,
            token_ids=list(prompt),
            sampling=req.sampling,
            max_new_tokens=1,
            output_offset=req.output_offset,  # a continuation samples at its own output position
            prefix_blocks=prefix,
            prefix_tokens=prefix_tokens,
            prefix_state=state,
            hold_kv=True,
        )
        first = None
        peer = self.worker.kv_handover == "peer"
        try:
            async for out in self.engine.generate(engine_req):
                if out.token_ids:
                    first = out
            if first is None:
                return  # cancelled: the client is gone, nothing to hand over
            computed = time.monotonic()
            log.info("%s: %d prompt tokens, %d cached (%d from the store%s): restore %.0f ms, compute %.0f ms",
                     req.request_id, len(prompt), first.num_cached_tokens, prefix_tokens,
                     " + snapshot" if state else "", 1e3 * (restored - started), 1e3 * (computed - restored))
            token = first.token_ids[0]
            # The engine ran with max_new_tokens=1, so it says "length" unless the token itself ends the request.
            left = req.remaining_tokens
            finished = first.finish_reason == "stop" or left <= 1
            event = TokenEvent(
                request_id=req.request_id,
                index=req.output_offset,
                token_ids=[token],
                finish_reason=("stop" if left > 1 else "length") if finished else None,
                prompt_tokens=len(prompt),
                cached_tokens=first.num_cached_tokens,
                migration=req.migration,
                logprobs=list(first.logprobs or []),
            )
            if finished or self.cancelled(req.request_id):
                if finished:
                    await self.publish_tokens(event, env)
                return  # cancelled after the last step: nothing to hand over
            if not peer:  # the store path: store from the held request, then hand the job on
                await self.publish_tokens(event, env)
                key = await self._store(req.request_id, prompt, ns, hashes, prefix_tokens // block)
            else:
                # Decode pulls the KV from here while the store gets it: the job leaves now, before the first
                # token (a worker that dies once the client has its first token has handed the job on), under
                # the snapshot's key to be (content-addressed: decode's fallback finds it once stored).
                self.handovers.open(req.request_id, hashes, req.migration)
                await self._hand_over(req, token, hashes, self._snapshot_key(prompt, ns, hashes),
                                      first.num_cached_tokens, self.handovers.lease_s, event.logprobs)
                # the request is decode's now: this worker dying during the export or the store must not have the
                # job redelivered to its restart, to run again for a request that has moved on (and, its hand-over
                # deduplicated, to hold KV nobody pulls)
                await env.handed_on()
                await self.publish_tokens(event, env)
                exported = await self._export(req.request_id, len(prompt))
        except BaseException:
            # failed or cancelled before the bytes were in (a cancel ended it already): a pull that waits for
            # them answers "not found" now, not when the lease ends
            self.handovers.end(req.request_id, "failed")
            raise
        finally:
            await self.engine.release(req.request_id)
        if peer:  # from the exported bytes: the engine's blocks are free for the next prompt already
            await self._store(req.request_id, prompt, ns, hashes, prefix_tokens // block, exported)
        elif not self.cancelled(req.request_id):  # cancelled during the store: nobody waits for a decode
            await self._hand_over(req, token, hashes, key, first.num_cached_tokens, 0.0, event.logprobs)

    async def _store(self, request_id: str, prompt: list[int], ns: bytes, hashes: list[bytes], stored: int,
                     exported: ExportedKv | None = None) -> bytes:
        """store_kv, timed for the log; `stored`: the leading full blocks that came from the store."""
        assert self.transfer is not None
        started = time.monotonic()
        key = await self.transfer.store_kv(request_id, prompt, ns, hashes, stored, exported)
        log.info("%s: stored %d blocks in %.0f ms", request_id, len(hashes) - stored, 1e3 * (time.monotonic() - started))
        return key

    async def _hand_over(self, req: GenerateRequest, token: int, hashes: list[bytes], key: bytes, cached: int,
                         lease_s: float, logprobs: list[TokenLogprob]) -> None:
        assert self.bus is not None
        handoff = DecodeJob(
            request=req,
            first_token=token,
            block_hashes=hashes,
            snapshot_key=key,
            cached_tokens=cached,
            prefill_worker=self.config.instance,
            peer_lease_s=lease_s,
            first_logprobs=logprobs,
        )
        # each migration hands over anew: the same id would fall in the dedup window of the one before
        suffix = f":m{req.migration}" if req.migration else ""
        await self.bus.submit(subjects.ROUTE_DECODE, handoff, msg_id=f"{req.request_id}:handoff{suffix}")

    async def _export(self, request_id: str, tokens: int) -> ExportedKv:
        """Export the prompt's KV once into its hand-over: into a region of the peer arena where there is one
        and room in it, else as bytes; the same bytes (views of the region) go to the store afterwards."""
        assert self.engine is not None and self.transfer is not None
        if self.handovers.cuda is not None:  # first, and fast: a pull offering cuda-ipc is answered from it
            device = await self.handovers.cuda.export(self.engine, request_id, tokens)
            if device is not None:
                self.handovers.fill_device(request_id, device)
        exporter = self.handovers.exporter
        part_bytes = self.transfer.state_part_bytes
        region = await exporter.export(self.engine, request_id, tokens, part_bytes) if exporter is not None else None
        if region is None:
            exported = await self.transfer.export_kv(request_id, tokens, 0)
            self.handovers.fill(request_id, exported.blocks, exported.tail, exported.state, part_bytes)
            return exported
        full = tokens // self.engine.layout.block_tokens
        tail = tokens % self.engine.layout.block_tokens > 0
        self.handovers.fill_region(request_id, region, full, tail)
        items = region.items
        return ExportedKv(0, items[:full], bytes(items[full]) if tail else b"", b"".join(items[full + tail :]))

    def _snapshot_key(self, prompt: list[int], ns: bytes, hashes: list[bytes]) -> bytes:
        """The key store_kv will save the prompt's snapshot under (b"": it saves none)."""
        assert self.engine is not None
        layout = self.engine.layout
        if not len(prompt) % layout.block_tokens and not layout.has_request_state:
            return b""
        return short_term.key_for(prompt, ns, hashes, len(prompt), layout.block_tokens)

    # --- the hand-over's prefill side (shared/worker/kv_peer.py) -----------------------------------------------------

    async def serve_handover(self) -> None:
        assert self._kv_bus is not None and self.engine is not None
        transport = peer_transport(self.worker.kv_peer_transport)
        exporter = transport.exporter
        if transport.device and self.worker.kv_handover == "peer" and self.engine.layout.device.startswith("cuda"):
            self.handovers.cuda = CudaExporter()
        if exporter is not None and self.worker.kv_handover == "peer":
            try:
                self.handovers.exporter = exporter(self.config.instance, self.worker.kv_arena_mib * MiB)
            except OSError as exc:  # no /dev/shm (or no room in it): hand-overs go over NATS, as with `nats`
                log.warning("no peer arena (%s): hand-overs go over NATS", exc)
        # on the KV connection: megabytes of replies never queue with heartbeats, tokens and acks
        await self._kv_bus.serve(subjects.kv_peer(self.config.instance), KvPeerPull, self.handovers.serve)
        await self._kv_bus.subscribe(subjects.kv_peer_done(self.config.instance), KvPeerDone, self._on_peer_done)

    async def _on_peer_done(self, done: KvPeerDone, _: Envelope) -> None:
        self.handovers.end(done.request_id, "done")

    def on_cancel(self, request_id: str) -> None:
        self.handovers.end(request_id, "cancelled")

    def on_peer_lost(self, cancel: Cancel) -> None:
        # The decode worker that was to pull this hand-over is gone (the balancer sends this with the request's
        # "lost" event): nobody pulls it now, and the continuation, a later migration, gets a hand-over of its own.
        if cancel.role == "decode":
            self.handovers.end(cancel.request_id, "decode_lost", upto=cancel.migration)

    def arenas(self) -> list[Arena]:
        """The store's arena, and the peer arena hand-overs are exported into (prefill's GPU -> host, once each)."""
        exporter = self.handovers.exporter
        return [*super().arenas(), *([exporter.arena] if exporter is not None else [])]

    def handover_counts(self) -> dict[str, int]:
        exporter = self.handovers.exporter
        shm = {} if exporter is None else {**{f"shm_{k}": v for k, v in exporter.counts.items()},
                                          "shm_regions_held": exporter.held}
        cuda = {} if self.handovers.cuda is None else dict(self.handovers.cuda.counts)
        return {**self.handovers.counts, "leases": len(self.handovers), **shm, **cuda}

    async def stop(self) -> None:
        await super().stop()
        if self.handovers.exporter is not None:
            self.handovers.exporter.close()

    async def _restore(self, prompt: list[int], ns: bytes, hashes: list[bytes]) -> tuple[list[bytes], int, bytes]:
        """(blobs, tokens they cover, model state) of the longest prefix the store can give back. The last
        prompt token is always computed: its logits give the first token."""
        assert self.engine is not None and self.transfer is not None and self.kv is not None
        layout = self.engine.layout
        block = layout.block_tokens
        # leased: the run stays in the store (no eviction) until the gets below have read it. This worker's own
        # prefix cache counts too: a follow-up sent the moment the previous turn ended can come before that
        # turn's blocks are in the store, but not before decode's snapshot on top of them (decode's end waits)
        stored = (await self.kv.lookup_run(hashes, lease_s=LEASE_S)).hits
        local = await self.engine.cached_blocks(hashes)
        run = min(max(stored, local), (len(prompt) - 1) // block)
        found = await short_term.find(self.kv, prompt, ns, hashes[:run], block, len(prompt) - 1)
        # blocks alone resume at run * block, less the replay that rebuilds a model's short-term state
        if found is not None and found[0].length > run * block - (layout.replay_tokens if run else 0):
            snap = found[0]
            full = snap.length // block
            blobs = await self.transfer.fetch_blocks(hashes[:full], local)
            if len(blobs) == full:
                return blobs + ([snap.tail] if snap.tail else []), snap.length, snap.state
        blobs = await self.transfer.fetch_blocks(hashes[:run], local)
        return blobs, len(blobs) * block, b""
