"""The arguments the Triton flash-attention launchers share: sizes, strides, packed sequences, flags."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .triton_configs import block_d


class Packing(NamedTuple):
    """Packed sequences (flash_attention's cu_seqlens): q [total_q, H, D], k/v [total_k, Hkv, D], sequence s at rows
    cu_q[s]:cu_q[s + 1] and cu_k[s]:cu_k[s + 1] (int32 [N + 1] on the inputs' device). max_q/max_k bound the
    sequences' lengths: the grid's extent, so one compiled kernel serves every packing."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _sizes(q, k, packing: Packing | None) -> tuple[int, int, int, int, int, int, int]:
    """(B, H, Hkv, LQ, LK, query rows, key rows): the kernels' size arguments and the rows per (batch, head) the grid
    covers. Packed: B is the number of sequences, LQ/LK the packed lengths, the rows max_q/max_k."""
    if packing is None:
        b, h, lq, _ = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        return b, h, hkv, lq, lk, lq, lk
    lq, h, _ = q.shape
    lk, hkv, _ = k.shape
    return packing.cu_q.numel() - 1, h, hkv, lq, lk, packing.max_q, packing.max_k


def grid_of(n_blocks: int, pairs: int) -> tuple[int]:
    """The kernels' grid: n_blocks blocks of rows for each of `pairs` (batch, head) pairs, all on x (gridDim.y caps at
    65535, which B x H passes at batch 16384 with 4 heads); the kernels take n_blocks (N_BLOCKS) to tell them apart."""
    return (n_blocks * pairs,)


def _strides(x: torch.Tensor, packing: Packing | None) -> tuple[int, ...]:
    """The kernels' (batch, head, row, column) strides: a packed [total, H, D] tensor has a batch stride of 0 (the
    kernels add each sequence's first row)."""
    return x.stride() if packing is None else (0, x.stride(1), x.stride(0), x.stride(2))


def _row_shape(q: torch.Tensor, packing: Packing | None) -> tuple[int, ...]:
    """lse's and delta's shape: [B, H, Lq], packed [H, total_q]."""
    return tuple(q.shape[:3]) if packing is None else (q.shape[1], q.shape[0])


def _packing_args(packing: Packing | None, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' CU_Q and CU_K (stand-ins, never read, without packing)."""
    return (q, q) if packing is None else (packing.cu_q, packing.cu_k)


def _seed_arg(seed: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The kernels' SEED: the dropout seed tensor, or any tensor where there is no dropout (never read then)."""
    return q if seed is None else seed


def _flags(q: torch.Tensor, key_lengths, causal: bool, dropout_p: float, d_hi: int = 0) -> dict:
    """The constexprs every kernel takes; d_hi: the variant's D_HI (BLOCK_D is then the first column part)."""
    d = q.shape[-1]
    return dict(
        HEAD_DIM=d,
        BLOCK_D=d - d_hi if d_hi else block_d(d),
        CAUSAL=bool(causal),
        HAS_KL=key_lengths is not None,
        DROPOUT=dropout_p > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # the latter is ignored for 16-bit inputs
    )
