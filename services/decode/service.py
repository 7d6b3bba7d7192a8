"""The decode worker: continuous batching over every request it holds, streaming tokens as they come.

A job carries the request, its first token (sampled by prefill, and sent again from here: see handle) and where
the prompt's KV lies in the kvcache service: full blocks, and a snapshot at the prompt's end (partial block + the
model's state). A continuation (a request resumed after its worker was lost) is a job like any other, its output
positions starting at `output_offset`. The worker
imports what it can get (a missing block means the rest is recomputed here, never a failure), joins the request
to the running batch, and publishes each step's tokens on the request's token stream at their output positions.
When the request ends it stores the output's full blocks and a snapshot at the output's end, so the next turn
of the conversation finds both (shared/worker/short_term.py); the answer's end (its finish reason) goes out once
that store is in, so a follow-up sent the moment the answer ends finds them too.
"""

from __future__ import annotations

import asyncio
import logging
import time

from collections import Counter

from shared import hashing
from shared.bus import Envelope
from shared.config import ServiceConfig
from shared.worker.kv_peer import PeerPuller
from shared.worker.kv_peer_transport import peer_transport
from shared.worker.kvclient import MESSAGE_OVERHEAD, MiB
from shared.schemas.generate import DecodeJob, TokenEvent
from shared.worker import short_term
from shared.worker.config import WorkerConfig
from shared.worker.service import EngineRequest, EngineWorker

log = logging.getLogger(__name__)
END_AFTER_STORE_S = 2.0  # the longest a finished answer waits for its KV store before it ends


class DecodeService(EngineWorker):
    role = "decode"
    job_type = DecodeJob

    def __init__(self, config: ServiceConfig, worker: WorkerConfig) -> None:
        super().__init__(config, worker)
        self.peers: PeerPuller | None = None  # pulls from prefill workers' hand-overs (shared/worker/kv_peer.py)
        self.fetched: Counter[str] = Counter()  # prompt blocks from the own cache, the store (the peer's: peers)

    async def handle(self, job: DecodeJob, env: Envelope) -> None:
        assert self.engine is not None and self.transfer is not None and self.kv is not None and self.bus is not None
        layout = self.engine.layout
        req = job.request
        prompt = req.prompt_ids
        # Prefill's token again: on the peer path prefill hands the job on before it sends the token, and a prefill
        # that dies in between would leave the stream a gap at that position forever (the recipe drops the copy).
        await self.publish_tokens(TokenEvent(req.request_id, req.output_offset, [job.first_token],
                                             prompt_tokens=len(prompt), cached_tokens=job.cached_tokens,
                                             migration=req.migration, logprobs=job.first_logprobs), env)
        started = time.monotonic()
        blobs, snap = await self._prompt_kv(job)
        prefix_tokens, state = len(blobs) * layout.block_tokens, b""
        if len(blobs) == len(job.block_hashes):
            if snap is None and job.snapshot_key:
                stored = await short_term.load(self.kv, job.snapshot_key)
                if stored is not None and stored.length == len(prompt):
                    snap = stored.tail, stored.state
            if snap is not None:
                tail, state = snap
                blobs += [tail] if tail else []
                prefix_tokens = len(prompt)  # V4: rings there (else: bounded replay)
                del tail
        snap = None  # blobs may be views of a peer's arena: `blobs` is the one reference to them left (see below)
        if prefix_tokens < len(prompt):
            log.info("%s: %d of %d prompt tokens not in the store, recomputing", req.request_id,
                     len(prompt) - prefix_tokens, len(prompt))
        if self.cancelled(req.request_id):
            return  # the client left while the prompt's KV was fetched: nothing is in the engine yet
        tokens = [*prompt, job.first_token]
        engine_req = EngineRequest(
            request_id=req.request_id,
            cache_salt=req.cache_salt,
            token_ids=list(tokens),
            sampling=req.sampling,
            max_new_tokens=req.remaining_tokens - 1,
            output_offset=req.output_offset + 1,  # after prefill's token (a continuation: after its output)
            prefix_blocks=blobs,
            prefix_tokens=prefix_tokens,
            prefix_state=state,
            hold_kv=True,  # kept after the last token until the output's KV is stored
        )
        index = req.output_offset + 1
        finish_reason = None
        pulled, first_step = time.monotonic(), 0.0
        try:
            async for out in self.engine.generate(engine_req):
                first_step = first_step or time.monotonic()
                # imported at admission: let the views go now, so the store's or the peer's shared memory comes
                # back to its owner (its `done`) during the decode, not after it
                blobs.clear()
                if not out.token_ids and out.finish_reason is None:
                    continue
                finish_reason = out.finish_reason
                tokens += out.token_ids
                if out.token_ids:  # the end itself goes out after the store below
                    await self.publish_tokens(
                        TokenEvent(req.request_id, index, list(out.token_ids), migration=req.migration,
                                   logprobs=list(out.logprobs or [])), env
                    )
                    index += len(out.token_ids)
            done = time.monotonic()
            if finish_reason is not None:
                log.info("%s: prompt KV (%d tokens%s) in %.0f ms, first step %.0f ms later, %d tokens in %.0f ms",
                         req.request_id, prefix_tokens, " + snapshot" if state else "", 1e3 * (pulled - started),
                         1e3 * (first_step - pulled), index - req.output_offset - 1, 1e3 * (done - first_step))
                # the next turn starts with this one: keep its KV findable
                ns = hashing.namespace(layout.cache_id, req.cache_salt)
                computed = tokens[:-1]  # the last token was sampled, never computed
                hashes = hashing.block_hashes(computed, ns, layout.block_tokens)
                stored = prefix_tokens // layout.block_tokens
                store = asyncio.ensure_future(self.transfer.store_kv(req.request_id, computed, ns, hashes, stored))
                # The client's answer ends once the store has this turn's end (or after END_AFTER_STORE_S: a slow
                # store must not hold it): a follow-up sent the moment the answer ends (an agent's next call) finds
                # the snapshot, instead of rebuilding the rings by the bounded replay (seconds on a long prompt).
                await asyncio.wait({store}, timeout=END_AFTER_STORE_S)
                await self.publish_tokens(TokenEvent(req.request_id, index, [], finish_reason=finish_reason,
                                                     migration=req.migration), env)
                await store
        finally:
            await self.engine.release(req.request_id)
        if finish_reason is None:
            log.info("%s: aborted after %d tokens", req.request_id, index)

    async def _prompt_kv(self, job: DecodeJob) -> tuple[list[bytes], tuple[bytes, bytes] | None]:
        """The leading run of the prompt's full blocks this worker can have (b"" for those its own prefix cache
        holds, then the prefill peer's, then the store's), and the snapshot at the prompt's end (partial block,
        model state) when the peer gave it whole. Each source only continues where the one before stopped."""
        assert self.engine is not None and self.transfer is not None and self.kv is not None
        hashes = job.block_hashes
        rid = job.request.request_id
        if job.peer_lease_s <= 0 or self.peers is None:
            blobs = await self.transfer.fetch_blocks(hashes)  # the store path, as before the hand-over existed
            self.fetched["store_blocks"] += sum(1 for b in blobs if b)
            self.fetched["local_blocks"] += sum(1 for b in blobs if not b)
            return blobs, None
        local = await self.engine.cached_blocks(hashes)
        self.fetched["local_blocks"] += local
        pulled = await self.peers.pull(job.prefill_worker, rid, hashes, local, lambda: self.cancelled(rid))
        blobs, snap = [b""] * local + pulled.blocks, pulled.snapshot
        if len(blobs) < len(hashes) and not self.cancelled(rid):
            snap = None  # a snapshot only goes on top of every block
            got = await self.kv.get_run(hashes[len(blobs) :])
            self.fetched["store_blocks"] += len(got)
            blobs += got
        return blobs, snap

    # --- the hand-over's decode side (shared/worker/kv_peer.py) -----------------------------------------------------

    async def serve_handover(self) -> None:
        assert self._kv_bus is not None and self.engine is not None
        message = min(4 * MiB, self._kv_bus.max_payload - MESSAGE_OVERHEAD)
        self.peers = PeerPuller(self._kv_bus, self.engine.layout.block_bytes, message_bytes=message,
                                via=peer_transport(self.worker.kv_peer_transport).reads,
                                device=self.engine.layout.device)

    def handover_counts(self) -> dict[str, int]:
        return {**self.fetched, **(self.peers.counts if self.peers is not None else {})}
