"""DeepSeek-V4 checkpoint directories -> (ModelConfig carrying a DeepseekV4Spec, weights under the hub's names).

Three spellings of the same checkpoint exist: the official hub release (`layers.0.attn.wq_a.weight`, FP8/FP4
with `.scale` tensors), what transformers' `save_pretrained` writes (the hub names under `model.`, except
`model.embed_tokens`, `model.hc_head.hc_*` and the attention's kv_norm as `attn.norm`), and transformers'
module names (`model.layers.0.self_attn.q_a_proj.weight`, experts stacked). All of them load onto the hub
names without a prefix, because those are what DeepSeek's own inference code and every quantized release use.
Quantized weights are dequantized to bfloat16 here, or kept FP8 / FP4 with their block scales (quant.py) when
the caller asks (a GPU serving them through its kernels); the rest keep the checkpoint's dtype.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shared.engine.config import ModelConfig
from shared.engine.models.deepseek_v4.spec import CSA, HCA, SLIDING, DeepseekV4Spec
from shared.engine.quant import QUANTIZED_DTYPES, Quantized, as_dense, dequantize, quantized

Tensor = torch.Tensor | Quantized  # a checkpoint tensor as loaded: plain, or kept FP8 / FP4 with its scales
from shared.model_info import DEEPSEEK_V4, is_deepseek_v4

ARCH = DEEPSEEK_V4

_KIND_OF_LAYER_TYPE = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_DEFAULT_RATES = {CSA: 4, HCA: 128}
_DEFAULT_HASH_LAYERS = 3
_DEFAULT_ROPE_HEAD_DIM_FRACTION = 64 / 512
_YARN_FLOATS = ("mscale", "mscale_all_dim", "attention_factor")


def parse_spec(raw: dict[str, Any]) -> DeepseekV4Spec:
    """Both config.json dialects; an absent key takes transformers' DeepseekV4Config default."""
    n = int(_get(raw, "num_hidden_layers", 43))
    head_dim = int(_get(raw, "head_dim", 512))
    kinds, ratios = _schedule(raw, n)
    num_mtp = int(_get(raw, "num_nextn_predict_layers", 1))
    # The hub's compress_ratios runs on past the main layers into the MTP layers; otherwise MTP is window-only.
    mtp_ratios = [0 if int(r) <= 1 else int(r) for r in (_get(raw, "compress_ratios", []))[n : n + num_mtp]]
    mtp_ratios += [0] * (num_mtp - len(mtp_ratios))
    rope_theta, compress_rope_theta, yarn = _rope(raw)
    return DeepseekV4Spec(
        vocab_size=int(_get(raw, "vocab_size", 129280)),
        hidden_size=int(_get(raw, "hidden_size", 4096)),
        num_layers=n,
        num_heads=int(_get(raw, "num_attention_heads", 64)),
        head_dim=head_dim,
        rope_head_dim=_rope_head_dim(raw, head_dim),
        q_lora_rank=int(_get(raw, "q_lora_rank", 1024)),
        o_groups=int(_get(raw, "o_groups", 8)),
        o_lora_rank=int(_get(raw, "o_lora_rank", 1024)),
        window=int(_get(raw, "sliding_window", 128)),
        kinds=kinds,
        ratios=ratios,
        hash_layers=_hash_layers(raw, n),
        index_heads=int(_get(raw, "index_n_heads", 64)),
        index_head_dim=int(_get(raw, "index_head_dim", 128)),
        index_topk=int(_get(raw, "index_topk", 512)),
        num_experts=int(_get(raw, "n_routed_experts", 256)),
        experts_per_token=int(_get(raw, "num_experts_per_tok", 6)),
        num_shared_experts=int(_get(raw, "n_shared_experts", 1)),
        moe_intermediate=int(_get(raw, "moe_intermediate_size", 2048)),
        scoring=str(_get(raw, "scoring_func", "sqrtsoftplus")),
        norm_topk_prob=bool(_get(raw, "norm_topk_prob", True)),
        routed_scale=float(_get(raw, "routed_scaling_factor", 1.5)),
        swiglu_limit=float(_get(raw, "swiglu_limit", 10.0)),
        hc_mult=int(_get(raw, "hc_mult", 4)),
        hc_iters=int(_get(raw, "hc_sinkhorn_iters", 20)),
        hc_eps=float(_get(raw, "hc_eps", 1e-6)),
        rope_theta=rope_theta,
        compress_rope_theta=compress_rope_theta,
        compress_rope_scaling=yarn,
        rms_eps=float(_get(raw, "rms_norm_eps", 1e-6)),
        max_position=int(_get(raw, "max_position_embeddings", 1048576)),
        num_mtp_layers=num_mtp,
        mtp_kinds=tuple(_kind_of_ratio(r) for r in mtp_ratios),
        mtp_ratios=tuple(mtp_ratios),
    )


def _get(raw: dict[str, Any], key: str, default: Any) -> Any:
    """transformers treats an explicit null like an absent key."""
    value = raw.get(key)
    return default if value is None else value


def _kind_of_ratio(ratio: int) -> str:
    """The hub's per-layer ratios: 0 (some ports write 1) = window only, 4 = CSA, anything larger = HCA."""
    return SLIDING if ratio <= 1 else CSA if ratio == 4 else HCA


def _schedule(raw: dict[str, Any], n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Per-layer (kinds, ratios): explicit `layer_types` > the hub's `compress_ratios` > V4-Pro's default."""
    types = raw.get("layer_types")
    legacy = raw.get("compress_ratios")
    if types is None and legacy is not None:
        if len(legacy) < n:
            raise ValueError(f"compress_ratios has {len(legacy)} entries for {n} layers")
        kinds = tuple(_kind_of_ratio(int(r)) for r in legacy[:n])
        return kinds, tuple(0 if k == SLIDING else int(r) for k, r in zip(kinds, legacy[:n]))
    if types is None:  # two HCA layers to bootstrap, then CSA / HCA interleaved
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))
        ]
    unknown = sorted(set(types) - _KIND_OF_LAYER_TYPE.keys())
    if unknown or len(types) < n:
        raise ValueError(f"layer_types must list {n} of {sorted(_KIND_OF_LAYER_TYPE)}, got {types}")
    rates = dict(_DEFAULT_RATES)
    for layer_type, rate in (raw.get("compress_rates") or {}).items():
        if _KIND_OF_LAYER_TYPE.get(layer_type) not in rates:
            raise ValueError(f"compress_rates: unknown compressed layer type {layer_type!r}")
        rates[_KIND_OF_LAYER_TYPE[layer_type]] = int(rate)
    for kind, key in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):  # transformers' legacy scalars
        rates[kind] = int(_get(raw, key, rates[kind]))
    kinds = tuple(_KIND_OF_LAYER_TYPE[t] for t in types[:n])
    return kinds, tuple(0 if kind == SLIDING else rates[kind] for kind in kinds)


def _hash_layers(raw: dict[str, Any], n: int) -> int:
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        return min(n, int(_get(raw, "num_hash_layers", _DEFAULT_HASH_LAYERS)))
    mlp_types = list(mlp_types[:n])
    count = next((i for i, t in enumerate(mlp_types) if t != "hash_moe"), len(mlp_types))
    if len(mlp_types) < n or any(t != "moe" for t in mlp_types[count:]):
        raise ValueError(f"mlp_layer_types must be {n} entries, hash_moe first then moe, got {mlp_types}")
    return count


def _rope_head_dim(raw: dict[str, Any], head_dim: int) -> int:
    fraction = raw.get("partial_rotary_factor")
    if fraction is None and raw.get("qk_rope_head_dim") is not None:
        return int(raw["qk_rope_head_dim"])
    return int(head_dim * (_DEFAULT_ROPE_HEAD_DIM_FRACTION if fraction is None else float(fraction)))


def _rope(raw: dict[str, Any]) -> tuple[float, float, dict[str, Any] | None]:
    """(rope_theta, compress_rope_theta, YaRN of the compressed branches). Sliding layers never scale."""
    rope_theta = float(_get(raw, "rope_theta", 10000.0))
    compress_theta = float(_get(raw, "compress_rope_theta", 160000.0))
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    main, compress = params.get("main"), params.get("compress")
    if not (isinstance(main, dict) and isinstance(compress, dict)):
        # A flat dict (the hub's rope_scaling) is the compressed branches' YaRN. transformers pins its
        # attention_factor to 1 because V4 does not scale cos / sin by YaRN's mscale.
        return rope_theta, compress_theta, _yarn(params, default_attention_factor=1.0)
    if _rope_type(main) != "default":
        raise ValueError(f"rope_parameters.main: rope type {_rope_type(main)!r} is not supported")
    return (
        float(_get(main, "rope_theta", rope_theta)),
        float(_get(compress, "rope_theta", compress_theta)),
        _yarn(compress, default_attention_factor=None),
    )


def _rope_type(params: dict[str, Any]) -> str:
    return str(params.get("rope_type") or params.get("type") or "default")


def _yarn(params: dict[str, Any], default_attention_factor: float | None) -> dict[str, Any] | None:
    rope_type = _rope_type(params)
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"rope type {rope_type!r} is not supported (have default, yarn)")
    missing = [k for k in ("factor", "original_max_position_embeddings") if params.get(k) is None]
    if missing:
        raise ValueError(f"YaRN rope parameters lack {missing}: {params}")
    yarn: dict[str, Any] = {
        "factor": float(params["factor"]),
        "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        "beta_fast": float(params.get("beta_fast") or 32),  # transformers' defaults for absent / zero betas
        "beta_slow": float(params.get("beta_slow") or 1),
    }
    yarn |= {k: float(params[k]) for k in _YARN_FLOATS if params.get(k) is not None}
    if default_attention_factor is not None:
        yarn.setdefault("attention_factor", default_attention_factor)
    if params.get("truncate") is not None:
        yarn["truncate"] = bool(params["truncate"])
    return yarn


def load(path: Path, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Tensor]]:
    """keep_quantized: FP8 / FP4 weights stay as shipped (quant.py's types, for the GPU's kernels); otherwise
    (the CPU path and the reference) they are dequantized to bfloat16."""
    raw = json.loads((path / "config.json").read_text())
    if not is_deepseek_v4(raw.get("model_type", ""), raw.get("architectures") or []):
        raise ValueError(f"{path}: architectures {raw.get('architectures')} do not include {ARCH}")
    spec = parse_spec(raw)
    weights, sources = _canonical(_read(path, keep_quantized))
    tie = bool(_get(raw, "tie_word_embeddings", False))
    if tie and "head.weight" not in weights and "embed.weight" in weights:
        weights["head.weight"] = weights["embed.weight"]
    if not any(name.startswith("mtp.") for name in weights):
        # transformers never saves the MTP layers its config counts; the model runs without them.
        spec = replace(spec, num_mtp_layers=0, mtp_kinds=(), mtp_ratios=())
    _check(path, spec, weights, sources)
    return model_config(raw, spec), weights


def model_config(raw: dict[str, Any], spec: DeepseekV4Spec) -> ModelConfig:
    """The engine's record of a V4 model: `spec` and the config.json keys beyond it (tied head, bos / eos)."""
    eos = raw.get("eos_token_id", 1)  # an explicit null means none
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return ModelConfig(
        arch="deepseek_v4",
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=1,
        head_dim=spec.head_dim,
        intermediate_size=spec.moe_intermediate,
        rope_theta=spec.rope_theta,
        rms_eps=spec.rms_eps,
        max_position=spec.max_position,
        tie_embeddings=bool(_get(raw, "tie_word_embeddings", False)),
        bos_id=raw.get("bos_token_id", 0),
        eos_ids=tuple(sorted(int(t) for t in eos_ids)),
        spec=spec,
    )


# ---- reading (and dequantizing) ------------------------------------------------------------------------------


def _scale_names(name: str) -> tuple[str, ...]:
    """Where a weight's block scale may live: `<prefix>.scale` (hub) or `<name>_scale_inv` (transformers)."""
    inv = f"{name}_scale_inv"
    return (name.removesuffix(".weight") + ".scale", inv) if name.endswith(".weight") else (inv,)


def _read(path: Path, keep_quantized: bool) -> dict[str, Tensor]:
    """Every tensor of every shard, quantized ones with their scales consumed: kept as quant.py's types
    (keep_quantized, where the kernels can read the pair) or dequantized to bfloat16. One tensor is read at a
    time, so the peak is the output plus one quantized tensor."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    with ExitStack() as stack:
        shard: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():
                if name in shard:
                    raise ValueError(f"{path}: tensor {name!r} is in more than one shard")
                shard[name] = handle
        scale_of = {name: s for name in shard for s in _scale_names(name) if s in shard}
        scales = set(scale_of.values())
        tensors: dict[str, Tensor] = {}
        for name, handle in shard.items():
            if name in scales:
                continue
            tensor = handle.get_tensor(name)
            if name in scale_of:
                tensor = unpacked(tensor, shard[scale_of[name]].get_tensor(scale_of[name]), keep_quantized)
            elif tensor.dtype in QUANTIZED_DTYPES:
                raise ValueError(f"{path}: {name} is {tensor.dtype} but has no block scale {_scale_names(name)}")
            tensors[name] = tensor
    return tensors


def unpacked(weight: torch.Tensor, scale: torch.Tensor, keep_quantized: bool) -> Tensor:
    """A checkpoint's (weight, block scale) pair as served: kept as quant.py's type where the kernels read it and
    keep_quantized says so, otherwise dequantized to bfloat16 (dummy.py serves its quantized draws through this
    too, so they are what a real checkpoint's pairs become)."""
    if keep_quantized:
        try:
            return quantized(weight, scale)
        except ValueError:  # a block layout the kernels do not read: served dequantized
            pass
    return dequantize(weight, scale)


# ---- names ---------------------------------------------------------------------------------------------------

_TOP_NAMES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_LAYER = re.compile(r"((?:layers|mtp)\.\d+)\.(.+)")
# transformers' conversion table for deepseek_v4, inverted; applied in order to the part after `layers.N.`.
# Every hub name passes through unchanged.
_LAYER_RENAMES = [(re.compile(p), r) for p, r in (
    (r"^self_attn\.", "attn."),
    (r"^mlp\.", "ffn."),
    (r"^input_layernorm\.", "attn_norm."),
    (r"^post_attention_layernorm\.", "ffn_norm."),
    (r"^(attn|ffn)_hc\.(fn|base|scale)$", r"hc_\1_\2"),
    (r"^attn\.sinks$", "attn.attn_sink"),
    (r"^attn\.compressor\.indexer\.scorer\.weights_proj\.", "attn.indexer.weights_proj."),
    (r"^attn\.compressor\.indexer\.q_b_proj\.", "attn.indexer.wq_b."),
    (r"^attn\.compressor\.indexer\.", "attn.indexer.compressor."),
    (r"compressor\.kv_norm\.", "compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.kv_proj\.", ".wkv."),
    (r"compressor\.gate_proj\.", "compressor.wgate."),
    (r"^attn\.q_a_proj\.", "attn.wq_a."),
    (r"^attn\.q_a_norm\.", "attn.q_norm."),
    (r"^attn\.q_b_proj\.", "attn.wq_b."),
    (r"^attn\.o_a_proj\.", "attn.wo_a."),
    (r"^attn\.o_b_proj\.", "attn.wo_b."),
    (r"^attn\.norm\.", "attn.kv_norm."),  # save_pretrained's lossy reverse of transformers' `.norm.` -> `.kv_norm.`
    (r"^ffn\.gate\.e_score_correction_bias$", "ffn.gate.bias"),
    (r"^ffn\.shared_experts\.gate_proj\.", "ffn.shared_experts.w1."),
    (r"^ffn\.shared_experts\.down_proj\.", "ffn.shared_experts.w2."),
    (r"^ffn\.shared_experts\.up_proj\.", "ffn.shared_experts.w3."),
)]


def _canonical_name(name: str) -> str:
    """The hub's name for a tensor of any dialect (stacked expert tensors keep their `experts.*_proj` leaf)."""
    name = name.removeprefix("model.")
    layer = _LAYER.fullmatch(name)
    if layer is None:
        return _TOP_NAMES.get(name, name)
    prefix, leaf = layer.groups()
    for pattern, replacement in _LAYER_RENAMES:
        leaf = pattern.sub(replacement, leaf)
    return f"{prefix}.{leaf}"


def _canonical(tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(weights under hub names, hub name -> checkpoint name for error messages)."""
    weights: dict[str, Tensor] = {}
    sources: dict[str, str] = {}
    for source, tensor in tensors.items():
        name = _canonical_name(source)
        stacked = name.endswith((".ffn.experts.gate_up_proj", ".ffn.experts.down_proj"))
        if stacked and not isinstance(tensor, torch.Tensor):  # transformers' stacked experts: not a hub layout
            tensor = as_dense(tensor, torch.bfloat16)
        if name.endswith(".ffn.experts.gate_up_proj"):  # (E, 2I, D) = [w1; w3] per expert
            w1, w3 = tensor.chunk(2, dim=1)
            parts = {f"{e}.{w}.weight": t[e] for w, t in (("w1", w1), ("w3", w3)) for e in range(len(tensor))}
        elif name.endswith(".ffn.experts.down_proj"):  # (E, D, I)
            parts = {f"{e}.w2.weight": tensor[e] for e in range(len(tensor))}
        else:
            parts = {"": tensor}
        for suffix, part in parts.items():
            full = f"{name.rsplit('.', 1)[0]}.{suffix}" if suffix else name
            if full in weights:
                raise ValueError(f"{source} and {sources[full]} both load as {full}")
            weights[full] = part.long() if full.endswith(".tid2eid") else part
            sources[full] = source
    return weights, sources


# ---- what a checkpoint must hold -----------------------------------------------------------------------------


def _block_names(prefix: str, kind: str, hashed: bool, spec: DeepseekV4Spec) -> tuple[set[str], set[str]]:
    """(required, optional) tensor names of one transformer block, main or MTP."""
    names = {f"{prefix}.{n}" for n in ("attn_norm.weight", "ffn_norm.weight", "attn.attn_sink", "ffn.gate.weight")}
    names |= {f"{prefix}.hc_{part}_{p}" for part in ("attn", "ffn") for p in ("fn", "base", "scale")}
    names |= {f"{prefix}.attn.{m}.weight" for m in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")}
    compressors = {SLIDING: [], HCA: ["attn.compressor"], CSA: ["attn.compressor", "attn.indexer.compressor"]}[kind]
    for c in compressors:
        names |= {f"{prefix}.{c}.{m}" for m in ("wkv.weight", "wgate.weight", "ape", "norm.weight")}
    if kind == CSA:
        names |= {f"{prefix}.attn.indexer.wq_b.weight", f"{prefix}.attn.indexer.weights_proj.weight"}
    names |= {f"{prefix}.ffn.experts.{e}.w{k}.weight" for e in range(spec.num_experts) for k in (1, 2, 3)}
    if spec.num_shared_experts:
        names |= {f"{prefix}.ffn.shared_experts.w{k}.weight" for k in (1, 2, 3)}
    names.add(f"{prefix}.ffn.gate.tid2eid" if hashed else f"{prefix}.ffn.gate.bias")
    return names, ({f"{prefix}.ffn.gate.bias"} if hashed else set())


def expected_names(spec: DeepseekV4Spec) -> tuple[set[str], set[str]]:
    required = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    optional: set[str] = set()
    blocks = [(f"layers.{i}", kind, i < spec.hash_layers) for i, kind in enumerate(spec.kinds)]
    blocks += [(f"mtp.{j}", kind, False) for j, kind in enumerate(spec.mtp_kinds)]
    for prefix, kind, hashed in blocks:
        must, may = _block_names(prefix, kind, hashed, spec)
        required |= must
        optional |= may
    for j in range(spec.num_mtp_layers):
        required |= {f"mtp.{j}.{n}" for n in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight",
                                               "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")}
    return required, optional


def _check(path: Path, spec: DeepseekV4Spec, weights: dict[str, Tensor], sources: dict[str, str]) -> None:
    required, optional = expected_names(spec)
    unknown = sorted({sources.get(n, n) for n in weights.keys() - required - optional})
    if unknown:
        raise ValueError(f"{path}: {len(unknown)} tensors this DeepSeek-V4 config has no place for: {_few(unknown)}")
    missing = sorted(required - weights.keys())
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensors missing: {_few(missing)}")


def _few(names: list[str], limit: int = 20) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
