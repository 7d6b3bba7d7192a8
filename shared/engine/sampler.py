"""Token sampling: greedy, or temperature / top-k / top-p with stateless seeded noise.

The random draw for output position p of a request depends only on (seed, p): a generator is seeded from a
hash of the pair and draws one exponential per vocabulary entry, and the token is argmax(probs / noise)
(the exponential race, equivalent to sampling from probs). So the same seed gives the same tokens whatever
the batch, and a prefill worker (position 0) and a decode worker (positions 1...) continue one stream without
handing over generator state.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from shared.engine.sequence import SamplingSpec


def draw_key(seed: int, position: int) -> int:
    """63-bit generator seed for (seed, position)."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed % 2**64, position), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample(logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int]) -> list[int]:
    """logits (N, V) float32 -> one token per row; row i samples with specs[i] at output position positions[i]."""
    assert logits.shape[0] == len(specs) == len(positions)
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done; the rest are overwritten below
    for i, (spec, pos) in enumerate(zip(specs, positions)):
        if spec.temperature > 0:
            tokens[i] = _sample_row(logits[i], spec, pos)
    return tokens


def _sample_row(logits: torch.Tensor, spec: SamplingSpec, position: int) -> int:
    logits = logits / spec.temperature  # (V,)
    if 0 < spec.top_k < logits.shape[0]:
        kth = torch.topk(logits, spec.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token when the tokens ranked above it already reach top_p (the first one always stays)
        drop = sorted_probs.cumsum(0) - sorted_probs >= spec.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    gen = torch.Generator(device=logits.device)
    gen.manual_seed(draw_key(spec.seed, position))
    noise = torch.empty_like(probs).exponential_(generator=gen)  # (V,) Exp(1)
    return int((probs / noise).argmax())
