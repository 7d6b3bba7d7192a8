"""The decode worker: continuous batching over every request it holds, streaming tokens as they come.

A job carries the request, its first token (sampled by prefill) and where the prompt's KV lies in the kvcache
service: full blocks, and a snapshot at the prompt's end (partial block + the model's state). The worker
imports what it can get (a missing block means the rest is recomputed here, never a failure), joins the request
to the running batch, and publishes each step's tokens on the request's token stream at their output positions.
When the request ends it stores the output's full blocks and a snapshot at the output's end, so the next turn
of the conversation finds both (shared/short_term.py).
"""

from __future__ import annotations

import logging

from shared import hashing, short_term
from shared.bus import Envelope
from shared.engine.engine import EngineRequest
from shared.schemas.generate import DecodeJob, TokenEvent
from shared.worker import EngineWorker

log = logging.getLogger(__name__)


class DecodeService(EngineWorker):
    role = "decode"
    job_type = DecodeJob

    async def handle(self, job: DecodeJob, env: Envelope) -> None:
        assert self.engine is not None and self.kv is not None and self.bus is not None
        engine = self.engine.engine
        req = job.request
        prompt = req.prompt_ids
        blobs = await self.fetch_blocks(job.block_hashes)
        prefix_tokens, state = len(blobs) * engine.block_tokens, b""
        if job.snapshot_key and len(blobs) == len(job.block_hashes):
            snap = await short_term.load(self.kv, job.snapshot_key)
            if snap is not None and snap.length == len(prompt):
                blobs += [snap.tail] if snap.tail else []
                prefix_tokens, state = snap.length, snap.state  # V4: rings there (else: bounded replay)
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
            max_new_tokens=req.sampling.max_tokens - 1,
            output_offset=1,
            prefix_blocks=blobs,
            prefix_tokens=prefix_tokens,
            prefix_state=state,
            hold_kv=True,  # kept after the last token until the output's KV is stored
        )
        index = 1
        finish_reason = None
        try:
            async for out in self.engine.generate(engine_req):
                if not out.token_ids and out.finish_reason is None:
                    continue
                finish_reason = out.finish_reason
                tokens += out.token_ids
                await self.publish_tokens(
                    TokenEvent(req.request_id, index, list(out.token_ids), finish_reason=out.finish_reason), env
                )
                index += len(out.token_ids)
            if finish_reason is not None:  # the next turn starts with this one: keep its KV findable
                ns = hashing.namespace(engine.cache_id, req.cache_salt)
                computed = tokens[:-1]  # the last token was sampled, never computed
                hashes = hashing.block_hashes(computed, ns, engine.block_tokens)
                await self.store_kv(req.request_id, computed, ns, hashes, prefix_tokens // engine.block_tokens)
        finally:
            await self.engine.call(engine.release, req.request_id)
        if finish_reason is None:
            log.info("%s: aborted after %d tokens", req.request_id, index)
