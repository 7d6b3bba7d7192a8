"""Triton kernels for the GPU path (optional: a CPU-only install runs the torch reference ops instead).

    attention.py  paged decode attention (GQA, split over the sequence) and paged prefill attention
                  (variable length, causal, over a cached prefix plus the new tokens)
    fused.py      embedding (with overlapped scheduling's placeholders), RoPE + KV write into pages,
                  RMSNorm (+ residual add), SwiGLU
    gemv.py       small-batch linear layers with RMSNorm / residual add / SwiGLU fused in (batch <= 8 decode)

On a CPU they run under TRITON_INTERPRET=1 (tests only: fp32/fp16; bf16 is broken in the interpreter).
"""

from __future__ import annotations

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the engine uses the torch reference ops
    HAVE_TRITON = False
