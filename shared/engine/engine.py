"""The engine: requests in, tokens out, one step at a time (schedule -> run -> sample -> resolve).

What a model can do beyond the forward (its own cache layout, MTP drafts) the engine learns from protocols.py;
speculative verify and draft are speculative.py's.

Single-threaded by design: every method is called from one thread (AsyncEngine owns it), so there are no
locks; requests join and leave between any two steps (continuous batching).

On a GPU steps overlap: step() launches step N+1 before it waits for step N's tokens, so the host's
scheduling, packing and postprocessing run while the device computes.

    host    launch N | resolve N-1 | launch N+1 | resolve N | ...      (a call to step() = one launch + one resolve)
    device  ...  N-1 |          N            |          N+1      ...

Step N+1's input ids for sequences sampled at N are placeholders that the model reads from the device copy of
N's tokens (ModelRunner.fed); N's tokens reach the host through an async copy into pinned memory and an event.
A sequence that stops at N has already been scheduled for N+1: that token is computed, taken back, never
reported (scheduler.resolve). The tokens are the same as the synchronous path's.

With speculation a step's drafts follow its last token, and a step with drafts emits as many tokens as it
accepts: the step after it is scheduled only once it is resolved (synchronous). A step without drafts overlaps
the next launch whenever that next step would not be drafted anyway (speculative.DraftGate: the policy's load
cut-off allows none, or the drafter found nothing lately), so the non-speculative path keeps its overlap; the
drafter then only keeps its own state current (the MTP layer advances) and drafts again at the next synchronous
resolve.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence as Seq
from typing import Any
from dataclasses import dataclass

import torch

from shared import hashing
from shared.engine import kv_quant, memory
from shared.engine import speculative as spec_decode
from shared.engine.api import EngineRequest, EngineStats, RequestError, StepOutput
from shared.engine.block_manager import BlockManager
from shared.engine.config import ModelConfig
from shared.engine.drafters import Drafter, make_drafter, needs_hidden
from shared.engine.grammar import Grammars, vocabulary
from shared.engine.kv_cache import HostBuffer, KVCache, export_staged
from shared.engine.loader import LoadedModel, load
from shared.engine.model_runner import ModelRunner
from shared.engine.models import build_model
from shared.engine.ops import select_ops
from shared.engine.parallel.placement import Placement
from shared.engine.parallel.servers import ExpertServers, free_port, rank_model
from shared.engine.processors import LogitsProcessors
from shared.engine.protocols import Cache, CountsExperts, GraphsDecode, HasOwnCache
from shared.engine.sampler import (RowOp, sample, sample_on_device, token_logprobs, torch_log_softmax,
                                   torch_softmax)
from shared.engine.scheduler import Scheduler, StepPlan
from shared.engine.sequence import SamplingSpec, Sequence, Status
from shared.engine.verify_policy import make_policy
from shared.models import ModelFiles, resolve
from shared.schemas.experts import ExpertPlan
from shared.schemas.generate import MAX_LOGPROBS, SamplingParams, TokenLogprob

__all__ = ["Engine", "EngineRequest", "EngineStats", "RequestError", "StepOutput", "run_to_completion"]



def _kernels(kernels: str, deterministic: bool, device: torch.device) -> str:
    """The ops backend: --deterministic means the batch-invariant one on a GPU; the CPU keeps the torch ops."""
    if not deterministic or kernels == "deterministic":
        return kernels
    if kernels not in ("auto", "triton"):
        raise ValueError(f"--deterministic needs the Triton kernels, not {kernels!r}")
    return "deterministic" if device.type == "cuda" or kernels == "triton" else "torch"


def _row_ops(ops: str) -> tuple[RowOp, RowOp]:
    """The sampler's softmax and the logprobs' log-softmax: one program per row in a fixed order when
    deterministic (torch's kernels pick their reduction by the row length only, but are not ours to pin)."""
    if ops != "deterministic":
        return torch_softmax, torch_log_softmax
    from shared.engine.kernels import invariant

    return invariant.softmax, invariant.log_softmax


def graph_buckets(max_running: int) -> tuple[int, ...]:
    """Decode batch sizes with a CUDA graph: 1, 2, 4, 8, then every 16 up to max_running (and it)."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_running} | set(range(16, max_running, 16)) | {max_running}
    return tuple(sorted(sizes))


@dataclass
class _Logprobs:
    """A step's logprobs for the rows that asked (row indices into the step's sampled rows), host tensors that
    the step's event guards like its tokens: the sampled token's logprob, the top ids and their logprobs."""

    rows: list[int]
    counts: list[int]  # how many top ids each of those rows asked for (the tensors hold the largest count)
    chosen: torch.Tensor
    ids: torch.Tensor
    top: torch.Tensor

    def per_row(self, num_rows: int) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * num_rows
        chosen, ids, top = self.chosen.tolist(), self.ids.tolist(), self.top.tolist()
        for j, (row, k) in enumerate(zip(self.rows, self.counts)):
            out[row] = TokenLogprob(chosen[j], ids[j][:k], top[j][:k])
        return out


@dataclass
class _Launched:
    """A step on its way: its plan and its sampled tokens (a host list, or a pinned buffer an event guards)."""

    plan: StepPlan
    tokens: list[int] | torch.Tensor
    done: torch.cuda.Event | None = None
    logprobs: _Logprobs | None = None
    hidden: torch.Tensor | None = None  # its hidden rows, for a drafter that reads them (the MTP layer)

    def result(self) -> list[int]:
        if self.done is None:
            return self.tokens
        self.done.synchronize()
        return self.tokens.tolist()


QUANTIZATIONS = ("auto", "bf16")  # --quantization: as the checkpoint ships on a GPU | dequantized to bf16


class Engine:
    def __init__(
        self,
        model: str | ModelFiles | LoadedModel,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        kv_blocks: int | None = None,
        max_batch_tokens: int = 512,
        max_running: int = 64,
        kernels: str = "auto",
        cuda_graphs: bool = True,
        speculative_tokens: int = 0,
        speculative_method: str = "mtp",
        speculative_policy: str = "fixed",
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        quantization: str = "auto",
        vocabulary: Callable[[], Seq[bytes]] | None = None,
        deterministic: bool = False,
        expert_parallel: int = 1,
        kv_cache_dtype: str = "auto",
        load_format: str = "auto",
    ) -> None:
        """kernels: "torch" | "triton" | "auto" (Triton on a GPU when installed); cuda_graphs: replay decode
        steps from CUDA graphs (Triton kernels on a GPU only); speculative_tokens: at most this many drafts per
        decode step, verified in the same step (0 = off); speculative_method: who drafts them (drafters/: "mtp",
        the model's MTP layer, DeepSeek-V4; "ngram", prompt lookup, any model); speculative_policy: how many of
        them a sequence verifies per step (verify_policy.py: "fixed" K, "adaptive"); max_model_len: caps a
        sequence's tokens below the model's context; gpu_memory_utilization: the share of the GPU's total memory
        this engine may fill, weights, activations (measured) and KV pool together, as vLLM's flag (memory.py;
        None: the KV pool takes GPU_KV_FRACTION of what is free after the weights); quantization: "auto" keeps
        a checkpoint's FP8 / FP4 weights as shipped on a GPU (DeepSeek-V4's release, read by the Triton kernels),
        "bf16" dequantizes them (always so on a CPU: QUANTIZATIONS); vocabulary: each token id's bytes for
        constrained decoding (grammar.py), loaded at the first constrained request (default: the tokenizer the
        model is served with); deterministic: batch-invariant kernels on a GPU (ops.py "deterministic"): a
        request's logits are the same bits whatever its batch and whether a position came from prefill or
        decode, so a migrated continuation is token-identical in bf16 (on a CPU the torch ops, fp32, as
        always; `kernels` may still name "deterministic" there, under Triton's interpreter, for tests);
        expert_parallel: ranks the routed experts are spread over (parallel/servers.py: this process is rank 0
        and runs everything else, the others are spawned processes; DeepSeek-V4 only, without CUDA graphs);
        kv_cache_dtype: "auto" (the model's dtype), "bf16", or "fp8" (e4m3 rows with float32 scales, kv_quant.py;
        DeepSeek-V4 only so far: about half the bytes per block, twice the tokens of context in the pool);
        load_format: "auto" reads the checkpoint's weights, "dummy" only its config.json and draws random weights
        on `device` (loader/dummy.py: DeepSeek-V4 and Llama-family checkpoint directories; the cache id says so)."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
        self.device = torch.device(device)
        keep = quantization == "auto" and self.device.type == "cuda"
        # A LoadedModel lets several engines in one process share the host copy of the weights (tests, benches).
        loaded = model if isinstance(model, LoadedModel) else load(
            resolve(model) if isinstance(model, str) else model, keep_quantized=keep, load_format=load_format,
            device=self.device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.config: ModelConfig = loaded.config
        self.ops = select_ops(self.device, _kernels(kernels, deterministic, self.device))
        if expert_parallel < 1:
            raise ValueError(f"expert_parallel must be >= 1, got {expert_parallel}")
        # rank 0 of an expert-parallel worker brings only its share of the routed experts to the device
        self.model = (build_model(loaded.config, loaded.weights, self.device, self.dtype, self.ops)
                      if expert_parallel == 1 else
                      rank_model(loaded, expert_parallel, 0, self.device, self.dtype, self.ops))
        if self.ops.name == "deterministic" and not getattr(self.model, "batch_invariant", False):
            raise ValueError(f"--deterministic: no batch-invariant kernels for {loaded.config.arch} models yet "
                             "(the Llama family has them)")
        self.deterministic = self.ops.name == "deterministic"
        self._softmax, self._log_softmax = _row_ops(self.ops.name)
        self.kv_dtype = kv_quant.kv_dtype(kv_cache_dtype, self.dtype)
        if self.kv_dtype == kv_quant.FP8 and not isinstance(self.model, HasOwnCache) and self.ops.name != "torch":
            # the Llama family's Triton kernels (fused RoPE write, paged attention) read and write bf16 pages
            raise ValueError(f"--kv-cache-dtype fp8 for {loaded.config.arch} models needs the torch kernels "
                             "(--kernels torch) so far; DeepSeek-V4 has it with every kernel")
        self.experts = (self._spread_experts(model, expert_parallel, keep, load_format) if expert_parallel != 1
                        else None)
        if self.experts is not None:
            cuda_graphs = False  # the exchanges' split sizes are read on the host every layer: nothing to capture
        self.spec = self.model.cache_spec(hashing.BLOCK_TOKENS, self.kv_dtype)
        self.has_request_state = self.spec.per_request_state_bytes > 0  # V4: rings to hand over with the blocks
        self.block_tokens = self.spec.tokens_per_block  # 16 for Llama; V4: a multiple of its compress ratios (128)
        self.cache_id = f"{loaded.name}:{loaded.config.arch}:{self.spec.layout_id()}"
        self.max_batch_tokens, self.max_running = max_batch_tokens, max_running
        self.cuda_graphs = cuda_graphs
        # A sequence never outgrows the context (nor the whole cache: _build_pool)
        self.context_cap = min(self.config.max_position, max_model_len or 1 << 62)
        self.speculative = speculative_tokens
        self.drafter: Drafter | None = None
        if speculative_tokens:
            try:
                self.drafter = make_drafter(speculative_method, self.model, speculative_tokens)
            except ValueError as exc:
                raise ValueError(f"{loaded.name}: {exc}") from None
        self.policy = make_policy(speculative_policy, speculative_tokens)
        self.processors = LogitsProcessors(self.config.vocab_size, self.device)  # repetition penalty, min_tokens
        files = model if isinstance(model, ModelFiles) else None
        self.grammars = Grammars(self.config.vocab_size, vocabulary or _served_vocabulary(model, files, loaded),
                                 self.device, max_rows=max_running)
        # the CPU steps synchronously (tests may switch this on); with speculation a step with drafts is resolved
        # before the next is scheduled, the others overlap while the gate says the next would draft nothing
        self.overlap = self.device.type == "cuda"
        self.gate = spec_decode.DraftGate()
        self.overlapped = 0  # steps launched before the one ahead of them resolved (tests, benchmarks)
        self._readback = [self._pinned(max_running), self._pinned(max_running)]  # alternate: N's, N+1's
        if kv_blocks is None:
            kv_blocks = self._default_blocks(gpu_memory_utilization)
        self._build_pool(kv_blocks)
        if self.drafter is not None and not 0 < speculative_tokens <= self.kv.backtrack:
            raise ValueError(f"speculative_tokens must be in [1, {self.kv.backtrack}]")

    def _build_pool(self, num_blocks: int) -> None:
        """The KV pool of `num_blocks` blocks and everything sized by it: block manager, scheduler, runner."""
        self.kv = self._make_cache(num_blocks)
        self.block_bytes = self.kv.block_bytes
        self.blocks = BlockManager(num_blocks, self.block_tokens)
        self.scheduler = Scheduler(self.blocks, hashing.namespace(self.cache_id), self.max_batch_tokens,
                                   self.max_running,
                                   resume=lambda seq, restored: self.kv.begin(seq.request_id, restored))
        self.max_tokens = min(self.context_cap, num_blocks * self.block_tokens)
        # the packed batch metadata and CUDA graphs serve the Triton attention kernels (Llama); V4 packs its own
        # decode batch (its per-request state) and captures its own graphs (GraphsDecode), whose outputs include
        # the streams its MTP drafter reads: with speculation, the draft-free decode steps replay graphs too
        batched = self.ops.batched and not isinstance(self.model, HasOwnCache)
        own = isinstance(self.model, GraphsDecode) and self.ops.name == "triton"
        on_gpu = (batched or own) and self.cuda_graphs and self.device.type == "cuda"
        graphs = graph_buckets(self.max_running) if on_gpu else ()
        hidden = self.drafter is not None and needs_hidden(self.drafter)
        self.runner = ModelRunner(self.model, self.kv, self.device, self.block_tokens, batched=batched,
                                  max_tokens=self.max_tokens, graph_sizes=graphs, max_rows=self.max_running,
                                  keep_hidden=hidden)
        self.acceptance = spec_decode.Acceptance()
        self._inflight: _Launched | None = None
        self._steps = 0

    def _make_cache(self, num_blocks: int) -> Cache:
        """The one place a cache is made: a model with its own long-term layout (V4) makes it; Llama's K/V
        pages are the default."""
        if isinstance(self.model, HasOwnCache):
            return self.model.make_cache(num_blocks, self.max_running, self.kv_dtype)  # + per-request state slots
        return KVCache(self.spec, num_blocks, self.device, self.dtype)

    # --- requests ---------------------------------------------------------------------------------------------

    def add(self, req: EngineRequest) -> None:
        seq = self._validate(req)
        if req.sampling.constraint is not None:  # its output so far (prefill's token, a continuation's) replayed
            output = seq.token_ids[seq.num_tokens - min(seq.output_offset, seq.num_tokens):]
            self.grammars.add(seq.request_id, req.sampling.constraint, seq.stop_ids, output)
        if req.prefix_state:
            self.kv.import_state(req.request_id, req.prefix_state)  # installed at admission if it still fits
        self.scheduler.add(seq)

    def step(self) -> list[StepOutput]:
        """Outputs of one step. Overlapped: launch the next step, then resolve the one launched before."""
        while True:
            done = self._inflight or self._launch()
            if done is None:
                return []
            # a step with a constrained row is not overlapped: the next step's masks need its tokens in the matchers
            overlap = self.overlap and not self._constrained(done) and self._draftless(done)
            self._inflight = self._launch() if overlap else None
            self.overlapped += self._inflight is not None
            outputs = self._resolve(done, drafting=self._inflight is None)
            if outputs or self._inflight is None:
                return outputs  # (empty: every request of that step was aborted since; go on to the next)

    def _draftless(self, step: _Launched) -> bool:
        """Whether the step after `step` may be launched before `step` resolves: always without speculation;
        with it, when `step` verified no drafts and the gate says the next step would be drafted nothing."""
        if self.drafter is None:
            return True
        drafts = any(c.drafts for c in step.plan.chunks)
        return self.gate.overlaps(drafts, self.policy.ceiling(len(self.scheduler.running)))

    def _constrained(self, step: _Launched) -> bool:
        return bool(self.grammars.states) and any(c.sample and c.seq.request_id in self.grammars
                                                  for c in step.plan.chunks)

    def _launch(self) -> _Launched | None:
        """Schedule, run and sample one step without waiting for it (on a GPU)."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return None
        logits = self.runner.run(plan)  # (num_sampled, V)
        launched = self._sample(plan, logits)
        if self.drafter is not None and needs_hidden(self.drafter):
            launched.hidden = self.runner.hidden  # (the next launch replaces the runner's before this resolves)
        return launched

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> _Launched:
        """Sample every sampled row of the plan and commit it; tokens stay on the device until resolved."""
        # one row per sampled chunk; a chunk with drafts samples every row, at consecutive output positions
        rows = [(c, r) for c in plan.chunks if c.sample for r in range(c.num_tokens if c.drafts else 1)]
        specs = [c.seq.sampling for c, _ in rows]
        positions = [c.seq.output_position + r for c, r in rows]
        raw = logits  # what logprobs are reported from (the processors below return a new tensor)
        logits = self.processors.apply(logits, rows, positions)  # before commit: it reads the known tokens
        if self.grammars.states and any(c.seq.request_id in self.grammars for c, _ in rows):
            # the host fills the masks while the device runs the forward; masked in place, so never `raw` itself
            logits = self.grammars.apply(logits.clone() if logits is raw else logits,
                                         [(c.seq.request_id, c.drafts[:r]) for c, r in rows])
        self.scheduler.commit(plan)  # after reading output positions: it advances them
        if any(c.drafts for c in plan.chunks):  # verified at once: the next step's chunks depend on them
            sampled = sample(logits, specs, positions) if self.device.type == "cpu" else (
                sample_on_device(logits, specs, positions, self._softmax).tolist())
            logprobs = self._logprobs(raw, specs, torch.tensor(sampled, device=self.device))
            return _Launched(plan, spec_decode.verify(plan, sampled, self.processors, self.acceptance, self.policy),
                             logprobs=logprobs)
        if self.device.type == "cpu":
            tokens = sample(logits, specs, positions)
            self.processors.record(tokens)
            if self.overlap:
                self.runner.feed(torch.tensor(tokens, dtype=torch.long))
            return _Launched(plan, tokens, logprobs=self._logprobs(raw, specs, torch.tensor(tokens)))
        # on the device, batched; the one host round trip is reading the tokens back, one step later
        dev_tokens = sample_on_device(logits, specs, positions, self._softmax)  # (N,) int64
        self.processors.record(dev_tokens)
        if self.overlap:
            self.runner.feed(dev_tokens)
        logprobs = self._logprobs(raw, specs, dev_tokens)  # copies queued before the event: it guards them too
        self._steps += 1
        host = self._readback[self._steps % 2][: len(rows)]
        host.copy_(dev_tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Launched(plan, host, event, logprobs)

    def _logprobs(self, raw: torch.Tensor, specs: list[SamplingSpec], tokens: torch.Tensor) -> _Logprobs | None:
        """The step's logprobs for the rows that asked, copied towards the host without waiting (None: none did)."""
        rows = [i for i, s in enumerate(specs) if s.logprobs >= 0]
        if not rows:
            return None
        counts = [specs[i].logprobs for i in rows]
        parts = token_logprobs(raw, rows, tokens.to(raw.device), max(counts), self._log_softmax)
        if self.device.type == "cuda":  # into pinned memory, so the copies do not wait for the device
            parts = tuple(torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p, non_blocking=True)
                          for p in parts)
        return _Logprobs(rows, counts, *parts)

    def _resolve(self, done: _Launched, drafting: bool = True) -> list[StepOutput]:
        """A launched step's tokens into outputs (waiting for them on a GPU); the next drafts (when `drafting`:
        no step is in flight); finished requests' state dropped."""
        outputs = self.scheduler.resolve(done.plan, done.result())
        if done.logprobs is not None:
            self._attach_logprobs(done, outputs)
        if self.drafter is not None:
            # the next step's decodes, about: the load the policy weighs
            budget = spec_decode.Budget(self.policy, len(self.scheduler.running), drafting)
            self.drafter.propose(self.kv, done.plan, done.hidden, self.scheduler, budget)
            if drafting:
                self.gate.drafted(any(c.seq.drafts for c in done.plan.chunks))
        for out in outputs:
            if out.token_ids and self.grammars.states:
                self.grammars.accept(out.request_id, out.token_ids)
            if out.finish_reason is not None:
                self.grammars.drop(out.request_id)
                self.processors.drop(out.request_id)
                self.policy.drop(out.request_id)
                if out.request_id not in self.scheduler.held:
                    self.kv.drop_state(out.request_id)  # held requests keep it for export until release()
        return outputs

    def _attach_logprobs(self, done: _Launched, outputs: list[StepOutput]) -> None:
        """Each output's tokens get their rows' logprobs: a chunk's rows are its sampled positions in order, so a
        verified speculative chunk's tokens (accepted drafts, then the model's own) are its first rows."""
        assert done.logprobs is not None
        chunks = [c for c in done.plan.chunks if c.sample]
        sizes = [c.num_tokens if c.drafts else 1 for c in chunks]
        per_row = done.logprobs.per_row(sum(sizes))
        first, at = {}, 0
        for c, n in zip(chunks, sizes):
            first[c.seq.request_id] = per_row[at : at + n]
            at += n
        for out in outputs:
            mine = first.get(out.request_id)
            if out.token_ids and mine and mine[0] is not None:
                out.logprobs = [lp for lp in mine[: len(out.token_ids)] if lp is not None]

    def _pinned(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.long, pin_memory=self.device.type == "cuda")

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self.kv.drop_state(request_id)
            self.processors.drop(request_id)
            self.policy.drop(request_id)
            self.grammars.drop(request_id)

    def release(self, request_id: str) -> None:
        if self.scheduler.release(request_id) is not None:
            self.kv.drop_state(request_id)
            self.processors.drop(request_id)
            self.grammars.drop(request_id)

    # --- KV export --------------------------------------------------------------------------------------------

    def export_blocks(self, request_id: str, start: int, end: int) -> list[bytes]:
        """Blobs of blocks [start, end) of a running or held request; the last may be partial (full size)."""
        return self.kv.read_blocks(self._exported(request_id, start, end))

    def export_into(self, request_id: str, start: int, end: int, out: HostBuffer) -> None:
        """Blocks [start, end) as export_blocks gives them, one after another into `out` (writable,
        (end - start) * block_bytes bytes: an arena slot, a pinned buffer), with one copy."""
        self.kv.export_run(self._exported(request_id, start, end), out)

    def export_parts(self, request_id: str, base: int, parts: Seq[tuple[int, int, HostBuffer]]) -> None:
        """Blocks base + [lo, hi) into each part's buffer (a put round's arena slots), as export_into each, but a
        GPU gathers them in a few large pieces and waits once (kv_cache.export_staged)."""
        runs = [(self._exported(request_id, base + lo, base + hi), out) for lo, hi, out in parts]
        export_staged(self.kv.export_run, runs, self.kv.block_bytes, self.device)

    def _exported(self, request_id: str, start: int, end: int) -> list[int]:
        """The cache blocks behind blocks [start, end) of a request, checked to hold computed KV."""
        seq = self._live(request_id)
        computed_blocks = -(-seq.num_computed // self.block_tokens)
        if not 0 <= start <= end <= computed_blocks:
            raise ValueError(f"{request_id}: blocks [{start}, {end}) outside the {computed_blocks} with KV")
        return seq.block_table[start:end]

    def export_state(self, request_id: str) -> bytes:
        """The request's short-term state after its computed tokens (b"" for models without one)."""
        seq = self._live(request_id)
        return self.kv.export_state(request_id, seq.num_computed)

    def cached_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` (this engine's chained keys) its own prefix cache holds now: a
        worker need not fetch those, it passes b"" for them (and the scheduler checks again at admission)."""
        return self.blocks.cached_prefix(hashes)

    @property
    def replay_tokens(self) -> int:
        """Tokens recomputed before a prefix restored without its short-term state (0: nothing to rebuild)."""
        return self.kv.replay_tokens

    # --- expert parallelism (parallel/servers.py) --------------------------------------------------------------

    def _spread_experts(self, model: str | ModelFiles | LoadedModel, world: int, keep: bool, load_format: str
                        ) -> ExpertServers:
        if isinstance(model, LoadedModel):
            raise ValueError("expert parallelism needs the checkpoint's path: every rank loads it itself")
        files = resolve(model) if isinstance(model, str) else model
        return ExpertServers(self.model, files, world, self.device, self.dtype, keep, free_port(), load_format)

    def apply_expert_plan(self, plan: ExpertPlan) -> int:
        """Between two steps: every rank switches to the plan's placement (ValueError when it is not one of this
        worker's ranks and experts). Returns the bytes of expert weights rank 0 received."""
        if self.experts is None:
            raise ValueError("a worker on one rank holds every expert once: no plan to apply")
        return self.experts.apply(Placement.from_plan(plan))

    @property
    def expert_ranks(self) -> int:
        """Ranks the routed experts are spread over (1: all of them here)."""
        return 1 if self.experts is None else self.experts.group.world

    @property
    def expert_plan_version(self) -> int:
        """The ExpertPlan the ranks run (0: the initial placement, expert e in slot e)."""
        return 0 if self.experts is None else self.experts.ep.placement.version

    def close(self) -> None:
        """Stops the other ranks of an expert-parallel engine (nothing to do on one rank)."""
        if self.experts is not None:
            self.experts.close()
            self.experts = None

    # --- introspection ----------------------------------------------------------------------------------------

    def expert_counts(self) -> torch.Tensor | None:
        """(layers, experts) int64 on the host: the token-expert pairs the model routed since it was loaded (a
        copy, so one device sync: read it every few seconds, not per step); None for a model without routed
        experts."""
        if not isinstance(self.model, CountsExperts):
            return None
        return self.model.expert_counts.to("cpu", copy=True)  # .cpu() of a CPU tensor would be the live buffer

    @property
    def expert_bytes(self) -> int:
        """One routed expert's weights in bytes as loaded (0 without routed experts)."""
        return self.model.expert_bytes if isinstance(self.model, CountsExperts) else 0

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._inflight)

    @property
    def spec_drafted(self) -> int:
        return self.acceptance.drafted

    @property
    def spec_accepted(self) -> int:
        return self.acceptance.accepted

    @property
    def spec_verifies(self) -> int:
        return self.acceptance.verifies

    def policy_state(self) -> dict:
        """The verify-length policy's per-request history (empty for fixed K; tests check it is dropped)."""
        return dict(getattr(self.policy, "history", {}))

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            free_blocks=self.blocks.num_free,
            total_blocks=self.blocks.num_blocks,
            running=len(s.running),
            waiting=len(s.waiting),
            queued_tokens=s.queued_tokens(),
            held=len(s.held),
            drafted=self.spec_drafted,
            accepted=self.spec_accepted,
            verifies=self.spec_verifies,
        )

    # --- internals --------------------------------------------------------------------------------------------

    def _validate(self, req: EngineRequest) -> Sequence:
        """The request's Sequence; RequestError for what the client asked wrong, ValueError for a worker's
        mistake (ids, prefixes)."""
        n = len(req.token_ids)
        if not req.request_id or req.request_id in self.scheduler.seqs:
            raise ValueError(f"request id {req.request_id!r} is empty or already in use")
        if n == 0:
            raise RequestError("empty prompt")
        if n >= self.max_tokens:
            raise RequestError(f"{n} tokens leave no room to generate (limit {self.max_tokens} tokens)")
        if any(not 0 <= t < self.config.vocab_size for t in req.token_ids):
            raise RequestError(f"token ids must be in [0, {self.config.vocab_size})")
        if req.max_new_tokens < 1 or req.output_offset < 0:
            raise RequestError("max_new_tokens must be >= 1 and output_offset >= 0")
        if not 0 <= req.prefix_tokens <= n:
            raise ValueError(f"prefix_tokens {req.prefix_tokens} outside [0, {n}]")
        if len(req.prefix_blocks) != -(-req.prefix_tokens // self.block_tokens):
            raise ValueError(f"{len(req.prefix_blocks)} prefix blocks for {req.prefix_tokens} prefix tokens")
        if any(len(b) not in (0, self.block_bytes) for b in req.prefix_blocks):
            raise ValueError(f"prefix blocks must be {self.block_bytes} bytes each (or b'' for one held here)")
        sp = req.sampling
        if any(not 0 <= t < self.config.vocab_size for t in sp.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {self.config.vocab_size})")
        if sp.reasoning_budget >= 0 and not 0 <= sp.reasoning_end < self.config.vocab_size:
            raise RequestError(f"reasoning_end must be a token id in [0, {self.config.vocab_size})")
        stop = req.stop_token_ids
        if stop is None:
            stop = [*sp.stop_token_ids, *(() if sp.ignore_eos else self.config.eos_ids)]
        if sp.constraint is not None:  # a complete grammar allows only its stop ids: EOS ends it even with ignore_eos
            stop = [*stop, *self.config.eos_ids]
        return Sequence(
            request_id=req.request_id,
            token_ids=list(req.token_ids),
            sampling=sampling_spec(sp),
            stop_ids=frozenset(stop),
            max_new_tokens=min(req.max_new_tokens, self.max_tokens - n),
            output_offset=req.output_offset,
            hold_kv=req.hold_kv,
            ns=hashing.namespace(self.cache_id, req.cache_salt),
            prefix_blobs=list(req.prefix_blocks),
            prefix_tokens=req.prefix_tokens,
        )

    def _live(self, request_id: str) -> Sequence:
        seq = self.scheduler.seqs.get(request_id)
        if seq is None or seq.status is Status.WAITING:
            raise ValueError(f"{request_id}: not a running or held request")
        return seq

    def _default_blocks(self, utilization: float | None) -> int:
        """Blocks of the KV pool from the device's memory (memory.py): on a GPU with a share, what the share
        leaves after the weights, the measured activation peak and the per-request state."""
        if self.device.type != "cuda":
            return max(1, memory.CPU_KV_BYTES // self.spec.bytes_per_block)
        peak = self.activation_peak() if utilization is not None else 0
        state = 2 * self.max_running * self.spec.per_request_state_bytes  # V4 pools running + held (make_cache)
        pool = memory.kv_pool_bytes(memory.probe(self.device, peak), utilization, state)
        return max(1, pool // self.spec.bytes_per_block)

    def warm_up(self) -> int:
        """Capture every decode CUDA graph bucket now (a decode worker, before it takes requests): captured on
        first use instead, each new (batch, context) bucket stalls the running streams while it is captured.
        Returns the graphs captured (0 without graphs, e.g. on a CPU)."""
        graphs = self.runner.graphs
        return graphs.warm_up() if graphs is not None else 0

    def warm_up_prefill(self) -> int:
        """Run the kinds of prompt a prefill worker meets once now, before it takes requests: a cold prompt, a
        follow-up on its cached blocks and the first prompt's snapshot (its end state), one on its cached blocks
        alone (the replay). A first use compiles (torch.compile traces each fused function again in every new
        process; Triton specialises integer arguments that are 1 or a multiple of 16), and on the GPU that was
        seconds added to the first follow-up after a worker restart. Their blocks are dropped from the prefix
        cache afterwards. Returns the prompt tokens run (0 when the pool or the context cannot hold them)."""
        bt, vocab = self.block_tokens, self.config.vocab_size
        n = 2 * bt + 37  # neither start nor length a multiple of 16 in the follow-ups below
        if 2 * n + 64 >= self.max_tokens or self.blocks.num_free < 3 * (n // bt + 3):
            return 0
        greedy = SamplingParams(temperature=0)

        def prompt(length: int, seed: int) -> list[int]:
            return [(seed + 7 * i) % vocab for i in range(length)]

        def run(rid: str, tokens: list[int], **prefix: Any) -> list[int]:
            return run_to_completion(self, [EngineRequest(rid, tokens, greedy, 1, cache_salt="warm-up", **prefix)])[rid]

        first = prompt(n, 3)
        answer = run("warm-up-cold", first, hold_kv=True)
        state = self.export_state("warm-up-cold") if self.has_request_state else b""
        partial = self.export_blocks("warm-up-cold", n // bt, -(-n // bt))
        self.release("warm-up-cold")
        follow_up = first + answer + prompt(45, 5)
        run("warm-up-snapshot", follow_up, prefix_blocks=[b""] * (n // bt) + partial, prefix_tokens=n,
            prefix_state=state)
        replay = first[: 2 * bt] + prompt(51, 11)
        run("warm-up-replay", replay)
        self.blocks.drop_cached()
        return len(first) + len(follow_up) + len(replay)

    def memory(self) -> memory.MemoryReport:
        """Weights, KV pool and the tokens of context it holds (the worker logs it once, at load)."""
        state = 2 * self.max_running * self.spec.per_request_state_bytes if self.has_request_state else 0
        # a model that keeps its weights apart (V4) has other tensors beside them (its expert counts): not weights
        weights = getattr(self.model, "weights", self.model)
        return memory.MemoryReport(memory.held_bytes(weights), self.blocks.num_blocks * self.spec.bytes_per_block,
                                   self.blocks.num_blocks, self.block_tokens, state, self.context_cap,
                                   str(self.kv_dtype).removeprefix("torch."))

    def activation_peak(self) -> int:
        """Bytes one step of max_batch_tokens fresh prompt tokens allocates above what the engine holds (its
        activations, logits and scratch), measured by running one on a pool just big enough for it. The engine
        is left without a pool: _build_pool makes the real one. 0 on a CPU (nothing to measure)."""
        n = max(1, min(self.max_batch_tokens, self.context_cap - 1))
        self._build_pool(n // self.block_tokens + 2)
        gpu = self.device.type == "cuda"
        if gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        prompt = [i % self.config.vocab_size for i in range(n)]
        run_to_completion(self, [EngineRequest("profile", prompt, SamplingParams(temperature=0), 1)])
        peak = torch.cuda.max_memory_allocated(self.device) - base if gpu else 0
        del self.kv, self.runner, self.scheduler, self.blocks
        if gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the profile's pool and scratch go back to the device
        return peak


def sampling_spec(sp: SamplingParams) -> SamplingSpec:
    """Validate a request's sampling fields (RequestError names the first bad one) and draw a seed if it has none.

    min_tokens is checked against the request's whole max_tokens: a prefill engine generates one of them."""
    checks = (
        (sp.temperature >= 0, f"temperature must be >= 0, got {sp.temperature}"),
        (0 < sp.top_p <= 1, f"top_p must be in (0, 1], got {sp.top_p}"),
        (sp.top_k >= 0, f"top_k must be >= 0, got {sp.top_k}"),
        (0 <= sp.min_p <= 1, f"min_p must be in [0, 1], got {sp.min_p}"),
        (0 < sp.repetition_penalty < math.inf, f"repetition_penalty must be > 0, got {sp.repetition_penalty}"),
        (0 <= sp.min_tokens <= sp.max_tokens,
         f"min_tokens must be in [0, max_tokens = {sp.max_tokens}], got {sp.min_tokens}"),
        (-2 <= sp.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {sp.presence_penalty}"),
        (-2 <= sp.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {sp.frequency_penalty}"),
        (all(-100 <= b <= 100 for b in sp.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
        (sp.logprobs is None or 0 <= sp.logprobs <= MAX_LOGPROBS,
         f"logprobs must be in [0, {MAX_LOGPROBS}], got {sp.logprobs}"),
        (sp.reasoning_budget < 0 or sp.reasoning_end >= 0, "a reasoning_budget needs its reasoning_end token"),
    )
    for ok, message in checks:  # (NaN fails every comparison, so it is refused too)
        if not ok:
            raise RequestError(message)
    seed = sp.seed if sp.seed is not None else secrets.randbits(63)
    # a zero bias changes nothing: leaving it out keeps a request that sends only zeros off the processors
    bias = tuple(sorted((int(t), float(b)) for t, b in sp.logit_bias.items() if b != 0))
    return SamplingSpec(sp.temperature, sp.top_k, sp.top_p, seed, sp.min_p, sp.repetition_penalty, sp.min_tokens,
                        sp.presence_penalty, sp.frequency_penalty, bias, -1 if sp.logprobs is None else sp.logprobs,
                        reasoning_budget=max(sp.reasoning_budget, -1), reasoning_end=sp.reasoning_end)


def _served_vocabulary(model: str | ModelFiles | LoadedModel, files: ModelFiles | None,
                       loaded: LoadedModel) -> Callable[[], list[bytes]]:
    """The vocabulary of the tokenizer a model is served with, loaded when first asked for (a LoadedModel is
    found again by its name)."""

    def load() -> list[bytes]:
        from shared.deepseek_tokenizer import served_tokenizer  # (tokenizers, not torch: only when needed)

        try:
            tk = served_tokenizer(files or resolve(model if isinstance(model, str) else loaded.name))
        except Exception as exc:  # no tokenizer to be found: no constrained decoding on this engine
            raise RequestError(f"constrained decoding needs the model's tokenizer: {exc}") from None
        return vocabulary(tk.token_bytes, tk.is_special, tk.vocab_size, tk.markup_ids)

    return load


def run_to_completion(engine: Engine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    """Offline use (CLI, tests, benchmarks): add `requests`, step until all finish, return generated tokens."""
    out: dict[str, list[int]] = {}
    for req in requests:
        engine.add(req)
        out[req.request_id] = []
    pending = set(out)
    while pending:
        step = engine.step()
        if not step:
            break  # nothing could run (only blocks held for export left): stepping again changes nothing
        for o in step:
            if o.request_id in out:
                out[o.request_id] += o.token_ids
                if o.finish_reason is not None:
                    pending.discard(o.request_id)
    return out
