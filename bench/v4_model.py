"""A whole DeepSeek-V4-Flash-width model on one GPU, through the Engine: decode and prefill against transformers
eager on the same weights and against the byte and FLOP floors (issue 12, item 7).

    python bench/v4_model.py --out bench/results/2026-12-01-v4-model-h200.md [--shape 43x32,8x256]
        [--batches 1,8,32,128] [--ctx 4096,65536] [--prefill 8192,78848] [--skip-hf] [--steps 8] [--tiny]
    python bench/v4_model.py --quantized --skip-hf [--shape 43x32,43x128q]     (issue 15's quantized row)

Two shapes, random bf16 weights built in memory (never a checkpoint on disk: a 43-layer one would not fit the
GPU machine's disk): 43 layers x 32 routed experts (batch 1 touches as many experts as the real model's 256:
6 + 1 shared per layer) and 8 layers x 256 experts (batched MoE as the real model sees it). Width as V4-Flash:
hidden 4096, 64 heads of 512 (one shared K = V head), q_lora 1024, 8 output groups of rank 1024, window 128,
index 64 x 128 top-512, experts of 2048 (top 6 + 1 shared), vocab 129280, 4 mHC streams, 3 hash-routed layers.
Layer schedule as V4-Flash's compress_ratios: two sliding-window layers, then CSA (ratio 4) and HCA (ratio 128)
alternating, CSA first (the 8-layer shape takes the first 8). Both models come from one transformers
DeepseekV4Config, ours through the loader's own parse_spec, so they agree on every dimension.

Weights: each tensor is drawn from a generator seeded by its name (shared/engine/loader/dummy.py's
`RandomWeights`, what `--load-format dummy` serves), on the GPU, when the model asks for it, so neither model
ever holds a second copy and both get the same numbers: ours stacks the experts as it loads; transformers' model
is built empty in bf16 and filled through the hub-name views of tests/v4_checkpoints.hub_state_dict. The two
models are never resident together (ours is freed first).

Ours, through the Engine (scheduler, sampling and overlapped steps in the measurement): decode at batch B with a
`ctx`-token context per sequence: the contexts are random cache contents (the compressed entries of every block
and each request's rings), not a real prefill: a real 64K prefill of 128 sequences would take the run's whole
time; B sequences are placed in the scheduler as running with their blocks allocated, then engine.step() is
timed for --steps steps. Prefill: one fresh prompt through the engine (max_batch_tokens = the 8K chunk, so a
77K prompt runs as 8K chunks), first token out, after one untimed chunk-sized prompt.

transformers 5.24 eager: a real prefill of B x ctx tokens, then one decode step with its cache (timed); an 8K
prompt in one forward. Cases past --hf-max-ctx are not run (eager attention materialises heads x q x k
scores); out of memory is reported as such.

Quantized (`--quantized`, or a shape name ending in q): the model as DeepSeek ships V4-Flash, random weights
quantized in memory as they are drawn (loader/dummy.py's `QuantizedWeights`, what `--load-format dummy` serves
for a config.json with a quantization_config): FP8 e4m3 attention projections, compressors, indexer and shared expert
with 128 x 128 power-of-two block scales, FP4 e2m1 routed experts with an e8m0 scale per 32 columns; embedding,
head (bf16, as DeepSeek's releases keep it), router, norms and mHC in bf16. 43x128q is the issue's V4-Flash shape:
all 43 layers, 128 routed experts each, ~80 GB. Its byte floor counts those bytes; the bf16 floor of the same
shape is printed beside it (a bf16 43x128 does not fit one H200: at batch 1 the 43x32 bf16 row reads the same
bytes, 6 + 1 experts per layer). Prefill's FLOP floor for quantized rows is at twice the measured bf16 matmul
rate (Hopper's FP8 tensor cores). `--quantized` also times the FP8 GEMM (weight-only and per-token FP8
activations, kernels/fp8_gemm.py) against bf16 cuBLAS at V4-Flash's projection shapes: which way prefill
should run is kernels/fp8_gemm.py PREFILL_ACT.

Floors, from two ceilings measured in the same run (bench/timing.py: copy bytes/s, bf16 matmul FLOP/s), summed
over the layers with bench/v4_layer.py's per-layer account (weights read once per step, the experts the batch
touches, KV read per sequence; 2 x active parameters per token + attention) plus the head.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import ceilings, kernel_rows  # noqa: E402
from bench.v4_layer import Costs  # noqa: E402
from shared.engine.api import RequestError  # noqa: E402
from shared.engine.config import ModelConfig  # noqa: E402
from shared.engine.engine import Engine, EngineRequest, run_to_completion  # noqa: E402
from shared.engine.kv_quant import KV_CACHE_DTYPES, kv_dtype  # noqa: E402
from shared.engine.loader import LoadedModel  # noqa: E402
from shared.engine.loader import deepseek_v4  # noqa: E402
from shared.engine.loader.deepseek_v4 import parse_spec  # noqa: E402
from shared.engine.loader.dummy import QuantizedWeights, RandomWeights, v4_table  # noqa: E402
from shared.engine.models.deepseek_v4.cache import V4Cache  # noqa: E402
from shared.engine.models.deepseek_v4.spec import DeepseekV4Spec  # noqa: E402
from shared.engine.sequence import Status  # noqa: E402
from shared.schemas.generate import SamplingParams  # noqa: E402

T0 = time.time()
GiB = 1 << 30
C, H = "compressed_sparse_attention", "heavily_compressed_attention"
FLASH = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_attention_heads=64, head_dim=512,
             q_lora_rank=1024, num_experts_per_tok=6, n_shared_experts=1, sliding_window=128, o_groups=8,
             o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
             max_position_embeddings=1 << 20)
TINY = dict(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
            q_lora_rank=48, partial_rotary_factor=0.5, num_experts_per_tok=2, n_shared_experts=1, sliding_window=8,
            o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=8, hc_mult=4,
            max_position_embeddings=4096, compress_rates={C: 4, H: 16})
SHAPES = {"43x32": (43, 32), "8x256": (8, 256), "43x128": (43, 128)}
TINY_SHAPES = {"4x8": (4, 8), "3x16": (3, 16)}
FP8_BYTES = 1 + 4 / (128 * 128)  # per weight: e4m3 + a float32 scale per 128 x 128 block
FP4_BYTES = 0.5 + 1 / 32  # per weight: half a byte + an e8m0 byte per 32 columns
GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# --- the model ------------------------------------------------------------------------------------------------


def flash_layers(n: int) -> list[str]:
    """V4-Flash's schedule as transformers' DeepseekV4Config defaults spell it (its first n layers)."""
    from transformers import DeepseekV4Config

    return list(DeepseekV4Config().layer_types[:n])


def hf_config(layers: int, experts: int, tiny: bool) -> Any:
    from transformers import DeepseekV4Config

    dims = TINY if tiny else FLASH
    return DeepseekV4Config(**dims, num_hidden_layers=layers, n_routed_experts=experts,
                            layer_types=flash_layers(layers), num_nextn_predict_layers=0)


def model_config(spec: DeepseekV4Spec) -> ModelConfig:
    return deepseek_v4.model_config({}, spec)  # config.json's defaults: untied head, bos 0, eos 1


# --- floors ---------------------------------------------------------------------------------------------------


class ModelCosts:
    """Bytes and FLOPs of one step of the whole model: v4_layer's per-layer account over the schedule + the head.
    quantized: weights at DeepSeek's shipped sizes (FP8 attention and shared expert, FP4 routed experts; the KV,
    router, mHC and head at elem bytes)."""

    def __init__(self, s: DeepseekV4Spec, elem: int, quantized: bool = False) -> None:
        self.layers = [Costs(dataclasses.replace(s, num_layers=1, kinds=(k,), ratios=(m,), hash_layers=0), elem)
                       for k, m in zip(s.kinds, s.ratios)]
        self.head = s.vocab_size * s.hidden_size
        self.elem, self.quantized = elem, quantized

    def _weight_bytes(self, c: Costs, tokens: int) -> float:
        s = c.s
        if not self.quantized:
            return (c.dense + c.experts_touched(tokens) * c.expert) * self.elem
        plain = s.num_experts * s.hidden_size + 2 * (2 + s.hc_mult) * s.hc_mult * s.hc_mult * s.hidden_size
        routed = c.experts_touched(tokens) - s.num_shared_experts
        return ((c.dense - plain) * FP8_BYTES + plain * self.elem + routed * c.expert * FP4_BYTES
                + s.num_shared_experts * c.expert * FP8_BYTES)

    def decode(self, batch: int, ctx: int) -> tuple[float, float]:
        kv = sum(batch * c.keys(ctx)[1] * self.elem for c in self.layers)
        flops = sum(c.decode(batch, ctx)[1] for c in self.layers) + 2 * self.head * batch
        return sum(self._weight_bytes(c, batch) for c in self.layers) + kv + self.head * self.elem, flops

    def prefill(self, n: int, chunk: int) -> tuple[float, float]:
        """A prompt of n tokens in chunks: the weights are read once per chunk."""
        chunks = -(-n // chunk)
        flops = sum(c.prefill(n)[1] for c in self.layers) + 2 * self.head * chunks  # the head: a row per chunk
        return chunks * (sum(self._weight_bytes(c, n) for c in self.layers) + self.head * self.elem), flops


# --- ours -----------------------------------------------------------------------------------------------------


def place_running(engine: Engine, rids: list[str], ctx: int, steps: int) -> None:
    """B sequences with a ctx-token context already in the cache (random blocks and rings), running: the next
    step decodes their token ctx. (The scheduler's own admission would prefill the ctx tokens first.)"""
    cache: V4Cache = engine.kv  # type: ignore[assignment]
    bt = engine.block_tokens
    for i, rid in enumerate(rids):
        seq = engine._validate(EngineRequest(rid, [(7 * i + t) % engine.config.vocab_size for t in range(ctx + 1)],
                                             GREEDY, steps + 8))
        table = engine.blocks.allocate(-(-(ctx + 1) // bt))
        if table is None:
            raise MemoryError(f"{len(rids)} x {ctx} tokens do not fit the {engine.blocks.num_blocks}-block pool")
        seq.block_table, seq.num_computed, seq.num_cached = table, ctx, ctx
        seq.num_published = ctx // bt  # random contents: never offered to the prefix cache
        seq.status = Status.RUNNING
        engine.scheduler.seqs[rid] = seq
        engine.scheduler.running.append(seq)
        cache.begin(rid, 0)
        state = cache.states[rid]
        state.length, state.begin, state.frozen = ctx, 0, 0
        for t in state.tensors():
            t.normal_()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ours_decode(engine: Engine, batch: int, ctx: int, steps: int) -> float:
    """Seconds per decode step of `batch` sequences at `ctx` (engine.step() after 2 warm-up steps)."""
    rids = [f"d{batch}-{ctx}-{i}" for i in range(batch)]
    try:
        place_running(engine, rids, ctx, steps + 2)
        for _ in range(2):
            engine.step()
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        return (time.perf_counter() - t) / steps
    finally:
        for rid in rids:
            engine.abort(rid)
        while engine.has_work():  # the overlapped step still in flight
            engine.step()


def kernel_breakdown(engine: Engine, batch: int, ctx: int, top: int = 25) -> tuple[list[tuple[str, float, int]], float]:
    """Per-kernel GPU time of one decode step at `batch` x `ctx` (eager: every launch its own row), top kernels
    as (name, us per step, launches per step), and the sum over every kernel (us per step)."""
    from torch.profiler import ProfilerActivity, profile

    steps = 3
    rids = [f"k{batch}-{ctx}-{i}" for i in range(batch)]
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        place_running(engine, rids, ctx, steps + 4)
        for _ in range(2):
            engine.step()
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            sync()
    finally:
        engine.runner.graphs = graphs
        for rid in rids:
            engine.abort(rid)
        while engine.has_work():
            engine.step()
    rows = kernel_rows(prof, steps)
    return rows[:top], sum(r[1] for r in rows)


def kernel_table(name: str, batch: int, ctx: int, rows: list[tuple[str, float, int]], total: float,
                 step_s: float | str) -> str:
    step = f"{step_s * 1e6:,.0f} us" if isinstance(step_s, float) else str(step_s)
    lines = ["", f"## Where a decode step's GPU time goes: {name}, batch {batch}, context {ctx:,}", "",
             f"Kernel time summed over every launch: {total:,.0f} us per step; the step with CUDA graphs: {step}.", "",
             "| kernel | us per step | launches per step | share |", "|---|---|---|---|"]
    for k, us, n in rows:
        lines.append(f"| `{k.replace('|', '/')}` | {us:,.0f} | {n} | {100 * us / total:.1f} % |")
    return "\n".join(lines) + "\n"


def ours_prefill(engine: Engine, n: int, tag: str) -> float:
    """Seconds from adding a fresh n-token prompt to its first token."""
    offset = zlib.crc32(tag.encode())  # no prefix shared between prompts (the prefix cache would skip it)
    prompt = [(11 * t + offset) % engine.config.vocab_size for t in range(n)]
    sync()
    t = time.perf_counter()
    run_to_completion(engine, [EngineRequest(tag, prompt, GREEDY, 1)])
    sync()
    return time.perf_counter() - t


def prefill_breakdown(engine: Engine, n: int, top: int = 30) -> tuple[list[float], list[tuple[str, float, int]], float]:
    """One fresh n-token prompt, chunk by chunk: each step's wall seconds (synchronised, so overlap is lost) and
    its per-kernel GPU time over the whole prompt (name, us per prompt, launches per prompt), with the total."""
    from torch.profiler import ProfilerActivity, profile

    offset = zlib.crc32(b"kernels")
    prompt = [(13 * t + offset) % engine.config.vocab_size for t in range(n)]
    steps: list[float] = []
    engine.add(EngineRequest("prefill-kernels", prompt, GREEDY, 1))
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities, record_shapes=cuda) as prof:
        done = False
        while not done:
            sync()
            t = time.perf_counter()
            out = engine.step()
            sync()
            steps.append(time.perf_counter() - t)
            done = not out or any(o.request_id == "prefill-kernels" and o.finish_reason is not None for o in out)
    while engine.has_work():
        engine.step()
    rows = kernel_rows(prof, 1) if cuda else []  # on a CPU only the chunk times (the script's check)
    if cuda:
        log("prefill: where the copies come from\n" + copy_sources(prof))
    return steps, rows[:top], sum(r[1] for r in rows)


COPY_OPS = ("aten::copy_", "aten::cat", "aten::index", "aten::index_put_", "aten::clone", "aten::contiguous")


def copy_sources(prof: Any, top: int = 15) -> str:
    """The torch ops that move bytes (copies, cats, gathers, scatters) by their GPU time, with their input
    shapes (which tensors they are): what the kernel table's copy rows are."""
    events = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in COPY_OPS]
    events.sort(key=lambda e: -(getattr(e, "device_time_total", 0) or 0))
    lines = []
    for e in events[:top]:
        t = (getattr(e, "device_time_total", 0) or 0) / 1e3
        lines.append(f"  {t:8.1f} ms  {e.count:6d}x  {e.key:18s} {str(e.input_shapes)[:110]}")
    return "\n".join(lines)


def prefill_table(name: str, n: int, steps: list[float], rows: list[tuple[str, float, int]], total: float) -> str:
    lines = ["", f"## Where a {n:,}-token prefill's GPU time goes: {name}", "",
             "Each engine step (one chunk, synchronised): " + ", ".join(f"{s * 1e3:,.0f}" for s in steps) + " ms; "
             f"{sum(steps):,.2f} s in all. Kernel time summed over every launch: {total / 1e3:,.0f} ms.", "",
             "| kernel | ms per prompt | launches | share |", "|---|---|---|---|"]
    for k, us, c in rows:
        lines.append(f"| `{k.replace('|', '/')}` | {us / 1e3:,.1f} | {c} | {100 * us / total:.1f} % |")
    return "\n".join(lines) + "\n"


# --- transformers eager ---------------------------------------------------------------------------------------


def hf_model(config: Any, weights: RandomWeights, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import DeepseekV4ForCausalLM

    from tests.v4_checkpoints import hub_state_dict

    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: an fp32 copy of 80 GB would not fit
    try:
        with torch.device(device):
            model = DeepseekV4ForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype).eval()
    finally:
        torch.set_default_dtype(saved)
    with torch.no_grad():
        for name, view in hub_state_dict(model).items():
            view.copy_(weights[name])
    return model


def hf_decode(model: Any, batch: int, ctx: int, vocab: int, device: torch.device) -> float:
    """Seconds of one decode step after a real prefill of batch x ctx tokens (median of 3)."""
    ids = torch.randint(0, vocab, (batch, ctx), device=device)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        times = []
        for _ in range(3):
            sync()
            t = time.perf_counter()
            out = model(nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            times.append(time.perf_counter() - t)
    return sorted(times)[1]


def hf_prefill(model: Any, n: int, vocab: int, device: torch.device) -> float:
    ids = torch.randint(0, vocab, (1, n), device=device)
    with torch.no_grad():
        sync()
        t = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        sync()
    return time.perf_counter() - t


def guarded(fn: Any, *args: Any) -> float | str:
    """fn's seconds, or why there are none (out of memory, a pool too small)."""
    try:
        return fn(*args)
    except torch.OutOfMemoryError:
        why = "out of memory"
    except MemoryError as exc:
        why = f"does not fit ({exc})"
    except RequestError as exc:  # the pool left too few blocks for the case
        why = f"does not fit ({exc})"
    gc.collect()  # after the except block: the traceback no longer holds the failed call's tensors
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return why


# --- one shape ------------------------------------------------------------------------------------------------


def run_shape(name: str, layers: int, experts: int, args: argparse.Namespace, device: torch.device,
              dtype: torch.dtype, bw: float, flops: float, quantized: bool = False) -> tuple[list[dict], str]:
    config = hf_config(layers, experts, args.tiny)
    spec = parse_spec(config.to_dict())
    dense = RandomWeights(v4_table(spec), device)
    weights = QuantizedWeights(dense.table, device) if quantized else dense  # the same draws, quantized
    costs = ModelCosts(spec, dtype.itemsize, quantized)
    bf16_costs = ModelCosts(spec, dtype.itemsize)
    weight_gib = weights.nbytes(dtype.itemsize) / GiB
    if quantized:
        flops *= 2  # the FLOP floor of FP8 tensor cores (Hopper: twice bf16's)
    bt = spec.block_tokens
    kv = kv_dtype(args.kv_cache_dtype, dtype)
    block_bytes = V4Cache(spec, 1, torch.device("cpu"), dtype, kv_dtype=kv).block_bytes
    chunk = min(args.prefill)
    cases = [(b, c) for c in args.ctx for b in args.batches]
    need = max([b * (-(-(c + args.steps + 16) // bt)) for b, c in cases] + [-(-(max(args.prefill) + 2) // bt)])
    if device.type == "cuda":  # the pool: what the largest case needs, within what the device has past weights
        free, total = torch.cuda.mem_get_info()
        room = int(free - weights.nbytes(dtype.itemsize) - args.reserve_gib * GiB)
        blocks = max(1, min(need, room // block_bytes))
    else:
        blocks = need
    log(f"{name}: {layers} layers x {experts} experts, weights {weight_gib:.1f} GiB, KV pool {blocks} blocks "
        f"({blocks * block_bytes / GiB:.1f} GiB, {block_bytes / 2**20:.2f} MiB per {bt}-token block)")
    engine = Engine(LoadedModel(f"v4-random-{name}", model_config(spec), weights), device=str(device), dtype=dtype,
                    kv_blocks=blocks, max_batch_tokens=chunk, max_running=max(args.batches),
                    kv_cache_dtype=args.kv_cache_dtype)
    log(f"{name}: model built, {torch.cuda.memory_allocated() / GiB:.1f} GiB allocated" if device.type == "cuda"
        else f"{name}: model built")
    log(f"{name}: {engine.memory().line()}")
    rows = []
    with torch.inference_mode():
        for ctx in args.ctx:
            for b in args.batches:
                t = guarded(ours_decode, engine, b, ctx, args.steps)
                graphs, engine.runner.graphs = engine.runner.graphs, None  # the same steps without CUDA graphs
                eager = guarded(ours_decode, engine, b, ctx, args.steps) if graphs is not None else ""
                engine.runner.graphs = graphs
                nbytes, nflops = costs.decode(b, ctx)
                rows.append(dict(shape=name, phase="decode", batch=b, ctx=ctx, tokens=b, ours=t, eager=eager,
                                 bytes_s=nbytes / bw, flops_s=nflops / flops,
                                 bf16_bytes_s=bf16_costs.decode(b, ctx)[0] / bw))
                log(f"{name} decode b{b} ctx {ctx}: {_fmt_ms(t)} (without graphs: {_fmt_ms(eager) if eager else '-'})")
        if args.kernels and device.type == "cuda":
            b = args.kernels
            step = next((r["ours"] for r in rows if r["batch"] == b and r["ctx"] == args.ctx[0]), "")
            top, total = kernel_breakdown(engine, b, args.ctx[0])
            args.kernel_tables.append(kernel_table(name, b, args.ctx[0], top, total, step))
        guarded(ours_prefill, engine, chunk, "warm-up")  # first use of the chunk's shapes (GEMM heuristics)
        for n in args.prefill:
            t = guarded(ours_prefill, engine, n, f"p{n}")
            nbytes, nflops = costs.prefill(n, chunk)
            rows.append(dict(shape=name, phase="prefill", batch=1, ctx=n, tokens=n, ours=t,
                             bytes_s=nbytes / bw, flops_s=nflops / flops,
                             bf16_bytes_s=bf16_costs.prefill(n, chunk)[0] / bw))
            log(f"{name} prefill {n}: {_fmt_ms(t)}")
        if args.prefill_kernels:
            n = max(args.prefill)
            steps, top, total = prefill_breakdown(engine, n)
            args.kernel_tables.append(prefill_table(name, n, steps, top, total))
            log(f"{name} prefill {n} profiled: {sum(steps):.2f} s\n{args.kernel_tables[-1]}")
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if quantized:
        for r in rows:
            r["hf"] = "not run (quantized)"
    elif not args.skip_hf:
        hf_rows(rows, config, dense, spec, args, device, dtype)
    as_bf16 = f" (bf16: {dense.nbytes(dtype.itemsize) / GiB:.1f} GiB)" if quantized else ""
    memory = (f"{name}: weights {weight_gib:.1f} GiB{as_bf16}, KV pool {blocks * block_bytes / GiB:.1f} GiB "
              f"({blocks} blocks)")
    return rows, memory


def hf_rows(rows: list[dict], config: Any, weights: RandomWeights, spec: DeepseekV4Spec, args: argparse.Namespace,
            device: torch.device, dtype: torch.dtype) -> None:
    """transformers eager on the same weights, into the rows' "hf" column."""
    try:
        model = hf_model(config, weights, device, dtype)
    except torch.OutOfMemoryError:
        for r in rows:
            r["hf"] = "out of memory (the model)"
        return
    for r in rows:
        if r["ctx"] > args.hf_max_ctx:
            r["hf"] = "not run (eager scores past --hf-max-ctx)"
        elif r["phase"] == "decode":
            r["hf"] = guarded(hf_decode, model, r["batch"], r["ctx"], spec.vocab_size, device)
        else:
            r["hf"] = guarded(hf_prefill, model, r["ctx"], spec.vocab_size, device)
        log(f"transformers {r['shape']} {r['phase']} b{r['batch']} {r['ctx']}: {_fmt_ms(r['hf'])}")
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- the FP8 GEMM at V4-Flash's projections -------------------------------------------------------------------

GEMM_SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
               "indexer wq_b": (8192, 1024)}
GEMM_ROWS = (1, 8, 32, 64, 512, 8192)


def gemm_table(bw: float, flops: float) -> str:
    """kernels/fp8_gemm.py weight-only and per-token FP8 against bf16 cuBLAS (F.linear), microseconds per call,
    and each one's share of its floor (bytes of W at the copy rate, or FLOPs at the bf16 / 2x bf16 rate)."""
    from bench.timing import cuda_time
    from shared.engine.kernels.fp8_gemm import fp8_gemm
    from shared.engine.quant import quantize_fp8

    lines = ["", "## FP8 block GEMM (kernels/fp8_gemm.py) at V4-Flash's projections", "",
             "us per call; in brackets the share of the floor (bf16: its bytes / FLOPs; FP8: FP8 bytes, FLOPs at "
             "twice the bf16 rate for the FP8-activation path, bf16's rate for weight-only).", "",
             "| weight | N x K | rows | bf16 cuBLAS | FP8 weight-only | FP8 per-token activations |",
             "|---|---|---|---|---|---|"]
    for name, (N, K) in GEMM_SHAPES.items():
        w = torch.randn(N, K, device="cuda") / K**0.5
        q, dense = quantize_fp8(w), w.to(torch.bfloat16)
        del w
        for M in GEMM_ROWS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_bf16 = cuda_time(lambda: torch.nn.functional.linear(x, dense))
            t_w = cuda_time(lambda: fp8_gemm(x, q, "none"))
            t_a = cuda_time(lambda: fp8_gemm(x, q, "fp8"))
            act = (M + N) * K * 2 + M * N * 2  # activations in, out (bf16)

            def pct(t: float, wbytes: float, rate: float) -> str:
                return f"{t * 1e6:,.1f} ({100 * max((wbytes + act) / bw, 2 * M * N * K / rate) / t:.0f} %)"

            lines.append(f"| {name} | {N} x {K} | {M} | {pct(t_bf16, N * K * 2, flops)} | "
                         f"{pct(t_w, N * K * FP8_BYTES, flops)} | {pct(t_a, N * K * FP8_BYTES, 2 * flops)} |")
        log(f"gemm {name} done")
    return "\n".join(lines) + "\n"


# --- the table ------------------------------------------------------------------------------------------------


def _fmt_ms(t: float | str) -> str:
    return f"{t * 1e3:,.1f} ms" if isinstance(t, float) else str(t)


def table(rows: list[dict], memory: list[str], bw: float, flops: float, device: str, args: argparse.Namespace
          ) -> str:
    lines = [
        f"# DeepSeek-V4-Flash-width model, random weights ({datetime.date.today()}, {device})",
        "",
        f"Ceilings measured in this run: copy {bw / 1e12:.3g} TB/s, matmul {flops / 1e12:.3g} TFLOP/s. Ours: "
        "through the Engine (decode contexts are random cache contents, not a real prefill). transformers: "
        f"{'not run (--skip-hf)' if args.skip_hf else '5.24 eager, same weights, a real prefill then one step'}. "
        "Floor = max(bytes / copy rate, FLOPs / matmul rate); % of floor = floor / ours. Memory: "
        + "; ".join(memory) + ".",
        "",
        "| shape | phase | batch | context / prompt | ours ms | ours tok/s | ours without CUDA graphs ms "
        "| transformers ms | ours vs transformers | bytes floor ms | bf16 bytes floor ms | FLOP floor ms "
        "| % of floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours, hf = r["ours"], r.get("hf", "")
        floor = max(r["bytes_s"], r["flops_s"])
        ok = isinstance(ours, float)
        tok_s = f"{r['tokens'] / ours:,.0f}" if ok else ""
        speed = f"{hf / ours:.2f}x" if ok and isinstance(hf, float) else ""
        pct = f"{100 * floor / ours:.1f} %" if ok else ""
        eager = r.get("eager", "")
        lines.append(f"| {r['shape']} | {r['phase']} | {r['batch']} | {r['ctx']:,} | {_fmt_ms(ours)} | {tok_s} | "
                     f"{_fmt_ms(eager) if eager != '' else ''} | {_fmt_ms(hf) if hf != '' else ''} | {speed} | "
                     f"{r['bytes_s'] * 1e3:.2f} | {r['bf16_bytes_s'] * 1e3:.2f} | {r['flops_s'] * 1e3:.2f} | {pct} |")
    return "\n".join(lines) + "\n"


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the markdown table here too")
    ap.add_argument("--shape", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: both)")
    ap.add_argument("--batches", type=ints, default=None, help="decode batch sizes (default 1,8,32,128)")
    ap.add_argument("--ctx", type=ints, default=None, help="decode contexts, tokens (default 4096,65536)")
    ap.add_argument("--prefill", type=ints, default=None,
                    help="prompt lengths; the smallest is the engine's chunk (default 8192,78848: an 8K chunk, 77K)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per case")
    ap.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    ap.add_argument("--hf-max-ctx", type=int, default=8192, help="longest context / prompt run through transformers")
    ap.add_argument("--reserve-gib", type=float, default=24.0,
                    help="GPU memory left outside the KV pool for activations (the 8K chunk's scores)")
    ap.add_argument("--kernels", type=int, default=0,
                    help="profile a decode step of this batch size at the first context (GPU): a per-kernel table")
    ap.add_argument("--prefill-kernels", action="store_true",
                    help="profile the longest prompt's prefill (GPU): each chunk's time and a per-kernel table")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="the engine's KV cache: auto | bf16 | fp8 (the memory line and the pool's blocks show it)")
    ap.add_argument("--tiny", action="store_true", help="toy widths on the CPU in seconds (checks the script)")
    ap.add_argument("--quantized", action="store_true",
                    help="issue 15's rows: default shapes 43x32 (bf16) and 43x128q (FP8 / FP4 as DeepSeek ships "
                         "V4-Flash), and the FP8 GEMM table; any shape name ending in q runs quantized")
    args = ap.parse_args(argv)
    args.kernel_tables = []
    if args.tiny:
        args.shape = args.shape or ("4x8,4x8q" if args.quantized else ",".join(TINY_SHAPES))
        args.batches = args.batches or [1, 3]
        args.ctx = args.ctx or [40, 100]
        args.prefill = args.prefill or [32, 80]
        args.steps = min(args.steps, 2)
    else:
        args.shape = args.shape or ("43x32,43x128q" if args.quantized else "43x32,8x256")
        args.batches = args.batches or [1, 8, 32, 128]
        args.ctx = args.ctx or [4096, 65536]
        args.prefill = args.prefill or [8192, 78848]
    known = TINY_SHAPES if args.tiny else SHAPES
    args.shapes = [s for s in args.shape.split(",") if s]
    if unknown := [s for s in args.shapes if s.removesuffix("q") not in known]:
        ap.error(f"--shape: unknown {unknown}; have {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bw, flops = ceilings(device)
    log(f"ceilings: {bw / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s")
    shapes_ = TINY_SHAPES if args.tiny else SHAPES
    rows, memory = [], []
    for name in args.shapes:
        layers, experts = shapes_[name.removesuffix("q")]
        shape_rows, mem = run_shape(name, layers, experts, args, device, dtype, bw, flops, name.endswith("q"))
        rows += shape_rows
        memory.append(mem)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    if device.type == "cuda":
        gpu += f", {torch.cuda.mem_get_info()[1] / GiB:.0f} GiB"
    out = table(rows, memory, bw, flops, gpu + (" (tiny widths)" if args.tiny else ""), args)
    out += "".join(args.kernel_tables)
    if args.quantized and device.type == "cuda":
        out += gemm_table(bw, flops)
    print(out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(out)
    return out


if __name__ == "__main__":
    main()
