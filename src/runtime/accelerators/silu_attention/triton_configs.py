"""Launch configurations of silu_attention's Triton kernels (triton_forward.py, triton_backward.py)."""

from __future__ import annotations

import torch

# (block_m, block_n, num_warps, num_stages) per kernel; fp32 runs exact fp32 products with smaller tiles. dk/dv with a
# bias also sums the bias gradients: with 4 warps its 64 x 64 tiles spilled (Triton 3.9, sm_90: 576 bytes with both
# biases), with 8 16 bytes (56 with targets and dropout, 40 before the sums), the same 8 warps an SM (255 registers:
# one block instead of two)
CONFIGS_16BIT = {"fwd": (64, 64, 4, 2), "dkdv": (64, 64, 4, 2), "dkdv_bias": (64, 64, 8, 2), "dq": (64, 64, 4, 2)}
CONFIGS_FP32 = {"fwd": (32, 32, 4, 2), "dkdv": (32, 32, 4, 2), "dkdv_bias": (32, 32, 4, 2), "dq": (32, 32, 4, 2)}


def config(kind: str, dtype: torch.dtype) -> tuple:
    return (CONFIGS_FP32 if dtype == torch.float32 else CONFIGS_16BIT)[kind]
