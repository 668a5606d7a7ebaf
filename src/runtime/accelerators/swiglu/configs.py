"""The SwiGLU Triton kernels' launch choices, measured on an H100 (docs/tuning/swiglu.md); the activation kernels
(activation/triton.py) share the block and warps."""

from __future__ import annotations

import triton.language as tl

BLOCK = 1024  # elements per program: 1024 x 4 warps was level with torch.compile; larger blocks 0.5-3% slower
WARPS = 4
# evict-last on the forward's loads leaves more of y in L2 for its consumer (2% faster with a matmul after it)
FORWARD_LOAD_POLICY: tl.constexpr = tl.constexpr("evict_last")
