"""Quantized weights on the CPU (shared/engine/quant.py): the FP8 / FP4 types against the loader's dequantize and
the tests' own hub-dialect helpers, a hub checkpoint loaded with keep_quantized (the GPU's path, asked for on a
CPU), which linears the V4 model keeps quantized, and the memory line a worker logs at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine import memory, quant
from shared.engine.engine import Engine
from shared.engine.loader import hf
from shared.engine.models.deepseek_v4 import weights as v4_weights
from shared.engine.quant import Fp4Weight, Fp8Weight
from tests import v4_checkpoints

# ---- the types and their math -------------------------------------------------------------------------------


def test_fp8_pair_keeps_the_hub_bytes_and_dequantizes_as_the_loader() -> None:
    w = torch.randn(80, 96, generator=torch.Generator().manual_seed(0))
    q, scale = v4_checkpoints.fp8_quantize(w)  # 32 x 32 blocks, partial at the ends (80 rows, 96 columns)
    kept = quant.quantized(q, scale)
    assert isinstance(kept, Fp8Weight) and kept.block == (32, 32) and kept.data is q
    assert torch.equal(kept.dequantize(), quant.dequantize(q, scale))
    assert kept.nbytes == q.nbytes + scale.nbytes


def test_fp4_pair_keeps_packed_bytes_and_e8m0_exponents() -> None:
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    packed, e8m0 = v4_checkpoints.fp4_quantize(w)  # int8 pairs, float8_e8m0fnu per 32 columns
    kept = quant.quantized(packed, e8m0)
    assert isinstance(kept, Fp4Weight) and kept.block == 32 and kept.shape == (6, 64)
    assert kept.data.dtype == torch.uint8 and kept.scale.dtype == torch.uint8
    assert torch.equal(kept.scale, e8m0.view(torch.uint8))
    assert torch.equal(kept.dequantize(), quant.dequantize(packed, e8m0))
    # power-of-two float scales become the same exponents; others cannot stay quantized
    assert torch.equal(quant.quantized(packed, e8m0.float()).scale, kept.scale)
    with pytest.raises(ValueError, match="powers of two"):
        quant.quantized(packed, e8m0.float() * 1.5)


def test_pairs_the_kernels_cannot_read_are_refused() -> None:
    q, scale = v4_checkpoints.fp8_quantize(torch.randn(64, 64))
    with pytest.raises(ValueError, match="does not fit"):
        quant.quantized(q, scale[:, :1, None])
    with pytest.raises(ValueError, match="per row"):
        quant.quantized(torch.zeros(4, 16, dtype=torch.uint8), torch.ones(2, 1))
    with pytest.raises(ValueError, match="cannot keep"):
        quant.quantized(torch.zeros(4, 4), torch.ones(1, 1))


def test_quantize_helpers_round_trip_representable_weights() -> None:
    """quantize_fp8 / quantize_fp4 (what the bench builds V4-Flash with): a weight already on the grid comes back
    exactly; a random one within half a step of its block's grid."""
    g = torch.Generator().manual_seed(2)
    codes = v4_checkpoints.E2M1[torch.randint(16, (3, 40, 64), generator=g)]
    exps = torch.exp2(torch.randint(-4, 3, (3, 40, 2), generator=g).float())
    on_grid = codes * exps.repeat_interleave(32, -1)
    # a block whose largest magnitude is 6 x its factor (any block with a 6 or -6): exact
    on_grid[..., ::32] = 6 * exps
    fp4 = quant.quantize_fp4(on_grid)
    assert torch.equal(fp4.dequantize(torch.float32), on_grid)
    w = torch.randn(96, 160, generator=g)
    fp8 = quant.quantize_fp8(w, block=32)
    assert fp8.block == (32, 32) and fp8.scale.shape == (3, 5)
    assert torch.equal(fp8.dequantize(torch.float32), quant.dequantize(fp8.data, fp8.scale).float())
    err = (fp8.dequantize(torch.float32) - w).abs()
    assert bool((err <= 2**-4 * w.abs() + 2**-9 * w.abs().max()).all())  # e4m3: 3 mantissa bits, subnormals


def test_stacked_fp8_weights_index_per_matrix() -> None:
    w = quant.quantize_fp8(torch.randn(128, 64), block=32)
    stacked = Fp8Weight(torch.stack([w.data, w.data]), torch.stack([w.scale, w.scale]), w.block)
    assert torch.equal(stacked[1].dequantize(), w.dequantize())


def test_grouped_linear_of_a_dense_weight_is_the_per_group_product() -> None:
    """linear(x, W, groups): block g of W's rows times x's g-th slice of columns (V4's wo_a)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 3 * 8, generator=g), torch.randn(3 * 4, 8, generator=g)
    want = torch.cat([x[:, 8 * i : 8 * (i + 1)] @ w[4 * i : 4 * (i + 1)].T for i in range(3)], dim=1)
    torch.testing.assert_close(quant.linear(x, w, groups=3), want)


# ---- a hub checkpoint kept quantized ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("hub-q")
    model = v4_checkpoints.build(root / "hf", "mixed")
    truth = v4_checkpoints.save_hub_dialect(model, root / "hub", quantize=True)
    return root / "hub", truth


def test_hub_checkpoint_loads_quantized(hub: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, truth = hub
    _, dense = hf.load(path)
    _, kept = hf.load(path, keep_quantized=True)
    assert kept.keys() == dense.keys() == truth.keys()
    kinds = {"fp8": Fp8Weight, "fp4": Fp4Weight, None: torch.Tensor}
    for name, tensor in truth.items():
        want = kinds[v4_checkpoints.quantized_kind(name, tensor)]
        assert isinstance(kept[name], want), name
        if want is torch.Tensor:  # embeddings, norms, router, mHC: the checkpoint's dtype, untouched
            assert kept[name].dtype == dense[name].dtype and torch.equal(kept[name], dense[name]), name
        else:
            assert torch.equal(kept[name].dequantize(), dense[name]), name
    assert any(isinstance(t, Fp4Weight) for t in kept.values()) and isinstance(kept["head.weight"], Fp8Weight)


def test_v4_model_keeps_what_its_kernels_read(hub: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """With quantized=True: FP8 projections (wo_a only where a group is whole 32-row blocks: not at o_lora_rank
    16), FP8 shared expert, FP4 routed experts stacked; the router, norms and embedding dense. Without: all dense,
    equal to the dequantized checkpoint's."""
    path, _ = hub
    config, kept = hf.load(path, keep_quantized=True)
    spec = config.spec
    q = v4_weights.load(spec, kept, torch.device("cpu"), torch.float32, quantized=True)
    plain = v4_weights.load(spec, kept, torch.device("cpu"), torch.float32)
    layer, ref = q.layers[1], plain.layers[1]
    for merged, dense in ((layer.wx, ref.wx), (layer.wq, ref.wq)):  # the parts, as views of the merged weights
        for name in merged.names:
            shipped = kept[f"layers.1.attn.{name}.weight"]
            assert type(merged.part(name)) is type(shipped), name  # FP8 stays FP8, a dense part stays dense
            assert torch.equal(quant.as_dense(merged.part(name), torch.float32), dense.part(name)), name
    assert "compressor.wkv" in layer.wx.names and "indexer.wq_b" in layer.wq.names
    assert isinstance(layer.wq.part("wq_b"), Fp8Weight) and isinstance(layer.wx.part("wq_a"), Fp8Weight)
    assert isinstance(layer.wo_b, Fp8Weight) and torch.equal(layer.wo_b.dequantize(torch.float32), ref.wo_b)
    assert isinstance(layer.wo_a, torch.Tensor) and torch.equal(layer.wo_a, ref.wo_a)
    assert isinstance(layer.experts.w13, Fp4Weight) and layer.experts.w13.shape == ref.experts.w13.shape
    assert torch.equal(layer.experts.w13.dequantize(torch.float32), ref.experts.w13)
    assert torch.equal(layer.experts.w2.dequantize(torch.float32), ref.experts.w2)
    assert isinstance(layer.shared.w13, Fp8Weight) and torch.equal(layer.shared.w13.dequantize(torch.float32),
                                                                   ref.shared.w13)
    assert isinstance(q.head, Fp8Weight) and isinstance(q.mtp.e_proj, Fp8Weight)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32
               for t in (layer.gate, layer.attn_norm, q.embed, *layer.hc_attn))
    assert isinstance(plain.head, torch.Tensor) and isinstance(plain.layers[0].experts.w13, torch.Tensor)


def test_quantized_weights_take_fewer_bytes(hub: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = hub
    config, kept = hf.load(path, keep_quantized=True)
    bf16 = v4_weights.load(config.spec, kept, torch.device("cpu"), torch.bfloat16)
    q = v4_weights.load(config.spec, kept, torch.device("cpu"), torch.bfloat16, quantized=True)
    experts = bf16.layers[1].experts
    fp4 = q.layers[1].experts
    # e2m1 is half a byte, plus one e8m0 byte per 32: (0.5 + 1/32) / 2 of bfloat16's bytes
    assert memory.held_bytes(fp4) * 64 == memory.held_bytes(experts) * 17
    assert memory.held_bytes(q) < memory.held_bytes(bf16) * 0.6


# ---- the memory line ----------------------------------------------------------------------------------------


def test_memory_report_line() -> None:
    report = memory.MemoryReport(weight_bytes=3 << 30, kv_bytes=1 << 30, kv_blocks=512, block_tokens=128,
                                 state_bytes=1 << 29, context_cap=4096)
    assert report.tokens == 65536
    assert report.line() == ("memory: weights 3.00 GiB, KV pool 1.00 GiB (512 blocks of 128 tokens) + request "
                             "state 0.50 GiB: 65536 tokens of context fit (16 sequences at the full 4096)")


def test_engine_reports_its_memory(hub: tuple[Path, dict[str, torch.Tensor]]) -> None:
    engine = Engine(str(hub[0]), kv_blocks=6)
    report = engine.memory()
    assert report.kv_blocks == 6 and report.block_tokens == engine.block_tokens
    assert report.kv_bytes == 6 * engine.spec.bytes_per_block and report.tokens == 6 * engine.block_tokens
    assert report.weight_bytes == memory.held_bytes(engine.model.weights) > 0
    assert report.state_bytes == 2 * engine.max_running * engine.spec.per_request_state_bytes > 0
    with pytest.raises(ValueError, match="quantization"):
        Engine(str(hub[0]), kv_blocks=6, quantization="int4")


def test_quantization_flag_names_agree_and_bad_ones_are_refused() -> None:
    from shared.engine.engine import QUANTIZATIONS
    from shared.worker import config as worker

    assert worker.QUANTIZATIONS == QUANTIZATIONS  # the worker's flag is checked without importing the engine
    assert worker.WorkerConfig(device="cpu").quantization == "auto"
    with pytest.raises(ValueError, match="--quantization"):
        worker.WorkerConfig(device="cpu", quantization="fp4")
