"""Weights kept as DeepSeek ships them: block-scaled FP8 (e4m3) linears and packed FP4 (e2m1) routed experts.

    Fp8Weight   data (..., N, K) float8_e4m3fn, scale (..., ceil(N / bn), ceil(K / bk)) float32: one factor per
                bn x bk block (the hub's 128 x 128 `weight_scale_inv` / `.scale`), the last blocks possibly partial
    Fp4Weight   data (..., N, K / 2) uint8, two e2m1 codes a byte (low nibble = even column), scale
                (..., N, K / bk) uint8 e8m0 exponents (factor 2 ** (byte - 127), the hub's float8_e8m0fnu): 1 x bk
                blocks (bk = 32 in V4's release)

`dequantize` is the one place for the math (the loader's CPU path, and the reference the kernels are tested
against); `linear` is x @ W^T for a weight of any of the three kinds (a plain tensor, Fp8Weight through the Triton
GEMM of kernels/fp8_gemm.py). Scales stay as compact as the hub's: the FP4 exponents a byte each (float32 would be
a quarter more bytes than the codes they scale), FP8's float32 per 16K weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.engine.kernels import HAVE_TRITON

_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)
_E2M1_PAIRS = torch.stack((_E2M1.repeat(16), _E2M1.repeat_interleave(16)), dim=-1)  # byte -> (low, high) values
FP4_DTYPES = {torch.int8, torch.uint8} | ({torch.float4_e2m1fn_x2} if hasattr(torch, "float4_e2m1fn_x2") else set())
QUANTIZED_DTYPES = FP4_DTYPES | {torch.float8_e4m3fn}


@dataclass(frozen=True)
class Fp8Weight:
    data: torch.Tensor  # (..., N, K) float8_e4m3fn
    scale: torch.Tensor  # (..., ceil(N / block[0]), ceil(K / block[1])) float32
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scale.to(device), self.block)

    def __getitem__(self, i: int) -> Fp8Weight:
        """One matrix of a stack (..., N, K)."""
        return Fp8Weight(self.data[i], self.scale[i], self.block)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return _scale_blocks(self.data.float(), self.scale.float()).to(dtype)


@dataclass(frozen=True)
class Fp4Weight:
    data: torch.Tensor  # (..., N, K / 2) uint8: column 2j in the low nibble of byte j, 2j + 1 in the high one
    scale: torch.Tensor  # (..., N, K / block) uint8 e8m0 exponents
    block: int  # columns per scale

    @property
    def shape(self) -> torch.Size:
        """The logical (..., N, K)."""
        return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1]))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def to(self, device: torch.device) -> Fp4Weight:
        return Fp4Weight(self.data.to(device), self.scale.to(device), self.block)

    def __getitem__(self, i: int) -> Fp4Weight:
        return Fp4Weight(self.data[i], self.scale[i], self.block)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        factors = (self.scale.float() - 127).exp2()
        return _scale_blocks(unpack_e2m1(self.data), factors).to(dtype)


Quantized = Fp8Weight | Fp4Weight
Weight = torch.Tensor | Fp8Weight | Fp4Weight  # what a linear of the model may hold


def quantized(weight: torch.Tensor, scale: torch.Tensor) -> Quantized:
    """A checkpoint's (weight, block scale) pair as kept on the device. The block edges come from the grid (see
    `dequantize`). ValueError for a pair the kernels cannot read (the loader then dequantizes it)."""
    if scale.dim() < 2 or scale.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"scale grid {tuple(scale.shape)} does not fit weight {tuple(weight.shape)}")
    rows, cols = weight.shape[-2:]
    if weight.dtype == torch.float8_e4m3fn:
        block = (_block_edge(rows, scale.shape[-2]), _block_edge(cols, scale.shape[-1]))
        return Fp8Weight(weight, _factors(scale), block)
    if weight.dtype not in FP4_DTYPES:
        raise ValueError(f"cannot keep {weight.dtype} quantized (have float8_e4m3fn and packed e2m1)")
    if scale.shape[-2] != rows:
        raise ValueError(f"FP4 scales must be per row (1 x block): grid {tuple(scale.shape)} for {rows} rows")
    block = _block_edge(2 * cols, scale.shape[-1])
    if (2 * cols) % block or block % 2:
        raise ValueError(f"FP4 rows of {2 * cols} columns do not split into scale blocks of {block}")
    return Fp4Weight(weight.view(torch.uint8), _exponents(scale), block)


def _factors(scale: torch.Tensor) -> torch.Tensor:
    """float32 factors from float32 / bfloat16, float8_e8m0fnu, or uint8 e8m0 exponents."""
    return (scale.float() - 127).exp2() if scale.dtype == torch.uint8 else scale.float()


def _exponents(scale: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 exponents from float8_e8m0fnu, uint8, or float factors that are powers of two."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    exp = scale.float().log2()
    if not torch.equal(exp, exp.round()) or exp.abs().max() > 127:
        raise ValueError("FP4 scales must be powers of two (e8m0) to stay quantized")
    return (exp + 127).to(torch.uint8)


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block-scaled FP8 (e4m3) or packed FP4 (e2m1, two per byte) -> bfloat16.

    `scale` holds one factor per block of the trailing two dims: (..., R, C) for a (..., rows, cols) weight, as
    float32 / bfloat16, float8_e8m0fnu, or uint8 holding e8m0 exponents (2 ** (byte - 127)). The block edges
    come from the grid, so 128x128 FP8 blocks and FP4's 1x32 need no configuration.
    """
    if weight.dtype == torch.float8_e4m3fn:
        values = weight.float()
    elif weight.dtype in FP4_DTYPES:
        values = unpack_e2m1(weight)
    else:
        raise ValueError(f"cannot dequantize {weight.dtype} (have float8_e4m3fn and packed e2m1)")
    if scale.dim() < 2 or scale.shape[:-2] != values.shape[:-2]:
        raise ValueError(f"scale grid {tuple(scale.shape)} does not fit weight {tuple(values.shape)}")
    return _scale_blocks(values, _factors(scale)).to(torch.bfloat16)


def as_dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A weight of any kind as a plain tensor of `dtype`."""
    return w.to(dtype) if isinstance(w, torch.Tensor) else w.dequantize(dtype)


def cat_rows(parts: list[Weight]) -> Weight:
    """[p0; p1; ...] along the rows (dim -2), of one kind and, quantized, one block layout. FP8: every part but the
    last must be whole scale blocks of rows, so each block row of the result scales one part's rows; FP4's scales
    are per row."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=-2)  # type: ignore[arg-type]
    assert all(type(p) is type(first) and p.block == first.block for p in parts), "cat_rows: mixed layouts"
    if isinstance(first, Fp8Weight):
        assert all(p.shape[-2] % first.block[0] == 0 for p in parts[:-1]), "cat_rows: FP8 rows off a block edge"
    return type(first)(torch.cat([p.data for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=-2),
                       first.block)  # type: ignore[arg-type]


def row_range(w: Weight, start: int, stop: int) -> Weight:
    """Rows [start, stop) of a (N, K) weight, as views (no copy). FP8: start on a block edge, stop on one or N."""
    if isinstance(w, torch.Tensor):
        return w[start:stop]
    if isinstance(w, Fp4Weight):
        return Fp4Weight(w.data[start:stop], w.scale[start:stop], w.block)
    bn = w.block[0]
    assert start % bn == 0 and (stop % bn == 0 or stop == w.shape[0]), "row_range: FP8 rows off a block edge"
    return Fp8Weight(w.data[start:stop], w.scale[start // bn : -(-stop // bn)], w.block)


def linear(x: torch.Tensor, w: Weight, groups: int = 1) -> torch.Tensor:
    """x (..., groups K) @ W^T -> (..., N) in x's dtype, for a plain or an FP8 weight (FP4 is the fused MoE's
    alone). groups > 1: W (N, K) is `groups` stacked blocks of N / groups rows, block g applied to x's g-th K
    columns (V4's wo_a): (..., G, K) x (G, N / G, K) -> (..., G N / G)."""
    if isinstance(w, torch.Tensor):
        if groups == 1:
            return F.linear(x, w)
        per_group = x.unflatten(-1, (groups, -1)).unsqueeze(-2)  # (..., G, 1, K)
        return (per_group @ w.view(groups, -1, w.shape[-1]).mT).squeeze(-2).flatten(-2)  # (..., G N / G)
    assert isinstance(w, Fp8Weight) and HAVE_TRITON, f"no linear for {type(w).__name__}"
    from shared.engine.kernels.fp8_gemm import fp8_linear

    return fp8_linear(x, w, groups)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., cols / 2) bytes -> (..., cols) float32; the low nibble is the even column."""
    pairs = _E2M1_PAIRS.to(packed.device)
    return pairs[packed.view(torch.uint8).long()].flatten(-2)  # (..., cols / 2, 2) -> (..., cols)


def _scale_blocks(values: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """values (..., rows, cols) * factors (..., R, C) broadcast over blocks, the last blocks possibly partial.
    Scales `values` in place: callers pass a scratch float32 copy, so a large tensor is not held twice."""
    (rows, cols), (grid_rows, grid_cols) = values.shape[-2:], factors.shape[-2:]
    block_rows, block_cols = _block_edge(rows, grid_rows), _block_edge(cols, grid_cols)
    pad_rows, pad_cols = grid_rows * block_rows - rows, grid_cols * block_cols - cols
    if pad_rows or pad_cols:
        values = F.pad(values, (0, pad_cols, 0, pad_rows))
    blocks = values.unflatten(-1, (grid_cols, block_cols)).unflatten(-3, (grid_rows, block_rows))  # (.., R, br, C, bc)
    blocks.mul_(factors[..., :, None, :, None])
    return blocks.flatten(-2).flatten(-3, -2)[..., :rows, :cols]


def _block_edge(size: int, blocks: int) -> int:
    """The edge b with ceil(size / b) == blocks. Several fit when `blocks` does not divide `size` (129 rows in 2
    blocks: 65..128); checkpoints use powers of two, so the power of two that fits wins, if one does."""
    edge = 1
    while edge * blocks < size:
        edge *= 2
    if -(-size // edge) == blocks:
        return edge
    if size % blocks == 0:
        return size // blocks
    raise ValueError(f"cannot split {size} into {blocks} scale blocks")


# ---- making them (tests and benches: random weights quantized in memory, as the hub's release would be) -----


def quantize_fp8(w: torch.Tensor, block: int = 128) -> Fp8Weight:
    """w (..., N, K) float -> FP8 with power-of-two float32 scales per block x block (ue8m0, as V4 ships)."""
    rows, cols = w.shape[-2:]
    grid = (-(-rows // block), -(-cols // block))
    padded = F.pad(w.float().abs(), (0, grid[1] * block - cols, 0, grid[0] * block - rows))
    amax = padded.unflatten(-1, (grid[1], block)).unflatten(-3, (grid[0], block)).amax(dim=(-3, -1))
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / 448.0)))
    inv = _scale_blocks(torch.ones(w.shape, dtype=torch.float32, device=w.device), 1 / scale)
    return Fp8Weight((w.float() * inv).to(torch.float8_e4m3fn), scale, (block, block))


def quantize_fp4(w: torch.Tensor, block: int = 32) -> Fp4Weight:
    """w (..., N, K) float -> packed e2m1 (nearest code) with e8m0 exponents per 1 x block."""
    amax = w.float().abs().unflatten(-1, (-1, block)).amax(-1)  # (..., N, K / block)
    exp = torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / 6.0)).clamp(-127, 127)
    x = (w.float().unflatten(-1, (-1, block)) * torch.exp2(-exp)[..., None]).flatten(-2)
    codes = _nearest_e2m1(x)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return Fp4Weight(packed, (exp + 127).to(torch.uint8), block)


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float -> the e2m1 code (0..15) of the nearest value, by the midpoints of the magnitudes (no (.., 16) temp)."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=x.device)
    code = torch.bucketize(x.abs(), mids)  # 0..7
    return torch.where(x < 0, code + 8, code).to(torch.uint8)
