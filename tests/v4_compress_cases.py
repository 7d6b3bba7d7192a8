"""Random decode-step inputs for V4's compressor update and indexer (kernels/v4_compress.py, kernels/v4_index.py),
shared by the interpreter tests (tests/unit) and the GPU tests (tests/gpu): pools, a block table whose closing
windows land in distinct blocks, and the stand-ins of the model objects decode.py's compress / select read."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from shared.engine.kv_quant import Fp8Rows, RowLayout, dequantize, quantize, storage
from shared.engine.models.deepseek_v4 import decode
from shared.engine.models.deepseek_v4.decode import DecodeBatch
from shared.engine.models.deepseek_v4.rope import inv_freq
from shared.engine.models.deepseek_v4.weights import Compressor

BACKTRACK = 4
YARN = {"factor": 16.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
Row = tuple[int, int, int, int]  # slot, position p, begin, frozen


@dataclass
class CompressCase:
    c: Compressor
    att: Any  # stands in for Attention: .rope_compress.inv_freq, .spec.rms_eps
    kv: Any  # for V4Cache: .block_tokens
    rings: tuple[torch.Tensor, torch.Tensor]
    new: tuple[torch.Tensor, torch.Tensor]
    b: DecodeBatch
    store: torch.Tensor | Fp8Rows
    d: int

    def state(self) -> list[torch.Tensor]:
        """Copies of the rings and the store (FP8: its packed bytes)."""
        return [t.clone() for t in (*self.rings, storage(self.store))]

    def entries(self, state: list[torch.Tensor]) -> torch.Tensor:
        """A state's store as values (FP8: dequantized)."""
        if isinstance(self.store, Fp8Rows):
            return dequantize(state[2], self.store.layout, torch.float32)
        return state[2].float()

    def step(self, kernels: bool) -> None:
        decode.compress(self.att, self.c, self.rings, self.new, self.b, self.store, self.kv, self.d, kernels)


def batch(rows: list[Row], ratio: int, block_tokens: int, num_blocks: int, device: str,
          g: torch.Generator) -> DecodeBatch:
    """The rows as a DecodeBatch; row r's block of its current window is block r (distinct per row, so no two
    rows write one slot), its other blocks drawn from [len(rows), num_blocks)."""
    S = len(rows)
    pos = torch.tensor([r[1] for r in rows])
    max_context = int(pos.max()) + 1
    nb = -(-max_context // block_tokens)
    table = torch.randint(S, num_blocks, (S, nb), generator=g)
    table[torch.arange(S), (pos // ratio * ratio) // block_tokens] = torch.arange(S)
    col = lambda k: torch.tensor([r[k] for r in rows], device=device)  # noqa: E731
    return DecodeBatch(col(0), pos.to(device), col(2), col(3), table.to(device), max_context)


def compress_case(rows: list[Row], ratio: int, overlap: bool, d: int, rope: int, dtype: torch.dtype,
                  device: str, seed: int = 0, slots: int = 8, num_blocks: int = 24,
                  fp8: RowLayout | None = None) -> CompressCase:
    """fp8: the store as packed FP8 rows of this layout (entries: RowLayout(d, rope); index keys: (d, 0))."""
    g = torch.Generator().manual_seed(seed)
    C = (2 if overlap else 1) * d
    cap = (2 if overlap else 1) * ratio + BACKTRACK
    bt = max(16, ratio)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    # its projections (parts of Layer.wx): this step's outputs of them are drawn instead
    c = Compressor(torch.randn(ratio, C, generator=g).to(device), (1 + 0.1 * torch.randn(d, generator=g)).to(device),
                   ratio, overlap)
    att = SimpleNamespace(rope_compress=SimpleNamespace(inv_freq=inv_freq(rope, 160000.0, YARN).to(device)),
                          spec=SimpleNamespace(rms_eps=1e-6))
    rings = rand(slots + 1, cap, C), rand(slots + 1, cap, C)
    wide = rand(len(rows), 16 + 2 * C)  # as Layer.wx's product: the projections are column views, one row stride
    new = wide[:, 16 : 16 + C], wide[:, 16 + C :]
    b = batch(rows, ratio, bt, num_blocks, device, g)
    store = rand(num_blocks, bt // ratio, d)
    if fp8 is not None:
        store = Fp8Rows(quantize(store, fp8), fp8, dtype)
    return CompressCase(c, att, SimpleNamespace(block_tokens=bt), rings, new, b, store, d)


@dataclass
class IndexCase:
    att: Any  # stands in for Attention: .spec.index_head_dim, index_heads, index_topk
    layer: Any  # for Layer: .compressor.ratio
    kv: Any  # for V4Cache: .index_keys, .block_tokens
    b: DecodeBatch
    iq: torch.Tensor  # (S, H, K)
    weights: torch.Tensor  # (S, H)

    def select(self, kernels: bool) -> torch.Tensor:
        return decode.select(self.att, 0, self.layer, self.b, self.kv, self.iq, self.weights, kernels)


def index_case(positions: list[int], ratio: int, heads: int, dim: int, topk: int, dtype: torch.dtype, device: str,
               fp8: bool = False, seed: int = 0, num_blocks: int = 64, pad_context: int = 0) -> IndexCase:
    """pad_context: tokens added to the batch's max_context (a graph's context bucket past the longest row)."""
    g = torch.Generator().manual_seed(seed)
    bt = max(16, ratio)
    rows = [(r, p, 0, 0) for r, p in enumerate(positions)]
    b = batch(rows, ratio, bt, num_blocks, device, g)
    if pad_context:
        extra = torch.randint(0, num_blocks, (len(rows), -(-pad_context // bt)), generator=g).to(device)
        b = DecodeBatch(b.slots, b.positions, b.begins, b.frozen, torch.cat([b.table, extra], 1),
                        b.max_context + pad_context)
    keys = torch.randn(num_blocks, bt // ratio, dim, generator=g).to(device=device, dtype=dtype)
    store = Fp8Rows(quantize(keys, RowLayout(dim, 0)), RowLayout(dim, 0), dtype) if fp8 else keys
    spec = SimpleNamespace(index_head_dim=dim, index_heads=heads, index_topk=topk)
    return IndexCase(SimpleNamespace(spec=spec), SimpleNamespace(compressor=SimpleNamespace(ratio=ratio)),
                     SimpleNamespace(index_keys=[store], block_tokens=bt), b,
                     torch.randn(len(rows), heads, dim, generator=g).to(device=device, dtype=dtype),
                     torch.randn(len(rows), heads, generator=g).to(device=device, dtype=dtype))
