"""`--load-format dummy`: the model's config from the checkpoint directory (config.json), its weights drawn in
memory instead of read: vLLM's dummy format, for benchmarks of shapes whose checkpoint would not fit the disk
(a 43-layer V4-Flash-width model in bf16 is ~78 GiB).

Each tensor is drawn when the model asks for it, on the engine's device, from a generator seeded by the tensor's
name: every process draws the same numbers (a prefill and a decode worker agree, so a KV hand-over between them
is exact), and nothing is held twice (the model keeps what it casts and stacks; the drawn fp32 tensor is freed).
Values are at init scale (linears N(0, 1 / fan_in), norms ~1, small biases), so activations stay finite through
any depth; the tokens they produce mean nothing.

Names are the ones the loaders hand the model: DeepSeek-V4's hub names (loader/deepseek_v4.py) and HF Llama's.

A V4 config.json with DeepSeek's `quantization_config` (quant_method "fp8", `weight_block_size` [b, b]) gets
its weights as DeepSeek ships them (`QuantizedWeights`): each drawn tensor quantized as it is drawn, to what
the checkpoint loader makes of the release's `<name>.weight` + `<name>.scale` pairs. keep_quantized (a GPU):
quant.py's Fp8Weight (e4m3, power-of-two float32 scales per b x b block) for the attention projections,
compressors, indexer, shared expert and MTP projections, Fp4Weight (e2m1, an e8m0 exponent per 32 columns) for
the routed experts; otherwise (a CPU) those dequantized to bfloat16, as the loader dequantizes them. The
embedding, head, router, norms and mHC mixers stay dense, as in DeepSeek's releases. (The checkpoint loader
needs no config for this: it pairs each weight with its `.scale` tensor by name. Dummy has only the config.)
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

from shared.engine.config import ModelConfig
from shared.engine.loader import deepseek_v4, hf
from shared.engine.models.deepseek_v4.spec import CSA, SLIDING, DeepseekV4Spec
from shared.engine.quant import Weight, quantize_fp4, quantize_fp8
from shared.model_info import is_deepseek_v4
from shared.models import ModelFiles

SUFFIX = "+dummy"  # of the loaded model's name, so its cache id (and every KV block's hash) is never a real one's
FP4_BLOCK = 32  # columns per e8m0 exponent of V4's FP4 routed experts


class Draw(NamedTuple):
    """How one tensor is drawn: "lin" N(0, 1 / fan_in); "norm" ~1; "bias" small; "ape" and "embed" N(0, 1);
    "ids" each row `high` distinct ids in [0, high) (V4's hash-routing table: a token's experts)."""

    shape: tuple[int, ...]
    how: str
    high: int = 0


Table = dict[str, Draw]


class DrawnWeights(Mapping[str, Weight]):
    """The tensors of `table`, each drawn when asked for from a generator seeded by its name (fp32 on `device`,
    int64 ids): the same numbers for whoever asks, and nothing kept. Subclasses say what is served of a draw."""

    def __init__(self, table: Table, device: torch.device | str, seed: int = 0) -> None:
        self.table, self.device, self.seed = table, torch.device(device), seed

    def draw(self, name: str) -> torch.Tensor:
        shape, how, high = self.table[name]
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        if how == "ids":  # the first shape[-1] of a random permutation per row: distinct, as the real table's
            return torch.rand((*shape[:-1], high), generator=g, device=self.device).argsort(-1)[..., : shape[-1]]
        x = torch.randn(shape, generator=g, device=self.device)
        if how == "lin":
            return x * shape[-1] ** -0.5
        return {"norm": x * 0.1 + 1.0, "bias": x * 0.1, "ape": x, "embed": x}[how]

    def __contains__(self, name: object) -> bool:  # Mapping's default would draw the tensor to find out
        return name in self.table

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def nbytes(self, elem: int) -> int:
        """The weights' bytes as served, dense tensors at `elem` bytes per value (the model's dtype)."""
        return sum(self._nbytes(name, draw.shape, elem) for name, draw in self.table.items())

    def _nbytes(self, name: str, shape: tuple[int, ...], elem: int) -> int:
        return math.prod(shape) * elem


class RandomWeights(DrawnWeights):
    """Dense draws (the model casts them to its dtype)."""

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.draw(name)


def quantized_kind(name: str, shape: tuple[int, ...]) -> str | None:
    """How DeepSeek's release ships a V4 tensor (hub name): "fp4" the routed experts, "fp8" the other matrices
    named `.weight` (not the embedding, the head, the router or a norm); None: dense."""
    if ".ffn.experts." in name:
        return "fp4"
    linear = len(shape) == 2 and name.endswith(".weight") and not name.endswith(("norm.weight", ".gate.weight"))
    return "fp8" if linear and name not in ("embed.weight", "head.weight") else None


class QuantizedWeights(DrawnWeights):
    """The draws quantized as DeepSeek ships them (quantized_kind): quant.py's Fp8Weight with power-of-two scales
    per fp8_block x fp8_block and Fp4Weight with an e8m0 exponent per FP4_BLOCK columns, kept (keep_quantized:
    what the loader keeps for a GPU's kernels) or dequantized to bfloat16 (what it makes of them for a CPU)."""

    def __init__(self, table: Table, device: torch.device | str, seed: int = 0, fp8_block: int = 128,
                 keep_quantized: bool = True) -> None:
        super().__init__(table, device, seed)
        self.fp8_block, self.keep_quantized = fp8_block, keep_quantized

    def __getitem__(self, name: str) -> Weight:
        kind = quantized_kind(name, self.table[name].shape)
        w = self.draw(name)
        if kind is None:
            return w
        q = quantize_fp8(w, self.fp8_block) if kind == "fp8" else quantize_fp4(w, FP4_BLOCK)
        return deepseek_v4.unpacked(q.data, q.scale, self.keep_quantized)  # as the loader serves the pair

    def _nbytes(self, name: str, shape: tuple[int, ...], elem: int) -> int:
        kind, n = quantized_kind(name, shape), math.prod(shape)
        if not self.keep_quantized:  # dequantized: served dense as the rest
            return n * elem
        if kind == "fp8":  # e4m3 values + a float32 scale per block (partial blocks at the ends)
            return n + 4 * math.prod(-(-d // self.fp8_block) for d in shape)
        if kind == "fp4":  # two e2m1 codes a byte + an e8m0 byte per FP4_BLOCK columns
            return n // 2 + n // FP4_BLOCK
        return n * elem


def load(files: ModelFiles, device: torch.device | str, seed: int = 0, keep_quantized: bool = False
         ) -> tuple[ModelConfig, DrawnWeights]:
    """(config from files' config.json, its weights drawn on `device`). A V4 config with a quantization_config
    draws QuantizedWeights (keep_quantized as the checkpoint loader's); otherwise dense. ValueError for what has
    no dummy."""
    if files.format != "hf":
        raise ValueError(f"{files.name}: dummy weights need a checkpoint directory's config.json, not a "
                         f"{files.format} file")
    raw = json.loads((files.path / "config.json").read_text())
    if is_deepseek_v4(raw.get("model_type", ""), raw.get("architectures") or []):
        spec = deepseek_v4.parse_spec(raw)
        table = v4_table(spec)
        quantization = raw.get("quantization_config")
        weights = (RandomWeights(table, device, seed) if quantization is None else
                   QuantizedWeights(table, device, seed, _fp8_block(files, quantization), keep_quantized))
        return deepseek_v4.model_config(raw, spec), weights
    if not set(raw.get("architectures") or []) & hf.SUPPORTED.keys():
        raise ValueError(f"{files.path}: dummy weights: only DeepSeek-V4 and Llama-family checkpoints "
                         f"(architectures {raw.get('architectures')})")
    config = hf.llama_config(raw, files.path)
    return config, RandomWeights(llama_table(config), device, seed)


def _fp8_block(files: ModelFiles, quantization: dict) -> int:
    """The FP8 block edge of DeepSeek's quantization_config ({"quant_method": "fp8", "weight_block_size":
    [128, 128], ...}); ValueError for another scheme."""
    block = quantization.get("weight_block_size", [128, 128])
    if quantization.get("quant_method") != "fp8" or len(block) != 2 or block[0] != block[1]:
        raise ValueError(f"{files.path}: dummy weights: only DeepSeek's FP8 block quantization (quant_method "
                         f"'fp8', square weight_block_size), got quantization_config {quantization}")
    return int(block[0])


# --- the tables ------------------------------------------------------------------------------------------------


def llama_table(c: ModelConfig) -> Table:
    """HF Llama's tensors (loader/hf.py's names)."""
    D, hd, I = c.hidden_size, c.head_dim, c.intermediate_size
    out = {"model.embed_tokens.weight": Draw((c.vocab_size, D), "embed"), "model.norm.weight": Draw((D,), "norm")}
    if not c.tie_embeddings:
        out["lm_head.weight"] = Draw((c.vocab_size, D), "lin")
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": Draw((D,), "norm"),
                p + "post_attention_layernorm.weight": Draw((D,), "norm"),
                p + "self_attn.q_proj.weight": Draw((c.num_heads * hd, D), "lin"),
                p + "self_attn.k_proj.weight": Draw((c.num_kv_heads * hd, D), "lin"),
                p + "self_attn.v_proj.weight": Draw((c.num_kv_heads * hd, D), "lin"),
                p + "self_attn.o_proj.weight": Draw((D, c.num_heads * hd), "lin"),
                p + "mlp.gate_proj.weight": Draw((I, D), "lin"), p + "mlp.up_proj.weight": Draw((I, D), "lin"),
                p + "mlp.down_proj.weight": Draw((D, I), "lin")}
    return out


def v4_table(s: DeepseekV4Spec) -> Table:
    """Every tensor the DeepSeek-V4 loader requires of `s` (hub names): the main layers, the head and the MTP
    layers the spec counts (a hub config counts one: DeepSeek's releases ship it)."""
    D = s.hidden_size
    out: Table = {"embed.weight": Draw((s.vocab_size, D), "embed"), "head.weight": Draw((s.vocab_size, D), "lin"),
                  "norm.weight": Draw((D,), "norm"), **_hc_head("", s)}
    for i, (kind, ratio) in enumerate(zip(s.kinds, s.ratios)):
        out |= _v4_block(f"layers.{i}.", kind, ratio, i < s.hash_layers, s)
    for j, (kind, ratio) in enumerate(zip(s.mtp_kinds, s.mtp_ratios)):
        p = f"mtp.{j}."
        out |= _v4_block(p, kind, ratio, False, s) | _hc_head(p, s)
        out |= {p + "e_proj.weight": Draw((D, D), "lin"), p + "h_proj.weight": Draw((D, D), "lin"),
                p + "enorm.weight": Draw((D,), "norm"), p + "hnorm.weight": Draw((D,), "norm"),
                p + "norm.weight": Draw((D,), "norm")}
    required, _ = deepseek_v4.expected_names(s)
    assert required == out.keys(), sorted(required ^ out.keys())[:5]
    return out


def _hc_head(p: str, s: DeepseekV4Spec) -> Table:
    hc = s.hc_mult
    return {p + "hc_head_fn": Draw((hc, hc * s.hidden_size), "lin"), p + "hc_head_base": Draw((hc,), "bias"),
            p + "hc_head_scale": Draw((1,), "norm")}


def _v4_block(p: str, kind: str, ratio: int, hashed: bool, s: DeepseekV4Spec) -> Table:
    """One transformer block, main or MTP: mHC mixers, attention (its compressors and CSA's indexer), MoE."""
    D, H, d, hc, I = s.hidden_size, s.num_heads, s.head_dim, s.hc_mult, s.moe_intermediate
    mix = (2 + hc) * hc  # an mHC mixer's rows: pre (hc) + post (hc) + residual (hc x hc)
    a, f = p + "attn.", p + "ffn."
    out: Table = {}
    for part in ("hc_attn", "hc_ffn"):
        out |= {f"{p}{part}_fn": Draw((mix, hc * D), "lin"), f"{p}{part}_base": Draw((mix,), "bias"),
                f"{p}{part}_scale": Draw((3,), "norm")}
    out |= {p + "attn_norm.weight": Draw((D,), "norm"), p + "ffn_norm.weight": Draw((D,), "norm"),
            a + "wq_a.weight": Draw((s.q_lora_rank, D), "lin"), a + "q_norm.weight": Draw((s.q_lora_rank,), "norm"),
            a + "wq_b.weight": Draw((H * d, s.q_lora_rank), "lin"), a + "wkv.weight": Draw((d, D), "lin"),
            a + "kv_norm.weight": Draw((d,), "norm"),
            a + "wo_a.weight": Draw((s.o_groups * s.o_lora_rank, H * d // s.o_groups), "lin"),
            a + "wo_b.weight": Draw((D, s.o_groups * s.o_lora_rank), "lin"), a + "attn_sink": Draw((H,), "bias")}
    # (prefix, width, normed): CSA's compressors overlap two windows, so they project to twice the entry width
    compressors = [] if kind == SLIDING else [(a + "compressor.", 2 * d if kind == CSA else d, d)]
    if kind == CSA:
        compressors.append((a + "indexer.compressor.", 2 * s.index_head_dim, s.index_head_dim))
        out |= {a + "indexer.wq_b.weight": Draw((s.index_heads * s.index_head_dim, s.q_lora_rank), "lin"),
                a + "indexer.weights_proj.weight": Draw((s.index_heads, D), "lin")}
    for c, width, normed in compressors:
        out |= {c + "wkv.weight": Draw((width, D), "lin"), c + "wgate.weight": Draw((width, D), "lin"),
                c + "ape": Draw((ratio, width), "ape"), c + "norm.weight": Draw((normed,), "norm")}
    out[f + "gate.weight"] = Draw((s.num_experts, D), "lin")
    if hashed:
        out[f + "gate.tid2eid"] = Draw((s.vocab_size, s.experts_per_token), "ids", s.num_experts)
    else:
        out[f + "gate.bias"] = Draw((s.num_experts,), "bias")
    shared = ["shared_experts"] if s.num_shared_experts else []
    for e in [*(f"experts.{j}" for j in range(s.num_experts)), *shared]:
        out |= {f"{f}{e}.w1.weight": Draw((I, D), "lin"), f"{f}{e}.w3.weight": Draw((I, D), "lin"),
                f"{f}{e}.w2.weight": Draw((D, I), "lin")}
    return out
