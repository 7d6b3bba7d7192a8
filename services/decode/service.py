"""The decode worker: continuous batching over every request it holds, streaming tokens as they come.

A job carries the request, its first token (sampled by prefill) and where the prompt's KV lies in the kvcache
service. The worker imports the longest run of those blocks it can get (a missing block means the rest is
recomputed here, never a failure), joins the request to the running batch, and publishes each step's tokens on
the request's token stream at their output positions.
"""

from __future__ import annotations

import logging

from shared import subjects
from shared.bus import Envelope
from shared.engine.engine import EngineRequest
from shared.schemas.generate import DecodeJob, TokenEvent
from shared.kvclient import get_state
from shared.schemas.kv import KvDelete
from shared.worker import EngineWorker

log = logging.getLogger(__name__)


class DecodeService(EngineWorker):
    role = "decode"
    job_type = DecodeJob

    async def handle(self, job: DecodeJob, env: Envelope) -> None:
        assert self.engine is not None and self.kv is not None and self.bus is not None
        req = job.request
        prompt = req.prompt_ids
        blobs = await self.kv.get_run(job.block_hashes)
        prefix_tokens = len(blobs) * self.engine.engine.block_tokens
        if job.tail_key and len(blobs) == len(job.block_hashes):
            tail = await self.kv.get_run([job.tail_key])
            if tail:
                blobs += tail
                prefix_tokens = len(prompt)
        state, state_keys = b"", [job.state_key] if job.state_key else []
        if job.state_key and prefix_tokens >= len(prompt):  # V4: rings at the prompt's end (else: bounded replay)
            state, state_keys = await get_state(self.kv, job.state_key)
        if prefix_tokens < len(prompt):
            log.info("%s: %d of %d prompt tokens not in the store, recomputing", req.request_id,
                     len(prompt) - prefix_tokens, len(prompt))
        engine_req = EngineRequest(
            request_id=req.request_id,
            cache_salt=req.cache_salt,
            token_ids=[*prompt, job.first_token],
            sampling=req.sampling,
            max_new_tokens=req.sampling.max_tokens - 1,
            output_offset=1,
            prefix_blocks=blobs,
            prefix_tokens=prefix_tokens,
            prefix_state=state,
        )
        index = 1
        finish_reason = None
        try:
            async for out in self.engine.generate(engine_req):
                if not out.token_ids and out.finish_reason is None:
                    continue
                finish_reason = out.finish_reason
                await self.publish_tokens(
                    TokenEvent(req.request_id, index, list(out.token_ids), finish_reason=out.finish_reason), env
                )
                index += len(out.token_ids)
        finally:
            # (state parts not read here expire with the short-term TTL)
            short_term = [k for k in (job.tail_key, *state_keys) if k]
            if short_term:
                await self.bus.publish(subjects.KV_DELETE, KvDelete(short_term))
        if finish_reason is None:
            log.info("%s: aborted after %d tokens", req.request_id, index)
