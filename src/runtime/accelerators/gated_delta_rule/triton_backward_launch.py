"""Launch rules of the chunked gated delta rule's Triton backward (triton_backward.py, triton_backward_wy.py): block
sizes, warps and stages from K, V and the grid, as measured on an H100 (Triton 3.6, bf16). The measurements behind
them: docs/tuning/gated_delta_rule.md ("Backward launches")."""

from __future__ import annotations

from ..launch_math import cdiv


def _local_grad_launch(K: int, V: int) -> dict:
    """Launch options of _chunk_local_grad_kernel (step 1): one warp at K = 16, else 4."""
    return dict(BV=min(V, 64), num_warps=1 if K == 16 else 4, num_stages=2)


def _walk_launch(K: int, V: int, precision: str, walks: int, sms: int) -> tuple[int, int, int]:
    """(BV, warps, stages) of _state_grad_kernel (step 2) for `walks` sequences x value heads on `sms` SMs (the
    caller's backends.sm_count, 0 off CUDA). Half inputs at K = 128: BV 32 while the grid stays within one program
    per SM, else 64 (BV 32 needs the walk's 64-row state tiles; a block wider than V is masked); fp32 inputs (IEEE
    dots on the FMA units) spill least with 8 warps and BV 32."""
    if precision == "ieee":
        return (min(V, 32), 8, 1) if K >= 64 else (min(V, 32), 4, 2)
    if K == 128:
        return (32 if V <= 32 or walks * cdiv(V, 32) <= sms else 64), 4, 3
    if K == 64:
        return min(V, 64), 4, 2
    return min(V, 32), 2 if K == 16 else 4, 2


def _grad_qk_state_launch(K: int, V: int) -> dict:
    """Launch options of _chunk_grad_qk_state_kernel (steps 3 and 4, "grad_qk_state"): its three [BT, K] fp32
    accumulators want 8 warps from K = 64; 2 warps and one stage at K = 16."""
    if K == 128:
        return dict(BV=min(V, 32), num_warps=8, num_stages=3)
    warps = 2 if K == 16 else 8 if K >= 64 else 4
    return dict(BV=min(V, 64), num_warps=warps, num_stages=1 if K == 16 else 2)


def _grad_launch(K: int, V: int) -> dict:
    """Launch options of _chunk_grad_wy_kernel (step 5, "single"): 8 warps from K = 64 (its [BT, K] fp32 tiles), V
    blocks of 32 at K = 128."""
    if K <= 32:
        return dict(BV=min(V, 64), num_warps=4, num_stages=2)
    return dict(BV=min(V, 32 if K == 128 else 64), num_warps=8, num_stages=2)


def _grad_wy_launch(K: int, V: int, precision: str) -> dict:
    """Launch options of _chunk_grad_wy_fused_kernel (step 5, "grad_wy_fused"): v in blocks of 64 (32 with IEEE
    dots), 4 warps, 2 stages; k in blocks of 16 columns (the fewest registers), of 64 with bf16 products at K = 128
    (4 steps over K, each waiting on its loads, instead of 16; BV 32 there made an illegal memory access)."""
    BV = min(V, 32 if precision == "ieee" else 64)
    BK = 64 if K == 128 and precision != "ieee" else min(K, 16)
    return dict(BK=BK, BV=BV, num_warps=4, num_stages=2)
