"""The fused MoE kernels (shared/engine/kernels/moe.py) against the torch path of moe.py, under TRITON_INTERPRET=1
in fp32 on a CPU: the align step's layout, the grouped GEMMs with the clamped SwiGLU at many batch sizes (experts
hit by no row, activations past the limit, the shared expert fused or beside), top-k and hash-routed layers of a
real tiny checkpoint, and the whole model with the kernels on against the torch path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.models.deepseek_v4 import model as model_module
from shared.engine.models.deepseek_v4.moe import experts, moe, shared_expert
from shared.engine.models.deepseek_v4.weights import Experts
from tests import v4_checkpoints

# CPU tensors through the interpreter; on a GPU machine tests/gpu/ runs these kernels at real shapes instead
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (tests/gpu covers CUDA)")

triton = pytest.importorskip("triton")
from shared.engine.kernels.moe import SMALL_PAIRS, Config, align, align_pairs, config, fused_moe  # noqa: E402

LIMIT = 1.5
SMALL = Config(16, 16, 16, 32, 4, 1)  # tiles smaller than D and I: the loops and edge masks run


def _experts(E: int, D: int, I: int, seed: int) -> tuple[Experts, Experts]:
    g = torch.Generator().manual_seed(seed)
    routed = Experts(torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5)
    shared = Experts(torch.randn(1, 2 * I, D, generator=g) / D**0.5, torch.randn(1, D, I, generator=g) / I**0.5)
    return routed, shared


def _routing(T: int, E: int, k: int, seed: int, used: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per row, drawn from the first `used` experts only (the rest are hit by no row)."""
    g = torch.Generator().manual_seed(seed)
    pool = used or E
    chosen = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(T)])
    return chosen, torch.rand(T, k, generator=g) + 0.1


@pytest.mark.parametrize("T,E,k,block_m", [(1, 8, 2, 16), (3, 8, 3, 16), (17, 6, 2, 4), (64, 9, 4, 16)])
def test_align_layout(T: int, E: int, k: int, block_m: int) -> None:
    chosen, _ = _routing(T, E, k, seed=T, used=E - 2)  # two experts unused
    sorted_pairs, block_group, padded = align(chosen, E, block_m)
    pairs = T * k
    counts = torch.bincount(chosen.flatten(), minlength=E)
    want_padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(padded) == want_padded and want_padded % block_m == 0
    assert sorted_pairs.numel() == block_group.numel() * block_m >= want_padded
    live = sorted_pairs[:want_padded]
    assert sorted(live[live < pairs].tolist()) == list(range(pairs))  # every pair once
    assert bool((sorted_pairs[want_padded:] == pairs).all())
    flat = chosen.flatten()
    for b in range(want_padded // block_m):
        slots = sorted_pairs[b * block_m : (b + 1) * block_m]
        real = slots[slots < pairs]
        assert real.numel() > 0  # no block of padding only
        assert bool((flat[real.long()] == block_group[b]).all())  # one expert per block


@pytest.mark.parametrize("T,k", [(1, 6), (3, 2), (17, 3), (36, 6)])
@pytest.mark.parametrize("with_shared", [True, False], ids=["shared", "routed-only"])
def test_one_program_align_equals_torch_align(T: int, k: int, with_shared: bool) -> None:
    """Decode's one-program align gives the very layout of the torch ops (the same stable order)."""
    E = 12
    chosen, _ = _routing(T, E, k, seed=T, used=9)
    assert T * (k + with_shared) <= SMALL_PAIRS
    every = torch.cat([chosen, torch.full((T, 1), E)], 1) if with_shared else chosen
    want = align(every, E + with_shared, 16)
    got = align_pairs(chosen, E, with_shared, 16)
    n = int(want[2])
    assert int(got[2]) == n
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1][: n // 16], want[1][: n // 16])


def _reference(x, chosen, weights, routed, shared):
    out = experts(routed, x, chosen, weights, LIMIT)
    return out if shared is None else out + shared_expert(shared, x, LIMIT)


@pytest.mark.parametrize("T", [1, 3, 17, 64, 70])  # 70 x (3 + 1) pairs: past SMALL_PAIRS, the torch align
@pytest.mark.parametrize("with_shared", [True, False], ids=["shared", "routed-only"])
def test_fused_matches_torch(T: int, with_shared: bool) -> None:
    E, D, I, k = 8, 48, 40, 3
    routed, shared = _experts(E, D, I, seed=1)
    x = 4 * torch.randn(T, D, generator=torch.Generator().manual_seed(T))  # far past the SwiGLU limit
    chosen, weights = _routing(T, E, k, seed=T, used=6)
    pre = torch.einsum("td,tkfd->tkf", x, routed.w13[chosen])
    assert bool((pre[..., :I] > LIMIT).any()) and bool((pre[..., I:].abs() > LIMIT).any())  # the clamps bite
    sh = (shared.w13[0], shared.w2[0]) if with_shared else None
    want = _reference(x, chosen, weights, routed, shared if with_shared else None)
    for cfg in (None, SMALL, config(10**6, 1)) if T in (3, 17) else (None,):  # + the long-prefill tiles
        got = fused_moe(x, chosen, weights, routed.w13, routed.w2, LIMIT, sh, cfg)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_config_by_rows_per_expert() -> None:
    assert config(7, 257).block_m == 16  # decode at batch 1
    assert config(16384 * 7, 257).block_m == 128  # a 16K prefill chunk


def test_repeated_expert_in_a_row_and_no_rows() -> None:
    """A hash table may name an expert twice for a token: two pairs, two contributions. T = 0 returns (0, D)."""
    routed, shared = _experts(4, 32, 16, seed=2)
    x = torch.randn(5, 32)
    chosen = torch.tensor([[1, 1], [0, 3], [3, 3], [1, 0], [2, 2]])
    weights = torch.rand(5, 2)
    got = fused_moe(x, chosen, weights, routed.w13, routed.w2, LIMIT, None)
    torch.testing.assert_close(got, _reference(x, chosen, weights, routed, None), atol=1e-5, rtol=1e-5)
    empty = fused_moe(x[:0], chosen[:0], weights[:0], routed.w13, routed.w2, LIMIT, None)
    assert empty.shape == (0, 32)


# --- a real tiny checkpoint: its hash-routed and top-k layers, then the whole model ------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v4-moe")
    v4_checkpoints.build(path, "mixed")
    return path


@pytest.mark.parametrize("T", [1, 17])
def test_moe_layers_of_a_checkpoint(checkpoint: Path, T: int) -> None:
    model = Engine(str(checkpoint), kv_blocks=8).model
    s = model.spec
    ids = torch.randint(0, s.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
    x = torch.randn(T, s.hidden_size, generator=torch.Generator().manual_seed(T + 1))
    kinds = set()
    for layer in model.layers:
        kinds.add("hash" if layer.tid2eid is not None else "top-k")
        want = moe(s, layer, x, ids)
        torch.testing.assert_close(moe(s, layer, x, ids, triton=True), want, atol=1e-5, rtol=1e-5)
    assert kinds == {"hash", "top-k"}
    # two shared experts stacked into one wider SwiGLU do not ride in the grouped launch: added beside it
    layer = model.layers[1]
    assert layer.shared is not None
    _, I2, D = layer.shared.w13.shape
    g = torch.Generator().manual_seed(3)
    wide = Experts(torch.randn(1, 2 * I2, D, generator=g) / D**0.5, torch.randn(1, D, I2, generator=g) / I2**0.5)
    wider = dataclasses.replace(layer, shared=wide)
    torch.testing.assert_close(moe(s, wider, x, ids, triton=True), moe(s, wider, x, ids), atol=1e-5, rtol=1e-5)


def test_model_with_fused_moe_matches_torch_path(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model end to end with the fused MoE forced on in every layer (nothing else changed: the
    interpreter's mHC kernels would cost minutes here; tests/unit/test_v4_parity.py's "triton" case runs them
    all together against transformers): a batched prefill of two sequences, then batched decode steps."""
    g = torch.Generator().manual_seed(9)
    seqs = {rid: torch.randint(0, 512, (24,), generator=g).tolist() for rid in ("a", "b")}
    steps = [(0, 20), (20, 21), (21, 22)]
    want = v4_checkpoints.batched_logits(Engine(str(checkpoint), kv_blocks=16), seqs, steps)
    calls = []

    def fused(s, layer, x, input_ids, triton=False, counts=None, real=None):
        calls.append(x.shape[0])
        return moe(s, layer, x, input_ids, True, counts, real)

    monkeypatch.setattr(model_module, "moe", fused)
    got = v4_checkpoints.batched_logits(Engine(str(checkpoint), kv_blocks=16), seqs, steps)
    assert calls == [40] * 4 + [2] * 8  # every layer of every step took the kernel path
    for g_, ref in zip(got, want):
        torch.testing.assert_close(g_, ref, atol=1e-4, rtol=0)
        assert bool((g_.argmax(-1) == ref.argmax(-1)).all())
