"""The engine on one GPU against HF transformers and the roofline: decode tok/s at batch 1/32/256 and 2K prefill.

    python bench/engine_gpu.py --out bench/results/2026-12-01-engine-gpu-h200.md [--shapes smollm2-135m,llama3-8b]
        [--no-hf] [--no-hf-compile] [--budget-s 420]

Random bf16 weights of each shape (shared by our engine and HF's LlamaForCausalLM), 128-token prompts for
decode. Roofline: decode step = (weights + KV read + KV written) bytes over the measured device copy rate, or
2 * params * batch FLOPs over the measured bf16 matmul rate, whichever is slower; prefill = FLOPs (linear layers
+ causal attention) over the matmul rate. Our decode figures go through Engine.step() (scheduler, host packing,
graph replay, sampling, read-back); "GPU only" is the replayed step alone; per-kernel times from the profiler.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import ceilings, cuda_time, kernel_rows  # noqa: E402
from shared.engine.config import ModelConfig  # noqa: E402
from shared.engine.engine import Engine, EngineRequest  # noqa: E402
from shared.engine.loader import LoadedModel  # noqa: E402
from shared.engine.random_model import SHAPES  # noqa: E402
from shared.schemas.generate import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
PROMPT, STEPS, WARM = 128, 32, 4
BATCHES = (1, 32, 256)
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def counts(c: ModelConfig) -> tuple[int, int, int]:
    """(parameters read per decode step, linear-layer parameters, KV bytes per token) in bf16."""
    hd, D, I = c.head_dim, c.hidden_size, c.intermediate_size
    layer = D * (c.num_heads + 2 * c.num_kv_heads) * hd + c.num_heads * hd * D + 3 * D * I + 2 * D
    linear = c.num_layers * layer + c.vocab_size * D  # lm_head included; the embedding is a gather
    return linear + D, linear, c.num_layers * 2 * c.num_kv_heads * hd * 2


def roofline_decode(c: ModelConfig, batch: int, ctx: int, bw: float, flops: float) -> float:
    params, linear, kv_tok = counts(c)
    t_bytes = (2 * params + batch * (ctx + 1) * kv_tok) / bw
    t_flops = 2 * linear * batch / flops
    return batch / max(t_bytes, t_flops)


def prefill_flops(c: ModelConfig, n: int) -> float:
    _, linear, _ = counts(c)
    attn = 4 * n * n / 2 * c.num_heads * c.head_dim * c.num_layers  # QK^T and PV, causal half
    return 2 * linear * n + attn


def rand_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


# --- our engine ---------------------------------------------------------------------------------------------


def ours_decode(engine: Engine, batch: int, vocab: int, seed: int) -> tuple[float, float]:
    """(tok/s through Engine.step(), tok/s of the GPU step alone) at `batch` 128-token sequences."""
    for i, p in enumerate(rand_prompts(batch, PROMPT, vocab, seed)):
        engine.add(EngineRequest(f"d{seed}-{i}", p, GREEDY, WARM + STEPS + 8))
    while any(s.num_computed < PROMPT for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and a few first tokens)
    for _ in range(WARM):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(STEPS):
        assert len(engine.step()) == batch
    full = batch * STEPS / (time.perf_counter() - t)
    gpu = 0.0
    graphs = engine.runner.graphs
    if graphs is not None and batch <= graphs.max_batch:
        B = graphs.bucket(batch)
        graph, _ = graphs.graphs[B, graphs.context_buckets[0]]  # 128 + 44 tokens: the first context bucket
        gpu = batch / cuda_time(graph.replay, reps=20)
    for rid in list(engine.scheduler.seqs):
        engine.abort(rid)
    return full, gpu


def ours_prefill(engine: Engine, n: int, vocab: int) -> float:
    """Tokens/s of one n-token prompt through one engine step (fresh tokens each time: no prefix-cache hit)."""
    times = []
    for rep in range(6):
        engine.add(EngineRequest(f"p{rep}", rand_prompts(1, n, vocab, 100 + rep)[0], GREEDY, 1))
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.step()
        times.append(time.perf_counter() - t)
        assert out and out[0].finish_reason is not None
    return n / statistics.median(times[2:])


def kernel_breakdown(engine: Engine, batch: int, vocab: int, top: int = 8) -> list[tuple[str, float, int]]:
    """Per-kernel CUDA time per decode step (eager, no graph), top kernels: (name, us per step, calls/step)."""
    from torch.profiler import ProfilerActivity, profile

    for i, p in enumerate(rand_prompts(batch, PROMPT, vocab, 7)):
        engine.add(EngineRequest(f"k{i}", p, GREEDY, 64))
    while engine.scheduler.waiting or any(s.num_computed < PROMPT for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
    for rid in list(engine.scheduler.seqs):
        engine.abort(rid)
    return kernel_rows(prof, steps, width=60)[:top]


# --- HF transformers ----------------------------------------------------------------------------------------


def hf_model(c: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_eps, max_position_embeddings=c.max_position,
        tie_word_embeddings=c.tie_embeddings, bos_token_id=c.bos_id, eos_token_id=list(c.eos_ids),
    )
    cfg.initializer_range = 0.02
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def hf_decode(model, batch: int, vocab: int, compiled: bool) -> float:
    ids = torch.randint(3, vocab, (batch, PROMPT), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    if compiled:
        kw["cache_implementation"] = "static"

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        assert out.shape[1] == PROMPT + n
        return time.perf_counter() - t

    gen(STEPS + 1)  # warm-up (and compilation)
    gen(STEPS + 1)
    return batch * STEPS / max(gen(STEPS + 1) - gen(1), 1e-9)


def hf_prefill(model, n: int, vocab: int) -> float:
    ids = torch.randint(3, vocab, (1, n), device="cuda")
    with torch.inference_mode():
        return n / cuda_time(lambda: model(ids, logits_to_keep=1, use_cache=False), reps=5, warm=2)


# --- driver -------------------------------------------------------------------------------------------------


def run_shape(name: str, args, bw: float, flops: float, results: dict) -> None:
    c = SHAPES[name]
    r = results.setdefault(name, {})
    deadline = T0 + args.budget_s
    model = None
    if args.hf:
        model = hf_model(c)
        weights = dict(model.state_dict())
        if c.tie_embeddings:
            weights.pop("lm_head.weight", None)
    else:
        from shared.engine.random_model import random_llama

        weights = random_llama(c, "cuda").weights
    loaded = LoadedModel(name, c, weights)
    _, _, kv_tok = counts(c)
    kv_blocks = (8 << 30) // (kv_tok * 16)  # 8 GiB of KV: 256 sequences of 2K tokens fit for both shapes
    engine = Engine(loaded, device="cuda", kv_blocks=kv_blocks, max_running=256, max_batch_tokens=8192)
    log(f"{name}: engine ready")
    for b in BATCHES:
        full, gpu = ours_decode(engine, b, c.vocab_size, seed=b)
        r[f"decode_b{b}"] = {"ours": full, "ours_gpu": gpu,
                              "roofline": roofline_decode(c, b, PROMPT + WARM + STEPS // 2, bw, flops)}
        log(f"{name} decode b{b}: ours {full:,.0f} tok/s (GPU step alone {gpu:,.0f})")
        if b in (1, 256):  # the same without overlapped scheduling (host work between GPU steps)
            engine.overlap = False
            r[f"decode_b{b}"]["ours_sync"], _ = ours_decode(engine, b, c.vocab_size, seed=b + 1)
            engine.overlap = True
            log(f"{name} decode b{b} synchronous: {r[f'decode_b{b}']['ours_sync']:,.0f} tok/s")
    # batch 1 the other way: fused Triton GEMVs <-> cuBLAS GEMMs with separate norm / residual / SwiGLU kernels
    other = Engine(loaded, device="cuda", kv_blocks=kv_blocks // 8, max_running=8, max_batch_tokens=8192)
    other.model.fused_rows = 0 if engine.model.fused_rows else other.model.ops.gemv_rows
    full, gpu = ours_decode(other, 1, c.vocab_size, seed=3)
    key = "cublas" if engine.model.fused_rows else "gemv"
    r["decode_b1"] |= {"other": key, "ours_other": full, "ours_other_gpu": gpu}
    log(f"{name} decode b1 with {key}: ours {full:,.0f} tok/s (GPU step alone {gpu:,.0f})")
    del other
    torch.cuda.empty_cache()
    pf = ours_prefill(engine, 2048, c.vocab_size)
    r["prefill_2k"] = {"ours": pf, "roofline": flops / prefill_flops(c, 2048) * 2048,
                       "ours_tflops": pf * prefill_flops(c, 2048) / 2048 / 1e12}
    log(f"{name} prefill 2K: ours {pf:,.0f} tok/s ({r['prefill_2k']['ours_tflops']:.0f} TFLOP/s)")
    eager = Engine(loaded, device="cuda", kv_blocks=kv_blocks, max_running=256, max_batch_tokens=8192,
                   cuda_graphs=False)
    r["kernels"] = {f"b{b}": kernel_breakdown(eager, b, c.vocab_size) for b in (1, 256)}
    del eager, engine
    torch.cuda.empty_cache()
    if model is not None:
        for b in BATCHES:
            if time.time() > deadline:
                break
            r[f"decode_b{b}"]["hf_eager"] = hf_decode(model, b, c.vocab_size, compiled=False)
            log(f"{name} HF eager b{b}: {r[f'decode_b{b}']['hf_eager']:,.0f} tok/s")
        r["prefill_2k"]["hf_eager"] = hf_prefill(model, 2048, c.vocab_size)
        log(f"{name} HF eager prefill 2K: {r['prefill_2k']['hf_eager']:,.0f} tok/s")
    del model, weights, loaded
    torch.cuda.empty_cache()


def run_hf_compiled(name: str, args, results: dict) -> None:
    """HF's static cache + torch.compile path (its recommended fast generation), batch 1: compiles for minutes."""
    c = SHAPES[name]
    model = hf_model(c)
    r = results[name]["decode_b1"]
    try:
        r["hf_compiled"] = hf_decode(model, 1, c.vocab_size, compiled=True)
        log(f"{name} HF static+compile b1: {r['hf_compiled']:,.0f} tok/s")
    except Exception as e:  # noqa: BLE001 - a bench row, not a service: record and go on
        r["hf_compiled_error"] = repr(e)[:200]
        log(f"HF compiled failed: {e!r}"[:300])
    del model
    torch.cuda.empty_cache()


def fmt(x: float | None) -> str:
    return "-" if not x else f"{x:,.0f}"


def table(results: dict, bw: float, flops: float) -> str:
    dev = torch.cuda.get_device_name()
    lines = [
        f"# Engine on one GPU: {dev}, {datetime.date.today()}",
        "",
        f"torch {torch.__version__}; measured ceilings: device copy {bw / 1e12:.2f} TB/s (read + write), "
        f"bf16 8192^3 matmul {flops / 1e12:.0f} TFLOP/s. Random bf16 weights; decode = 128-token prompts, "
        f"{STEPS} timed steps; greedy.",
        "",
        "| shape | metric | ours (Engine.step) | ours (GPU step alone) | ours, not overlapped | ours, other GEMM "
        "path (step / GPU alone) | HF eager | HF static+compile | roofline | ours / roofline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for key in [f"decode_b{b}" for b in BATCHES] + ["prefill_2k"]:
            if key not in r:
                continue
            x = r[key]
            label = key.replace("decode_b", "decode tok/s, batch ") if key != "prefill_2k" else "prefill tok/s, 2K prompt"
            cublas = f"{x['other']}: {fmt(x['ours_other'])} / {fmt(x['ours_other_gpu'])}" if "other" in x else "-"
            lines.append(f"| {name} | {label} | {fmt(x['ours'])} | {fmt(x.get('ours_gpu'))} | "
                         f"{fmt(x.get('ours_sync'))} | {cublas} | {fmt(x.get('hf_eager'))} | "
                         f"{fmt(x.get('hf_compiled'))} | {fmt(x['roofline'])} | {x['ours'] / x['roofline']:.0%} |")
    lines.append("")
    for name, r in results.items():
        if "prefill_2k" in r:
            lines.append(f"- {name} 2K prefill: {r['prefill_2k']['ours_tflops']:.0f} TFLOP/s = "
                         f"{r['prefill_2k']['ours_tflops'] * 1e12 / flops:.0%} of the measured matmul rate")
    for name, r in results.items():
        for b, rows in r.get("kernels", {}).items():
            lines += ["", f"Per-kernel CUDA time per decode step, {name} {b} (eager, no graph):", "",
                      "| kernel | us / step | calls / step |", "|---|---|---|"]
            lines += [f"| `{k}` | {t:,.1f} | {n} |" for k, t, n in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=f"bench/results/{datetime.date.today()}-engine-gpu-h200.md")
    p.add_argument("--shapes", default="smollm2-135m,llama3-8b")
    p.add_argument("--no-hf", dest="hf", action="store_false")
    p.add_argument("--no-hf-compile", dest="hf_compile", action="store_false")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip HF rows once this much time has passed")
    args = p.parse_args()
    bw, flops = ceilings()
    log(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    results: dict = {}
    for name in args.shapes.split(","):
        try:
            run_shape(name, args, bw, flops, results)
        except Exception as e:  # noqa: BLE001 - keep the other shape's numbers
            log(f"{name} failed: {e!r}")
            import traceback

            traceback.print_exc()
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    for name in args.shapes.split(","):
        if args.hf and args.hf_compile and name in results and "decode_b1" in results[name]:
            if time.time() > T0 + args.budget_s:
                log(f"skipping HF compiled {name}: past the time budget")
                continue
            run_hf_compiled(name, args, results)
            Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    text = table(results, bw, flops)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
