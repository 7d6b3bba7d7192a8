"""Merged projections (shared/engine/merged_linear.py) and DeepSeek-V4's use of them (weights.py Layer.wx / wq):
each part's output, a column view of one GEMM, equals that part's own linear; FP8 parts merge only when their
rows are whole scale blocks of one layout, the others stay weights of their own.

fp32 on a CPU; FP8 products through the Triton GEMM under TRITON_INTERPRET=1 (conftest), whose weights are
exactly the dequantized ones: only the order of float32 sums differs (tolerances ~1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.engine.kernels import HAVE_TRITON
from shared.engine.loader import hf
from shared.engine.merged_linear import merge
from shared.engine.models.deepseek_v4 import weights as v4_weights
from shared.engine.models.deepseek_v4.spec import CSA, HCA, SLIDING
from shared.engine.quant import Fp8Weight, as_dense, quantize_fp8
from tests import v4_checkpoints

X_PARTS = {SLIDING: ["wq_a", "wkv"], HCA: ["wq_a", "wkv", "compressor.wkv", "compressor.wgate"],
           CSA: ["wq_a", "wkv", "compressor.wkv", "compressor.wgate", "indexer.compressor.wkv",
                 "indexer.compressor.wgate", "indexer.weights_proj"]}
Q_PARTS = {SLIDING: ["wq_b"], HCA: ["wq_b"], CSA: ["wq_b", "indexer.wq_b"]}


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _storages(out: dict[str, torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in out.values()}


def test_merged_columns_are_each_parts_linear() -> None:
    parts = {"a": _randn(48, 64, seed=1), "b": _randn(32, 64, seed=2), "c": _randn(8, 64, seed=3)}
    merged = merge(parts)
    assert len(merged.weights) == 1 and merged.weights[0].shape == (88, 64) and merged.names == ("a", "b", "c")
    x = _randn(5, 64, seed=4)
    out = merged(x)
    assert len(_storages(out)) == 1  # column views of one product, no copies
    for name, w in parts.items():
        assert torch.equal(merged.part(name), w), name
        torch.testing.assert_close(out[name], F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_beyond_max_rows_each_part_has_its_own_product() -> None:
    parts = {"a": _randn(16, 32, seed=5), "b": _randn(24, 32, seed=6)}
    merged = merge(parts, max_rows=1)
    x = _randn(3, 32, seed=7)
    one, many = merged(x[:1]), merged(x)
    assert len(_storages(one)) == 1 and all(t.is_contiguous() for t in one.values())  # one row: views contiguous
    assert len(_storages(many)) == 2 and all(t.is_contiguous() for t in many.values())
    for name, w in parts.items():
        torch.testing.assert_close(many[name], F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(one[name], F.linear(x[:1], w), rtol=1e-5, atol=1e-5)


def test_fp8_parts_merge_only_on_whole_scale_blocks() -> None:
    """128- and 256-row parts of 128 x 128 blocks merge; a 64-row one (a partial block), a part of 64 x 64 blocks
    and a dense part stay apart: four weights, the merged one's part views the original bytes and scales."""
    K = 256
    parts = {"a": quantize_fp8(_randn(128, K, seed=8)), "partial": quantize_fp8(_randn(64, K, seed=9)),
             "b": quantize_fp8(_randn(256, K, seed=10)), "small_blocks": quantize_fp8(_randn(64, K, seed=11), 64),
             "dense": _randn(32, K, seed=12)}
    merged = merge(parts)
    assert [s.names for s in merged.splits] == [("a", "b"), ("partial",), ("small_blocks",), ("dense",)]
    fp8 = merged.weights[0]
    assert isinstance(fp8, Fp8Weight) and fp8.shape == (384, K) and fp8.scale.shape == (3, 2)
    for name, w in parts.items():
        view = merged.part(name)
        if isinstance(w, Fp8Weight):
            assert isinstance(view, Fp8Weight) and torch.equal(view.data.view(torch.uint8), w.data.view(torch.uint8))
            assert torch.equal(view.scale, w.scale) and view.block == w.block, name
        else:
            assert torch.equal(view, w)
    if not HAVE_TRITON:
        return
    x = _randn(3, K, seed=13)
    out = merged(x)
    for name, w in parts.items():
        torch.testing.assert_close(out[name], F.linear(x, as_dense(w, torch.float32)), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub-merged")
    v4_checkpoints.save_hub_dialect(v4_checkpoints.build(root / "hf", "mixed"), root / "hub", quantize=True)
    return root / "hub"


@pytest.mark.parametrize("quantized", [False, True])
def test_v4_layers_merge_their_projections(hub: Path, quantized: bool) -> None:
    """Every layer kind (and the MTP layer): wx holds the linears of x and wq those of q_res, under the
    checkpoint's names; each part's column of the merged product equals the part's own linear. Dense: one weight
    each. FP8 (the tiny hub's 32-row blocks): wq_a (48 rows) and weights_proj (2) end inside a scale block and
    stay alone, the FP8 parts on whole blocks merge, the compressors' dense gates merge apart."""
    config, kept = hf.load(hub, keep_quantized=True)
    spec = config.spec
    w = v4_weights.load(spec, kept, torch.device("cpu"), torch.float32, quantized=quantized)
    assert w.mtp is not None
    layers = [(f"layers.{i}.attn.", kind, layer) for i, (kind, layer) in enumerate(zip(spec.kinds, w.layers))]
    layers.append(("mtp.0.attn.", SLIDING, w.mtp.layer))
    g = torch.Generator().manual_seed(14)
    x = torch.randn(3, spec.hidden_size, generator=g)
    q_res = torch.randn(3, spec.q_lora_rank, generator=g)
    for prefix, kind, layer in layers:
        assert sorted(layer.wx.names) == sorted(X_PARTS[kind]), prefix  # grouped by weight, in load order within
        assert sorted(layer.wq.names) == sorted(Q_PARTS[kind]), prefix
        for merged, inp in ((layer.wx, x), (layer.wq, q_res)):
            if not quantized:
                assert len(merged.weights) == 1, prefix
            if quantized and not HAVE_TRITON:
                continue
            out = merged(inp)
            for name in merged.names:
                want = F.linear(inp, as_dense(kept[f"{prefix}{name}.weight"], torch.float32))
                torch.testing.assert_close(out[name], want, rtol=1e-5, atol=1e-5, msg=f"{prefix}{name}")
    if quantized:
        csa = w.layers[spec.kinds.index(CSA)]
        assert [s.names for s in csa.wx.splits] == [
            ("wq_a",), ("wkv", "compressor.wkv", "indexer.compressor.wkv"),
            ("compressor.wgate", "indexer.compressor.wgate"), ("indexer.weights_proj",)]
        assert [s.names for s in csa.wq.splits] == [("wq_b", "indexer.wq_b")]
        assert isinstance(csa.wx.weights[1], Fp8Weight) and isinstance(csa.wx.weights[2], torch.Tensor)
