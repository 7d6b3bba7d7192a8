"""Linears that read one input, merged along their output rows: one GEMM, then column views of its product.

What vLLM's MergedColumnParallelLinear (and DeepSeek's fused `qkv_a_proj_with_mqa`) does, built after loading
from the checkpoint's separate tensors (whose names do not change): the parts' rows are concatenated into as few
weights as their formats allow, and a `Split` names each part's columns of that weight's product:

    W = [ A (a rows) ; B (b rows) ; C (c rows) ]  (a + b + c, K)      y = x W^T  (T, a + b + c)
    A's output = y[:, 0 : a],  B's = y[:, a : a + b],  C's = y[:, a + b :]      views: no copies

Parts meet in one weight when they are dense of one dtype, or FP8 of one block layout whose rows are whole scale
blocks (each block row of the merged scales then belongs to one part, and a part's rows stay a view of whole
blocks). Any other part, e.g. an FP8 part whose rows end inside a scale block, stays a weight of its own.

A column view of a (T, N) product is contiguous only when T == 1; at more rows its row stride is N. Consumers
whose kernels need rows of one stride copy (mhc.rms does). Where those copies would cost more than the launches
saved, `max_rows` makes inputs of more rows run one GEMM per part on row views of the merged weight instead
(contiguous outputs, the same bytes of weight held once).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import torch

from shared.engine.quant import Fp8Weight, Weight, cat_rows, linear, row_range


@dataclass(frozen=True)
class Split:
    """Part names[j] is rows [bounds[j], bounds[j + 1]) of a merged weight: columns of its product."""

    names: tuple[str, ...]
    bounds: tuple[int, ...]  # len(names) + 1 offsets, 0 first, the weight's rows last

    def ranges(self) -> Iterator[tuple[str, int, int]]:
        return zip(self.names, self.bounds[:-1], self.bounds[1:])


@dataclass(frozen=True)
class MergedLinear:
    """Named linears that read one input, held as weights[j] (its parts named by splits[j])."""

    weights: tuple[Weight, ...]
    splits: tuple[Split, ...]
    max_rows: int | None = None  # beyond this many input rows: one GEMM per part (None: merged at any rows)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for split in self.splits for name in split.names)

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (..., K) -> each part's x @ W_part^T (..., N_part): column views of one GEMM per merged weight, or
        (more rows than max_rows) one GEMM per part."""
        if self.max_rows is not None and x.shape[:-1].numel() > self.max_rows:
            return {name: linear(x, self.part(name)) for name in self.names}
        out: dict[str, torch.Tensor] = {}
        for w, split in zip(self.weights, self.splits):
            y = linear(x, w)  # (..., N)
            out |= {name: y[..., a:b] for name, a, b in split.ranges()}
        return out

    def part(self, name: str) -> Weight:
        """One part's weight: a view of its rows of the merged weight."""
        for w, split in zip(self.weights, self.splits):
            for n, a, b in split.ranges():
                if n == name:
                    return row_range(w, a, b)
        raise KeyError(name)


def merge(parts: dict[str, Weight], max_rows: int | None = None) -> MergedLinear:
    """Parts (name -> (N_i, K) weight, all reading one input of K columns) as few merged weights as their formats
    allow, in the given order within each weight. The parts' own tensors are not kept: drop them after."""
    groups: dict[Hashable, list[str]] = {}
    for name, w in parts.items():
        key = _layout(w)
        groups.setdefault(("alone", name) if key is None else key, []).append(name)
    weights, splits = [], []
    for names in groups.values():
        ws = [parts[n] for n in names]
        weights.append(ws[0] if len(ws) == 1 else cat_rows(ws))
        splits.append(Split(tuple(names), tuple(itertools.accumulate((w.shape[0] for w in ws), initial=0))))
    return MergedLinear(tuple(weights), tuple(splits), max_rows)


def _layout(w: Weight) -> Hashable | None:
    """Parts of one key concatenate along their rows; None: the part stays a weight of its own."""
    if isinstance(w, torch.Tensor):
        return ("dense", w.dtype, w.device, w.shape[1])
    if isinstance(w, Fp8Weight) and w.data.dim() == 2 and w.shape[0] % w.block[0] == 0:
        return ("fp8", w.block, w.data.device, w.shape[1])
    return None
