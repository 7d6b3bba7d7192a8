"""Token sampling: greedy, or temperature -> min_p -> top-k -> top-p with stateless seeded noise (vLLM's order;
the repetition penalty and min_tokens act on the logits before this, processors.py).

The random draw for output position p of a request depends only on (seed, p): a generator is seeded from a
hash of the pair and draws one exponential per vocabulary entry, and the token is argmax(probs / noise)
(the exponential race, equivalent to sampling from probs). So the same seed gives the same tokens whatever
the batch, and a prefill worker (position 0) and a decode worker (positions 1...) continue one stream without
handing over generator state.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

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
    if spec.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < spec.min_p * probs.max(), float("-inf"))
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


RowOp = Callable[[torch.Tensor], torch.Tensor]  # (N, V) -> (N, V) float32 along the last dim


def torch_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def torch_log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1)


# --- batched, on the device -----------------------------------------------------------------------------------
#
# The same rule (greedy, or temperature -> min_p -> top-k -> top-p -> exponential race keyed by (seed, position)) for
# all rows at once, with no host round trip per row. torch.Generator cannot be keyed per row inside one
# kernel, so the Exp(1) noise comes from a counter-based hash of (draw_key(seed, position), vocab index):
# stateless, batch-independent and the same on any device, but not the CPU path's exact draws.

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int64 tensors holding 32-bit values (products wrap mod 2^64; masks keep 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def hashed_exponential(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys (N,) int64 (63-bit) -> (N, vocab) float32 Exp(1) noise, a pure function of (key, column)."""
    lo, hi = (keys & _M32)[:, None], ((keys >> 32) & _M32)[:, None]
    col = torch.arange(vocab, device=keys.device, dtype=torch.int64)[None, :]
    h = _fmix32(((col * 0x9E3779B1) & _M32) ^ lo)
    h = _fmix32(h ^ hi)
    # (0, 1), 24 bits, in float64: in float32 the top value (2^24 - 0.5) / 2^24 rounds to 1, whose noise -log(1) is
    # -0.0, and a masked token's 0 / -0.0 is NaN, which argmax picks (a grammar-masked token sampled on a GPU)
    u = ((h >> 8).double() + 0.5) * (1.0 / (1 << 24))
    return (-torch.log(u)).float()


def sample_on_device(logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int],
                     softmax: RowOp = torch_softmax) -> torch.Tensor:
    """logits (N, V) float32 -> (N,) int64 tokens on logits' device. softmax: the row softmax (the
    deterministic mode's is kernels/invariant.py's, one program per row in a fixed order)."""
    assert logits.shape[0] == len(specs) == len(positions)
    tokens = logits.argmax(dim=-1)
    hot = [i for i, s in enumerate(specs) if s.temperature > 0]
    if not hot:
        return tokens
    dev = logits.device
    hs = [specs[i] for i in hot]
    temp = torch.tensor([s.temperature for s in hs], dtype=torch.float32).to(dev, non_blocking=True)
    keys = torch.tensor([draw_key(s.seed, positions[i]) for s, i in zip(hs, hot)]).to(dev, non_blocking=True)
    index = torch.tensor(hot).to(dev, non_blocking=True)
    x = logits.index_select(0, index) / temp[:, None]  # (n, V)
    V = x.shape[1]
    if any(s.min_p > 0 for s in hs):
        min_p = torch.tensor([s.min_p for s in hs], dtype=torch.float32).to(dev, non_blocking=True)
        probs = softmax(x)  # rows with min_p 0 keep everything (probs >= 0)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if any(0 < s.top_k < V or s.top_p < 1.0 for s in hs):
        top_k = torch.tensor([s.top_k if 0 < s.top_k < V else V for s in hs]).to(dev, non_blocking=True)
        top_p = torch.tensor([s.top_p for s in hs], dtype=torch.float32).to(dev, non_blocking=True)
        ordered, order = x.sort(dim=-1, descending=True)
        kth = ordered.gather(1, (top_k - 1)[:, None])  # (n, 1): ties with the k-th logit stay, as on the CPU
        x = x.masked_fill(x < kth, float("-inf"))
        probs = softmax(x)
        sorted_probs = probs.gather(1, order)  # descending still: masking kept the order
        drop = sorted_probs.cumsum(1) - sorted_probs >= top_p[:, None]
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    else:
        probs = softmax(x)
    drawn = (probs / hashed_exponential(keys, V)).argmax(dim=-1)
    return tokens.index_copy(0, index, drawn)


# --- log probabilities ----------------------------------------------------------------------------------------


def token_logprobs(raw: torch.Tensor, rows: list[int], tokens: torch.Tensor, k: int,
                   log_softmax: RowOp = torch_log_softmax) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw (N, V) logits as the model made them, tokens (N,) the sampled ones -> for `rows`: the sampled token's
    logprob (n,), and the k most likely ids (n, k) with their logprobs (n, k), on raw's device.

    The model's own distribution (vLLM's default logprobs mode, "raw_logprobs"): before logit_bias, penalties,
    temperature and the top-k / top-p / min-p filters, so a logprob does not depend on how it was sampled."""
    index = torch.tensor(rows, dtype=torch.long).to(raw.device, non_blocking=True)
    lsm = log_softmax(raw.index_select(0, index))  # (n, V) float32
    chosen = lsm.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
    top, ids = lsm.topk(k, dim=-1) if k > 0 else (lsm[:, :0], lsm[:, :0].long())
    return chosen, ids, top
