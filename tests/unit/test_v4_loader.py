"""The DeepSeek-V4 loader against transformers' reference: every dialect (save_pretrained, transformers' module
names, the hub's own), quantized or not, loads to the spec transformers' config implies and to the very tensors
of the transformers model."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from shared.engine.loader import deepseek_v4, hf
from shared.engine.loader import load as load_files
from shared.engine.models.deepseek_v4.spec import CSA, HCA, SLIDING, DeepseekV4Spec
from shared.models import resolve
from tests.v4_checkpoints import (
    E2M1,
    build,
    expand_scale,
    fp4_quantize,
    fp8_quantize,
    hub_state_dict,
    make_representable,
    quantized_kind,
    save_hub_dialect,
)


KINDS = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA}


def expected_fields(config: Any) -> dict[str, Any]:
    """The spec's non-MTP fields, read off a transformers DeepseekV4Config (which has already folded in every
    legacy key and default)."""
    compress = config.rope_parameters["compress"]
    yarn = None
    if compress["rope_type"] == "yarn":
        yarn = {"factor": float(compress["factor"]),
                "original_max_position_embeddings": int(compress["original_max_position_embeddings"]),
                "beta_fast": float(compress.get("beta_fast") or 32), "beta_slow": float(compress.get("beta_slow") or 1)}
        yarn |= {k: float(compress[k]) for k in ("mscale", "mscale_all_dim", "attention_factor") if k in compress}
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads, head_dim=config.head_dim,
        rope_head_dim=int(config.head_dim * config.partial_rotary_factor), q_lora_rank=config.q_lora_rank,
        o_groups=config.o_groups, o_lora_rank=config.o_lora_rank, window=config.sliding_window,
        kinds=tuple(KINDS[t] for t in config.layer_types),
        ratios=tuple(0 if t == "sliding_attention" else config.compress_rates[t] for t in config.layer_types),
        hash_layers=config.mlp_layer_types.count("hash_moe"), index_heads=config.index_n_heads,
        index_head_dim=config.index_head_dim, index_topk=config.index_topk, num_experts=config.n_routed_experts,
        experts_per_token=config.num_experts_per_tok, num_shared_experts=config.n_shared_experts,
        moe_intermediate=config.moe_intermediate_size, scoring=config.scoring_func,
        norm_topk_prob=config.norm_topk_prob, routed_scale=config.routed_scaling_factor,
        swiglu_limit=config.swiglu_limit, hc_mult=config.hc_mult, hc_iters=config.hc_sinkhorn_iters,
        hc_eps=config.hc_eps, rope_theta=config.rope_parameters["main"]["rope_theta"],
        compress_rope_theta=compress["rope_theta"], compress_rope_scaling=yarn, rms_eps=config.rms_norm_eps,
        max_position=config.max_position_embeddings,
    )


def without_mtp(spec: DeepseekV4Spec) -> dict[str, Any]:
    fields = asdict(spec)
    for key in ("num_mtp_layers", "mtp_kinds", "mtp_ratios"):
        del fields[key]
    return fields


@pytest.fixture(scope="module", params=["mixed", "hca_first"])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp(request.param)
    return build(path, request.param), path


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape and torch.equal(got[name].to(tensor.dtype), tensor), name


# ---- transformers' dialects -----------------------------------------------------------------------------------


def test_save_pretrained_dialect_gives_transformers_spec_and_config(built: tuple[Any, Path]) -> None:
    model, path = built
    config, weights = hf.load(path)
    spec = config.spec
    assert without_mtp(spec) == expected_fields(model.config)
    assert (spec.num_mtp_layers, spec.mtp_kinds, spec.mtp_ratios) == (0, (), ())  # no MTP weights saved
    raw = json.loads((path / "config.json").read_text())
    assert deepseek_v4.parse_spec(raw).mtp_kinds == (SLIDING,) * model.config.num_nextn_predict_layers
    assert (config.arch, config.num_kv_heads, config.head_dim, config.intermediate_size) == (
        "deepseek_v4", 1, spec.head_dim, spec.moe_intermediate)
    assert (config.rope_theta, config.rms_eps, config.max_position, config.tie_embeddings) == (
        spec.rope_theta, spec.rms_eps, spec.max_position, False)
    assert (config.bos_id, config.eos_ids) == (0, (1,))


def test_save_pretrained_dialect_gives_the_model_tensors(built: tuple[Any, Path]) -> None:
    model, path = built
    _, weights = hf.load(path)
    assert_same_tensors(weights, hub_state_dict(model))
    assert all(w.dtype == torch.int64 for n, w in weights.items() if n.endswith("tid2eid"))


def test_transformers_module_names_load_too(built: tuple[Any, Path], tmp_path: Path) -> None:
    """Stacked experts, self_attn.q_a_proj, compressor.indexer.*, attn_hc.fn ...: the names tools that dump
    transformers' state_dict write."""
    model, path = built
    shutil.copy(path / "config.json", tmp_path / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    weights = load_files(resolve(str(tmp_path))).weights
    assert_same_tensors(weights, hub_state_dict(model))


def test_tied_head_is_the_embedding(built: tuple[Any, Path], tmp_path: Path) -> None:
    _, path = built
    raw = json.loads((path / "config.json").read_text()) | {"tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config, weights = hf.load(tmp_path)
    assert config.tie_embeddings and weights["head.weight"] is weights["embed.weight"]


# ---- the hub's dialect ----------------------------------------------------------------------------------------


def test_hub_dialect_gives_the_same_spec_and_tensors(built: tuple[Any, Path], tmp_path: Path) -> None:
    model, path = built
    truth = save_hub_dialect(model, tmp_path)
    config, weights = hf.load(tmp_path)
    assert without_mtp(config.spec) == without_mtp(hf.load(path)[0].spec)
    assert (config.spec.num_mtp_layers, config.spec.mtp_kinds, config.spec.mtp_ratios) == (1, (SLIDING,), (0,))
    assert_same_tensors(weights, truth)


def test_hub_dialect_quantized_is_within_quantization_error(built: tuple[Any, Path], tmp_path: Path) -> None:
    model, _ = built
    truth = save_hub_dialect(model, tmp_path, quantize=True)
    _, weights = hf.load(tmp_path)
    assert weights.keys() == truth.keys()  # every `.scale` consumed
    kinds = {name: quantized_kind(name, tensor) for name, tensor in truth.items()}
    assert {"fp8", "fp4", None} == set(kinds.values())
    for name, want in truth.items():
        got = weights[name]
        if kinds[name] is None:
            assert got.dtype == want.dtype and torch.equal(got, want), name
            continue
        assert got.dtype == torch.bfloat16, name
        err = (got.float() - want).abs()
        if kinds[name] == "fp8":  # 3 mantissa bits (+ bf16 rounding); subnormals near zero
            assert (err <= 0.07 * want.abs() + 1e-5 * want.abs().max()).all(), name
        else:  # e2m1 steps are at most 2 scale units; the scale is at most amax / 3 of its 32 columns
            amax = want.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True).expand(-1, -1, 32).flatten(-2)
            assert (err <= amax / 3 + 1e-6).all(), name


def test_hub_dialect_quantized_is_exact_for_representable_weights(tmp_path: Path) -> None:
    model = build(tmp_path / "t", "mixed", seed=3)
    make_representable(model)
    truth = save_hub_dialect(model, tmp_path / "hub", quantize=True)
    _, weights = hf.load(tmp_path / "hub")
    assert_same_tensors(weights, truth)


# ---- config.json keys -----------------------------------------------------------------------------------------


HUB_FLASH_LIKE = {
    "architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 6, "hidden_size": 256, "head_dim": 128,
    "qk_rope_head_dim": 32, "num_hash_layers": 2, "compress_ratios": [0, 0, 4, 128, 4, 128, 0],
    "num_nextn_predict_layers": 1, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


@pytest.mark.parametrize("raw", [
    {},  # every default: V4-Pro's layer schedule, 3 hash layers, 64 of 512 rotary channels
    HUB_FLASH_LIKE,
    {"num_hidden_layers": 5, "compress_rate_csa": 8, "compress_rate_hca": 64, "partial_rotary_factor": 0.25},
    {"num_hidden_layers": 2, "mlp_layer_types": ["hash_moe", "moe"], "num_hash_layers": 0,
     "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}},
], ids=["defaults", "hub-flash", "legacy-rates", "flat-rope-parameters"])
def test_parse_spec_agrees_with_transformers_config(raw: dict[str, Any]) -> None:
    config = transformers.DeepseekV4Config(**copy.deepcopy(raw))
    spec = deepseek_v4.parse_spec(raw)
    assert without_mtp(spec) == expected_fields(config)
    assert spec.num_mtp_layers == config.num_nextn_predict_layers


def test_parse_spec_hub_mtp_and_yarn() -> None:
    spec = deepseek_v4.parse_spec(HUB_FLASH_LIKE | {"num_nextn_predict_layers": 2})
    assert spec.kinds == (SLIDING, SLIDING, CSA, HCA, CSA, HCA) and spec.ratios == (0, 0, 4, 128, 4, 128)
    assert (spec.mtp_kinds, spec.mtp_ratios) == ((SLIDING, SLIDING), (0, 0))  # one listed, one defaulted
    assert spec.compress_rope_scaling == {"factor": 16.0, "original_max_position_embeddings": 65536,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "attention_factor": 1.0}
    assert spec.block_tokens == 128


@pytest.mark.parametrize("raw, match", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "original_max_position_embeddings"),
    ({"num_hidden_layers": 2, "mlp_layer_types": ["moe", "hash_moe"]}, "hash_moe first"),
    ({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"num_hidden_layers": 3, "compress_ratios": [0, 4]}, "compress_ratios"),
])
def test_parse_spec_rejects_what_it_cannot_represent(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        deepseek_v4.parse_spec(raw)


# ---- dequantization -------------------------------------------------------------------------------------------


def test_fp4_low_nibble_is_the_even_column() -> None:
    packed = torch.tensor([[0x21, 0xF7] * 16], dtype=torch.uint8).view(torch.int8)  # (1, 32) bytes: 64 values
    out = deepseek_v4.dequantize(packed, torch.tensor([[127, 128]], dtype=torch.uint8))  # scales 1 and 2
    assert out.dtype == torch.bfloat16
    assert out[0, :4].tolist() == [0.5, 1.0, 6.0, -6.0] and out[0, 32:36].tolist() == [1.0, 2.0, 12.0, -12.0]
    fp4 = deepseek_v4.dequantize(packed.view(torch.float4_e2m1fn_x2), torch.tensor([[1.0, 2.0]]))
    assert torch.equal(fp4, out)


def test_scale_dtypes_agree() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    packed, e8m0 = fp4_quantize(w)
    as_uint8 = deepseek_v4.dequantize(packed, e8m0.view(torch.uint8))
    assert torch.equal(deepseek_v4.dequantize(packed, e8m0), as_uint8)
    assert torch.equal(deepseek_v4.dequantize(packed, e8m0.float()), as_uint8)


@pytest.mark.parametrize("shape, grid, block", [
    ((129, 200), (2, 2), (128, 128)),  # 128x128 blocks over ragged edges, as on a 129280-row head
    ((48, 64), (2, 2), (32, 32)),
    ((2, 64), (1, 2), (2, 32)),
    ((96, 96), (3, 3), (32, 32)),
    ((99, 30), (3, 1), (33, 30)),  # no power of two tiles 99 rows into 3: the even split
])
def test_fp8_blocks_follow_the_scale_grid(shape: tuple[int, int], grid: tuple[int, int],
                                          block: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(shape, generator=g) * 4).to(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-4, 5, grid, generator=g).float())  # a different factor per block
    want = (q.float() * expand_scale(scale, *shape, *block)).bfloat16()
    assert torch.equal(deepseek_v4.dequantize(q, scale), want)


def test_stacked_experts_dequantize_per_expert() -> None:
    w = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(2))
    pairs = [fp8_quantize(e) for e in w]
    stacked = deepseek_v4.dequantize(torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs]))
    for e, (q, s) in enumerate(pairs):
        assert torch.equal(stacked[e], deepseek_v4.dequantize(q, s))


def test_e2m1_table_matches_the_test_helper() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(1, 256)
    out = deepseek_v4.dequantize(codes.view(torch.int8), torch.ones(1, 16))
    assert torch.equal(out.float().view(256, 2), torch.stack((E2M1.repeat(16), E2M1.repeat_interleave(16)), -1))


# ---- errors ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hub")
    save_hub_dialect(build(base / "t", "hca_first"), base / "hub")
    return base / "hub"


def edited(hub_dir: Path, tmp_path: Path, drop: str | None = None, add: dict[str, torch.Tensor] | None = None,
           config: dict[str, Any] | None = None) -> Path:
    raw = json.loads((hub_dir / "config.json").read_text()) | (config or {})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(hub_dir / "model-00001-of-00002.safetensors"))
    tensors.pop(drop or "", None)
    save_file(tensors | (add or {}), str(tmp_path / "model.safetensors"))
    return tmp_path


def test_unknown_tensor_is_named(hub_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.bogus\.weight"):
        hf.load(edited(hub_dir, tmp_path, add={"layers.0.attn.bogus.weight": torch.zeros(2)}))


def test_tensor_the_layer_kind_has_no_place_for_is_named(hub_dir: Path, tmp_path: Path) -> None:
    """Layer 0 is HCA: a compressor but no indexer."""
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.indexer\.wq_b\.weight"):
        hf.load(edited(hub_dir, tmp_path, add={"layers.0.attn.indexer.wq_b.weight": torch.zeros(2)}))


def test_missing_tensor_is_named(hub_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"missing: layers\.1\.attn\.indexer\.wq_b\.weight"):
        hf.load(edited(hub_dir, tmp_path, drop="layers.1.attn.indexer.wq_b.weight"))


def test_hash_layer_needs_its_table(hub_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.gate\.tid2eid"):
        hf.load(edited(hub_dir, tmp_path, drop="layers.0.ffn.gate.tid2eid"))


def test_quantized_tensor_without_scale(hub_dir: Path, tmp_path: Path) -> None:
    fp8 = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight.*no block scale"):
        hf.load(edited(hub_dir, tmp_path, add={"layers.0.attn.wq_a.weight": fp8}))


def test_unsupported_architecture(hub_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"MixtralForCausalLM.*not supported.*DeepseekV4ForCausalLM"):
        hf.load(edited(hub_dir, tmp_path, config={"architectures": ["MixtralForCausalLM"]}))


def test_a_config_naming_only_the_model_type_loads(tmp_path: Path) -> None:
    build(tmp_path, "mixed")
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config, _ = hf.load(tmp_path)
    assert config.arch == "deepseek_v4"
