"""FlashAttention in Triton: forward (online softmax, saves the log-sum-exp), a dq kernel that also writes
delta = rowsum(o * do), then a dk/dv kernel that reads it; or, where every key fits one block (short
sequences, see use_fused), one fused backward kernel that also computes delta and stores dq.

Layout: q [B, H, Lq, D], k/v [B, Hkv, Lk, D], any strides (views are read in place); o, lse and the
gradients are written contiguous. One program handles one block of rows of one (batch, head):
queries for the forward and dq kernels, keys for the dk/dv kernel, which also loops over the
H // Hkv query heads of its kv head so GQA gradients are summed without atomics.

Masks: causal (query i sees keys j <= i, top-left as SDPA) and key_lengths (keys j >= length are
hidden) decide both which key blocks a program visits and, only on the blocks that straddle a
boundary, an element mask. A row that sees no key gets o = 0 and lse = +inf, so that every
probability the backward recomputes from it is exp(-inf) = 0.

Dropout keeps element (b, h, i, j) by the counter-based hash of dropout.py (the TileLang kernels' draw); forward
and backward regenerate the same bits, nothing of size L x L is stored. The kernels take the rate as drawn
(dropout.drop_rate, a multiple of 2^-16) and compare the bits with it exactly.

Dtypes: bf16 and fp16 run on tensor cores with fp32 accumulation; fp32 inputs run exact fp32 products
(input_precision="ieee": tf32 would miss the fp32 accuracy bound), correct but several times slower.

Sequence lengths, heads and strides are runtime arguments (lengths are not specialised), so one
compiled kernel per (head dim, dtype, causal, key_lengths, dropout) serves every shape.

The launch configurations and variants: triton_configs.py; the kernels and their launchers: triton_forward.py,
triton_dq.py, triton_dkdv.py and triton_fused.py (the pieces they share: triton_blocks.py).
"""

from __future__ import annotations

import torch

from ..buffers import empty
from ..kernel_backend import KernelBackend
from .triton_configs import (
    BACKWARDS,
    CONFIGS_16BIT,
    CONFIGS_FP32,
    FUSED_MIN_PROGRAMS,
    BwdConfig,
    FwdConfig,
    backward_kind,
    block_d,
    config,
    launch_options,
    split_head_dim,
)
from .triton_dkdv import _bwd_dkdv_kernel, backward_dkdv, lse_delta_variant
from .triton_dq import _bwd_dq_kernel, backward_dq
from .triton_forward import _fwd_kernel, backward_variant, forward, forward_variant
from .triton_fused import _bwd_fused_kernel, backward_fused, use_fused
from .triton_launch_args import Packing, _row_shape

__all__ = [
    "BACKWARDS", "CONFIGS_16BIT", "CONFIGS_FP32", "FUSED_MIN_PROGRAMS", "BwdConfig", "FwdConfig", "Packing",
    "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_bwd_fused_kernel", "_fwd_kernel", "backward", "backward_dkdv",
    "backward_dq", "backward_fused", "backward_kind", "backward_variant", "block_d", "config", "forward",
    "forward_variant", "launch_options", "lse_delta_variant", "split_head_dim", "use_fused", "varlen_backward",
    "varlen_forward",
]  # fmt: skip


def backward(
    do, q, k, v, key_lengths, causal, scale, dropout_p, seed, o, lse, *, kind=None, packing=None,
    min_programs=FUSED_MIN_PROGRAMS, fused_cfg=None, dq_cfg=None, dkdv_cfg=None,
):  # fmt: skip
    """(dq, dk, dv, None x 5): gradients in the inputs' dtypes, dk/dv summed over each kv head's query heads.

    kind: "fused" (one kernel, backward_fused) or "split" (the dq kernel, which also writes delta = rowsum(o * do),
    then the dk/dv kernel); None: use_fused decides (min_programs: its least number of (batch, kv head) pairs).
    packing: packed sequences (see forward; the split kernels). fused_cfg, dq_cfg, dkdv_cfg: a BwdConfig for that
    kernel instead of its table's entry (None: the table's)."""
    if kind not in (None, *BACKWARDS):
        raise ValueError(f"kind: expected None or one of {BACKWARDS}, got {kind!r}")
    if packing is not None and kind == "fused":
        raise ValueError("kind: the fused backward takes no packed sequences; use 'split' or None")
    args = (do, q, k, v, key_lengths, causal, scale, dropout_p, seed)
    if kind == "fused" or (kind is None and packing is None and use_fused(q, k, min_programs, fused_cfg)):
        dq, dk, dv = backward_fused(*args, o, lse, cfg=fused_cfg)
    else:
        delta = empty(_row_shape(q, packing), dtype=torch.float32, device=q.device)
        dq = backward_dq(*args, lse, delta, o=o, cfg=dq_cfg, packing=packing)
        dk, dv = backward_dkdv(*args, lse, delta, cfg=dkdv_cfg, packing=packing)
    return dq, dk, dv, None, None, None, None, None


# --------------------------------------------------------------------------- packed sequences (cu_seqlens)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p, seed):
    """(o [total_q, H, D], lse [H, total_q]) of packed sequences; cu_seqlens int32 on q's device, max_seqlen_* at
    least the longest sequence's length."""
    if q.shape[0] == 0 or k.shape[0] == 0:  # no query, or no key at all: every row sees none
        o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return o, torch.full((q.shape[1], q.shape[0]), float("inf"), device=q.device)
    packing = Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return forward(q, k, v, None, causal, scale, dropout_p, seed, packing=packing)


def varlen_backward(
    do, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p, seed, o, lse
):
    """(dq, dk, dv, None x 8) of varlen_forward."""
    rest = (None,) * 8
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), *rest
    packing = Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = backward(do, q, k, v, None, causal, scale, dropout_p, seed, o, lse, packing=packing)[:3]
    return dq, dk, dv, *rest


KERNELS = KernelBackend(forward=forward, backward=backward)
VARLEN_KERNELS = KernelBackend(forward=varlen_forward, backward=varlen_backward)
