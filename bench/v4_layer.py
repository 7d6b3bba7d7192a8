"""One DeepSeek-V4-Flash-shaped layer of each kind on one GPU: prefill and decode time against the rooflines.

    python bench/v4_layer.py --out bench/results/2026-11-30-v4-layer-h200.md [--ctx 4096] [--batches 1,8,64]
        [--prefill 2048] [--tiny]

A one-layer model per attention kind (sliding window only; CSA ratio 4 with the indexer's top-512; HCA ratio 128)
at V4-Flash's width: hidden 4096, 64 query heads of 512 (one shared K = V head), RoPE on 64, q_lora 1024, 8 output
groups of rank 1024, window 128, 4 mHC streams, 256 routed experts of 2048 (top 6) + 1 shared, random bf16
weights. Decode: B sequences at a `ctx`-token context (their rings and compressed entries filled with random
values), one token each. Prefill: one fresh `prefill`-token prompt.

Rooflines, from two ceilings measured in the same run (device copy bandwidth, bf16 matmul rate):
  bytes: every weight the step reads once (attention, compressors, router, the routed experts the batch touches
         (256 (1 - (1 - 6/256)^tokens) of them on average), the shared expert) + the KV it reads (ring, compressed
         entries, CSA: all indexer keys and the top-k entries) per sequence;
  FLOPs: 2 x active parameters per token x tokens + attention (QK and PV over the keys each query sees).
The floor is the larger of the two times; "% of floor" = floor / measured. MoE and the rest are timed apart
(the MoE block alone on the same rows).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import ceilings, cuda_time  # noqa: E402
from shared.engine.attention import AttentionMetadata, SeqSpan  # noqa: E402
from shared.engine.config import ModelConfig  # noqa: E402
from shared.engine.models.deepseek_v4.model import DeepseekV4  # noqa: E402
from shared.engine.models.deepseek_v4.moe import moe as moe_block  # noqa: E402
from shared.engine.ops import select_ops  # noqa: E402
from shared.engine.models.deepseek_v4.spec import CSA, HCA, SLIDING, DeepseekV4Spec  # noqa: E402

T0 = time.time()

FLASH = dict(vocab_size=1024, hidden_size=4096, num_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1024,
             o_groups=8, o_lora_rank=1024, window=128, index_heads=64, index_head_dim=128, index_topk=512,
             num_experts=256, experts_per_token=6, num_shared_experts=1, moe_intermediate=2048)
TINY = dict(vocab_size=256, hidden_size=64, num_heads=4, head_dim=32, rope_head_dim=16, q_lora_rank=32,
            o_groups=2, o_lora_rank=16, window=8, index_heads=2, index_head_dim=16, index_topk=8,
            num_experts=8, experts_per_token=2, num_shared_experts=1, moe_intermediate=32)
RATIO = {SLIDING: 0, CSA: 4, HCA: 128}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def spec_for(kind: str, dims: dict, ratios: dict[str, int]) -> DeepseekV4Spec:
    return DeepseekV4Spec(
        **dims, num_layers=1, kinds=(kind,), ratios=(ratios[kind],), hash_layers=0, scoring="sqrtsoftplus",
        norm_topk_prob=True, routed_scale=1.5, swiglu_limit=10.0, hc_mult=4, hc_iters=20, hc_eps=1e-6,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        compress_rope_scaling={"factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32,
                               "beta_slow": 1},
        rms_eps=1e-6, max_position=1 << 20, num_mtp_layers=0, mtp_kinds=(), mtp_ratios=())


def weights_for(s: DeepseekV4Spec, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights at init-like scales (1/sqrt(fan_in)), every tensor the loader would hand over."""
    D, H, d, hc = s.hidden_size, s.num_heads, s.head_dim, s.hc_mult
    g = torch.Generator(device=device).manual_seed(0)

    def lin(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g, device=device, dtype=dtype) * cols**-0.5

    def vec(n: int, scale: float = 1.0, base: float = 0.0) -> torch.Tensor:
        return torch.randn(n, generator=g, device=device) * scale + base

    w = {"embed.weight": lin(s.vocab_size, D) * D**0.5, "head.weight": lin(s.vocab_size, D),
         "norm.weight": vec(D, 0.1, 1.0), "hc_head_fn": lin(hc, hc * D).float(), "hc_head_base": vec(hc),
         "hc_head_scale": vec(1, 0.1, 1.0)}
    p, a = "layers.0.", "layers.0.attn."
    mix = (2 + hc) * hc
    for hcn in ("hc_attn", "hc_ffn"):
        w |= {f"{p}{hcn}_fn": lin(mix, hc * D).float(), f"{p}{hcn}_base": vec(mix), f"{p}{hcn}_scale": vec(3, .1, 1)}
    w |= {p + "attn_norm.weight": vec(D, .1, 1), p + "ffn_norm.weight": vec(D, .1, 1),
          a + "wq_a.weight": lin(s.q_lora_rank, D), a + "q_norm.weight": vec(s.q_lora_rank, .1, 1),
          a + "wq_b.weight": lin(H * d, s.q_lora_rank), a + "wkv.weight": lin(d, D), a + "kv_norm.weight": vec(d, .1, 1),
          a + "wo_a.weight": lin(s.o_groups * s.o_lora_rank, H * d // s.o_groups),
          a + "wo_b.weight": lin(D, s.o_groups * s.o_lora_rank), a + "attn_sink": vec(H)}
    kind, m = s.kinds[0], s.ratios[0]
    if kind != SLIDING:
        c = 2 * d if kind == CSA else d
        w |= {a + "compressor.wkv.weight": lin(c, D), a + "compressor.wgate.weight": lin(c, D),
              a + "compressor.ape": torch.randn(m, c, generator=g, device=device),
              a + "compressor.norm.weight": vec(d, .1, 1)}
    if kind == CSA:
        ic = 2 * s.index_head_dim
        w |= {a + "indexer.wq_b.weight": lin(s.index_heads * s.index_head_dim, s.q_lora_rank),
              a + "indexer.weights_proj.weight": lin(s.index_heads, D),
              a + "indexer.compressor.wkv.weight": lin(ic, D), a + "indexer.compressor.wgate.weight": lin(ic, D),
              a + "indexer.compressor.ape": torch.randn(m, ic, generator=g, device=device),
              a + "indexer.compressor.norm.weight": vec(s.index_head_dim, .1, 1)}
    f, I = p + "ffn.", s.moe_intermediate
    w |= {f + "gate.weight": lin(s.num_experts, D), f + "gate.bias": vec(s.num_experts, 0.01)}
    for e in [*map(str, range(s.num_experts)), "shared_experts"]:
        x = f + ("" if e == "shared_experts" else "experts.") + e
        w |= {x + ".w1.weight": lin(I, D), x + ".w3.weight": lin(I, D), x + ".w2.weight": lin(D, I)}
    return w


class Costs:
    """Bytes and FLOPs of one step of the one-layer model (bf16 = 2 bytes)."""

    def __init__(self, s: DeepseekV4Spec, elem: int) -> None:
        self.s, self.elem = s, elem
        D, H, d, q, hc = s.hidden_size, s.num_heads, s.head_dim, s.q_lora_rank, s.hc_mult
        kind = s.kinds[0]
        attn = D * q + q * H * d + D * d + H * d * s.o_lora_rank + s.o_groups * s.o_lora_rank * D
        if kind != SLIDING:
            attn += 2 * D * (2 * d if kind == CSA else d)
        if kind == CSA:
            attn += q * s.index_heads * s.index_head_dim + D * s.index_heads + 2 * D * 2 * s.index_head_dim
        self.dense = attn + s.num_experts * D + 2 * (2 + hc) * hc * hc * D  # + router + mHC projections
        self.expert = 3 * D * s.moe_intermediate
        self.active = self.dense + (s.experts_per_token + s.num_shared_experts) * self.expert

    def experts_touched(self, tokens: int) -> float:
        s = self.s
        return s.num_experts * (1 - (1 - s.experts_per_token / s.num_experts) ** tokens) + s.num_shared_experts

    def keys(self, ctx: int) -> tuple[int, int]:
        """(keys each query attends to, KV elements read per sequence) at context ctx."""
        s = self.s
        kind, m, d = s.kinds[0], s.ratios[0], s.head_dim
        ring = min(ctx, s.window)
        if kind == SLIDING:
            return ring, ring * d
        entries = ctx // m
        if kind == HCA:
            return ring + entries, (ring + entries) * d
        chosen = min(entries, s.index_topk)
        return ring + chosen, (ring + chosen) * d + entries * s.index_head_dim

    def decode(self, batch: int, ctx: int) -> tuple[float, float]:
        s = self.s
        keys, kv = self.keys(ctx)
        weights = self.dense + self.experts_touched(batch) * self.expert
        attn_flops = 4 * s.num_heads * s.head_dim * keys
        index_flops = 2 * s.index_heads * s.index_head_dim * (ctx // s.ratios[0]) if s.kinds[0] == CSA else 0
        return (weights + batch * kv) * self.elem, batch * (2 * self.active + attn_flops + index_flops)

    def prefill(self, n: int) -> tuple[float, float]:
        s = self.s
        weights = self.dense + self.experts_touched(n) * self.expert
        keys = sum(self.keys(p + 1)[0] for p in range(0, n, max(1, n // 64))) * max(1, n // 64)  # ~ sum over queries
        attn = 4 * s.num_heads * s.head_dim * keys
        index = (2 * s.index_heads * s.index_head_dim * n * (n // s.ratios[0]) // 2) if s.kinds[0] == CSA else 0
        return weights * self.elem, 2 * self.active * n + attn + index


def fill_decode_state(model: DeepseekV4, rids: list[str], ctx: int, next_block: int) -> tuple[list[list[int]], int]:
    """Give each sequence a ctx-token history: random rings and compressed entries, blocks in a table."""
    cache = model.cache
    assert cache is not None
    bt = cache.block_tokens
    tables = []
    for rid in rids:
        cache.begin(rid, 0)
        state = cache.states[rid]
        state.length, state.frozen = ctx, 0
        for t in state.tensors():
            t.normal_()
        n = -(-(ctx + 1) // bt)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return tables, next_block


def run_kind(kind: str, dims: dict, ratios: dict, args, device: torch.device, dtype: torch.dtype,
             bw: float, flops: float) -> list[dict]:
    spec = spec_for(kind, dims, ratios)
    config = ModelConfig(arch="deepseek_v4", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_layers=1,
                         num_heads=spec.num_heads, num_kv_heads=1, head_dim=spec.head_dim,
                         intermediate_size=spec.moe_intermediate, rope_theta=spec.rope_theta, rms_eps=spec.rms_eps,
                         max_position=spec.max_position, tie_embeddings=False, bos_id=0, eos_ids=(1,), spec=spec)
    weights = weights_for(spec, device, dtype)
    model = DeepseekV4(config, weights, device, dtype, select_ops(device, "auto"))
    fast = model.triton  # the model's Triton kernels (mHC); timed with and without them, same weights, same run
    del weights
    bt = spec.block_tokens
    batches = [int(b) for b in args.batches.split(",")]
    blocks_needed = sum(batches) * (-(-(args.ctx + 1) // bt)) + 4 * (-(-args.prefill // bt)) + 8
    cache = model.make_cache(blocks_needed)
    for t in cache._paged:
        t.normal_()
    costs = Costs(spec, dtype.itemsize)
    rows = []
    layer = model.layers[0]

    def timed_moe(n: int) -> float:
        x = torch.randn(n, spec.hidden_size, device=device, dtype=dtype)
        ids = torch.zeros(n, dtype=torch.long, device=device)
        return cuda_time(lambda: moe_block(model.spec, layer, x, ids), args.reps, warm=2)

    # prefill: a fresh prompt per repetition (new request id, fresh state), on blocks reused across repetitions
    n = args.prefill
    table = list(range(blocks_needed - (-(-n // bt)) - 4, blocks_needed - 4))
    ids = torch.randint(0, spec.vocab_size, (n,), device=device)
    pos = torch.arange(n, device=device)
    counter = [0]

    def prefill() -> None:
        counter[0] += 1
        rid = f"p{counter[0]}"
        cache.begin(rid, 0)
        span = SeqSpan(0, n, n, torch.tensor(table, device=device), rid)
        model.forward(ids, pos, AttentionMetadata(pos, [span]), cache)
        cache.drop_state(rid)

    def both(fn) -> tuple[float, float]:
        """(seconds with the torch path, seconds with the model's kernels)."""
        model.triton = False
        slow = cuda_time(fn, args.reps, warm=2)
        model.triton = fast
        return slow, cuda_time(fn, args.reps, warm=2) if fast else slow

    with torch.inference_mode():
        t_torch, t = both(prefill)
        moe = timed_moe(n)
        nbytes, nflops = costs.prefill(n)
        rows.append(dict(kind=kind, phase="prefill", batch=1, tokens=n, ms=t * 1e3, moe_ms=moe * 1e3,
                         torch_ms=t_torch * 1e3, bytes_ms=nbytes / bw * 1e3, flops_ms=nflops / flops * 1e3))
        log(f"{kind} prefill {n}: {t * 1e3:.1f} ms, torch path {t_torch * 1e3:.1f} (MoE {moe * 1e3:.1f})")
        next_block = 0
        for b in batches:
            rids = [f"{kind}-d{b}-{i}" for i in range(b)]
            tables, next_block = fill_decode_state(model, rids, args.ctx, next_block)
            spans = [SeqSpan(i, 1, args.ctx + 1, torch.tensor(tab, device=device), rid)
                     for i, (rid, tab) in enumerate(zip(rids, tables))]
            dids = torch.randint(0, spec.vocab_size, (b,), device=device)
            dpos = torch.full((b,), args.ctx, device=device)
            meta = AttentionMetadata(dpos, spans)
            t_torch, t = both(lambda: model.forward(dids, dpos, meta, cache))
            moe = timed_moe(b)
            nbytes, nflops = costs.decode(b, args.ctx)
            rows.append(dict(kind=kind, phase="decode", batch=b, tokens=b, ms=t * 1e3, moe_ms=moe * 1e3,
                             torch_ms=t_torch * 1e3, bytes_ms=nbytes / bw * 1e3, flops_ms=nflops / flops * 1e3))
            log(f"{kind} decode b{b} ctx {args.ctx}: {t * 1e3:.2f} ms, torch path {t_torch * 1e3:.2f} "
                f"(MoE {moe * 1e3:.2f})")
            for rid in rids:
                cache.drop_state(rid)
    del model, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], bw: float, flops: float, device: str, args) -> str:
    lines = [
        f"# DeepSeek-V4-Flash-shaped layer, one per kind ({datetime.date.today()}, {device})",
        "",
        f"Ceilings measured in this run: copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s. "
        f"Decode at a {args.ctx}-token context. Floor = max(bytes / copy rate, FLOPs / matmul rate).",
        "",
        "| layer | phase | batch | tokens | torch path ms | ours ms (kernels) | speedup | of which MoE ms "
        "| bytes floor ms | FLOP floor ms | % of floor | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        floor = max(r["bytes_ms"], r["flops_ms"])
        lines.append(f"| {r['kind']} | {r['phase']} | {r['batch']} | {r['tokens']} | {r['torch_ms']:.2f} | "
                     f"{r['ms']:.2f} | {r['torch_ms'] / r['ms']:.2f}x | "
                     f"{r['moe_ms']:.2f} | {r['bytes_ms']:.3f} | {r['flops_ms']:.3f} | "
                     f"{100 * floor / r['ms']:.1f} % | {r['tokens'] / r['ms'] * 1e3:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kinds", default="sliding,csa,hca")
    ap.add_argument("--tiny", action="store_true", help="toy widths, runs on the CPU (checks the script)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dims = TINY if args.tiny else FLASH
    ratios = {SLIDING: 0, CSA: 4, HCA: 16} if args.tiny else RATIO
    bw, flops = ceilings(device)
    log(f"ceilings: {bw / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s")
    rows = []
    for kind in args.kinds.split(","):
        rows += run_kind(kind, dims, ratios, args, device, dtype, bw, flops)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    out = table(rows, bw, flops, name + (" (tiny widths)" if args.tiny else ""), args)
    print(out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(out)


if __name__ == "__main__":
    main()
