"""The prefill worker: prompt in, first token and the prompt's KV out.

For each job: find what the kvcache service already has of the prompt (the longest run of full blocks, and the
longest short-term snapshot on top of it: a previous turn's end, shared/short_term.py), import that, compute the
rest (chunked, batched with other prompts), sample the first token and send it to the client at once, then
store the new full blocks under their chained hashes and a snapshot at the prompt's end (partial last block +
the model's per-request state), and hand the request to the decode balancer.
"""

from __future__ import annotations

import logging
import time

from shared import hashing, short_term, subjects
from shared.bus import Envelope
from shared.engine.engine import EngineRequest
from shared.schemas.generate import DecodeJob, PrefillJob, TokenEvent
from shared.worker import EngineWorker

log = logging.getLogger(__name__)

LEASE_S = 10.0  # how long the store keeps a looked-up run for this worker's gets


class PrefillService(EngineWorker):
    role = "prefill"
    job_type = PrefillJob

    async def handle(self, job: PrefillJob, env: Envelope) -> None:
        assert self.engine is not None and self.kv is not None and self.bus is not None
        engine = self.engine.engine
        req = job.request
        prompt = req.prompt_ids
        block = engine.block_tokens
        ns = hashing.namespace(engine.cache_id, req.cache_salt)
        hashes = hashing.block_hashes(prompt, ns, block)
        prefix, prefix_tokens, state = await self._restore(prompt, ns, hashes)
        if self.cancelled(req.request_id):
            return  # the client left while the prefix was fetched: nothing is in the engine yet
        engine_req = EngineRequest(
            request_id=req.request_id,
            cache_salt=req.cache_salt,
            token_ids=list(prompt),
            sampling=req.sampling,
            max_new_tokens=1,
            output_offset=0,
            prefix_blocks=prefix,
            prefix_tokens=prefix_tokens,
            prefix_state=state,
            hold_kv=True,
        )
        first = None
        try:
            async for out in self.engine.generate(engine_req):
                if out.token_ids:
                    first = out
            if first is None:
                return  # cancelled: the client is gone, nothing to hand over
            token = first.token_ids[0]
            # The engine ran with max_new_tokens=1, so it says "length" unless the token itself ends the request.
            finished = first.finish_reason == "stop" or req.sampling.max_tokens <= 1
            await self.publish_tokens(
                TokenEvent(
                    request_id=req.request_id,
                    index=0,
                    token_ids=[token],
                    finish_reason=("stop" if req.sampling.max_tokens > 1 else "length") if finished else None,
                    prompt_tokens=len(prompt),
                    cached_tokens=first.num_cached_tokens,
                ),
                env,
            )
            if finished:
                return
            started = time.monotonic()
            stored = prefix_tokens // block  # full blocks that came from the store
            key = await self.store_kv(req.request_id, prompt, ns, hashes, stored)
            log.debug("%s: stored %d blocks in %.3fs", req.request_id, len(hashes) - stored,
                      time.monotonic() - started)
        finally:
            await self.engine.call(engine.release, req.request_id)
        if self.cancelled(req.request_id):
            return  # cancelled during the store: nobody is waiting for a decode
        handoff = DecodeJob(
            request=req,
            first_token=token,
            block_hashes=hashes,
            snapshot_key=key,
            cached_tokens=first.num_cached_tokens,
            prefill_worker=self.config.instance,
        )
        await self.bus.submit(subjects.ROUTE_DECODE, handoff, msg_id=f"{req.request_id}:handoff")

    async def _restore(self, prompt: list[int], ns: bytes, hashes: list[bytes]) -> tuple[list[bytes], int, bytes]:
        """(blobs, tokens they cover, model state) of the longest prefix the store can give back. The last
        prompt token is always computed: its logits give the first token."""
        assert self.engine is not None and self.kv is not None
        engine = self.engine.engine
        block = engine.block_tokens
        # leased: the run stays in the store (no eviction) until the gets below have read it
        run = min((await self.kv.lookup_run(hashes, lease_s=LEASE_S)).hits, (len(prompt) - 1) // block)
        found = await short_term.find(self.kv, prompt, ns, hashes[:run], block, len(prompt) - 1)
        # blocks alone resume at run * block, less the replay that rebuilds a model's short-term state
        if found is not None and found[0].length > run * block - (engine.replay_tokens if run else 0):
            snap = found[0]
            full = snap.length // block
            blobs = await self.fetch_blocks(hashes[:full])
            if len(blobs) == full:
                return blobs + ([snap.tail] if snap.tail else []), snap.length, snap.state
        blobs = await self.fetch_blocks(hashes[:run])
        return blobs, len(blobs) * block, b""
