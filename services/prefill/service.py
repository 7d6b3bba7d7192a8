"""The prefill worker: prompt in, first token and the prompt's KV out.

For each job: look up the longest run of the prompt's blocks already in the kvcache service, import those,
compute the rest (chunked, batched with other prompts), sample the first token and send it to the client at
once, then store the new full blocks under their chained hashes, the partial last block and the model's
per-request state (V4's rings, in parts: see shared/kvclient.py) under short-term per-request keys, and hand the
request to the decode balancer.
"""

from __future__ import annotations

import logging
import time

from shared import hashing, subjects
from shared.bus import Envelope
from shared.engine.engine import EngineRequest
from shared.kvclient import SHORT_TERM_TTL_S, put_state, state_key, tail_key
from shared.schemas.generate import DecodeJob, PrefillJob, TokenEvent
from shared.worker import EngineWorker

log = logging.getLogger(__name__)


class PrefillService(EngineWorker):
    role = "prefill"
    job_type = PrefillJob

    async def handle(self, job: PrefillJob, env: Envelope) -> None:
        assert self.engine is not None and self.kv is not None and self.bus is not None
        req = job.request
        prompt = req.prompt_ids
        block = self.engine.engine.block_tokens
        hashes = hashing.block_hashes(prompt, hashing.namespace(self.engine.engine.cache_id, req.cache_salt), block)
        # The last prompt token is always computed: its logits give the first token.
        usable = min(await self.kv.lookup(hashes), (len(prompt) - 1) // block)
        cached = await self.kv.get_run(hashes[:usable])
        engine_req = EngineRequest(
            request_id=req.request_id,
            cache_salt=req.cache_salt,
            token_ids=list(prompt),
            sampling=req.sampling,
            max_new_tokens=1,
            output_offset=0,
            prefix_blocks=cached,
            prefix_tokens=len(cached) * block,
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
            full = len(hashes)
            blobs = await self.engine.call(self.engine.engine.export_blocks, req.request_id, len(cached), full)
            await self.kv.put_many(list(zip(hashes[len(cached) : full], blobs)))
            tail = b""
            if len(prompt) % block:
                tail = tail_key(req.request_id)
                (tail_blob,) = await self.engine.call(self.engine.engine.export_blocks, req.request_id, full, full + 1)
                await self.kv.put_many([(tail, tail_blob)], ttl_s=SHORT_TERM_TTL_S)
            state = b""
            if self.engine.engine.has_request_state:
                state = state_key(req.request_id)
                blob = await self.engine.call(self.engine.engine.export_state, req.request_id)
                await put_state(self.kv, state, blob, self.state_part_bytes())
            log.debug("%s: stored %d blocks in %.3fs", req.request_id, full - len(cached), time.monotonic() - started)
        finally:
            await self.engine.call(self.engine.engine.release, req.request_id)
        handoff = DecodeJob(
            request=req,
            first_token=token,
            block_hashes=hashes,
            tail_key=tail,
            state_key=state,
            cached_tokens=first.num_cached_tokens,
            prefill_worker=self.config.instance,
        )
        await self.bus.submit(subjects.ROUTE_DECODE, handoff, msg_id=f"{req.request_id}:handoff")
