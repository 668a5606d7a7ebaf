"""Launch configurations of silu_attention's Triton kernels (triton_forward.py, triton_backward.py)."""

from __future__ import annotations

import torch

# (block_m, block_n, num_warps, num_stages) per kernel; fp32 runs exact fp32 products with smaller tiles
CONFIGS_16BIT = {"fwd": (64, 64, 4, 2), "dkdv": (64, 64, 4, 2), "dq": (64, 64, 4, 2), "bias": (32, 32, 4, 2)}
CONFIGS_FP32 = {"fwd": (32, 32, 4, 2), "dkdv": (32, 32, 4, 2), "dq": (32, 32, 4, 2), "bias": (32, 32, 4, 2)}


def config(kind: str, dtype: torch.dtype) -> tuple:
    return (CONFIGS_FP32 if dtype == torch.float32 else CONFIGS_16BIT)[kind]
