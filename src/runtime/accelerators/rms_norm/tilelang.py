"""RMSNorm in TileLang: y = x * rstd * w, rstd = rsqrt(mean(x^2) + eps), fp32 math.

One compiled kernel per (dtype, weight dtype, width) serves every row count (rows are a
dynamic dimension). Backward is one persistent kernel: each block loops over row groups,
writes dx and keeps its share of dweight in registers, then one partial row per block;
a column-sum kernel reduces the partials (no atomics). The kernels are built by the row norms' family
(norms_tilelang).
"""

import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..norms_tilelang import backward_kernel, forward_kernel
from ..tilelang_common import (
    TL_DTYPE,
    Entry,
    RowPlan,
    column_sum,
    column_sum_entry,
    info_for,
    kernel_rows,
    launcher,
    param_or_placeholder,
    persistent_row_grid,
    placeholder,
    plan_for,
)

REGISTERS_PER_ELEMENT = 4  # backward register budget per fp32 row element a thread holds (see blocks_per_sm)


def persistent_grid(dtype: torch.dtype, width: int, sm_count: int) -> tuple[RowPlan, int, int]:
    """(plan, blocks per SM, blocks) of the persistent backward kernel."""
    return persistent_row_grid(dtype, width, sm_count, REGISTERS_PER_ELEMENT)


def kernel_entries(
    dtype: torch.dtype, width: int, w_dtype: torch.dtype | None, device: torch.device | None = None
) -> list[Entry]:
    """The kernels (forward, backward, and the dweight reduction) for these dtypes and width on
    `device` (None: the compile-only H100 default)."""
    entries = [_forward_entry(dtype, width, w_dtype), _backward_entry(dtype, width, w_dtype)]
    if w_dtype is not None:
        entries.append(column_sum_entry(w_dtype, persistent_grid(dtype, width, info_for(device).sm_count)[2]))
    return entries


def _forward_entry(dtype, width, w_dtype) -> Entry:
    def build(_):
        return forward_kernel("rms_norm_fwd", TL_DTYPE[dtype], TL_DTYPE.get(w_dtype), None, plan_for(dtype, width))

    return ("rms_norm_fwd", dtype, width, w_dtype), build


def _backward_entry(dtype, width, w_dtype) -> Entry:
    def build(info):
        plan, per_sm, n_blocks = persistent_grid(dtype, width, info.sm_count)
        return backward_kernel("rms_norm_bwd", TL_DTYPE[dtype], TL_DTYPE.get(w_dtype), None, plan, n_blocks, per_sm)

    return ("rms_norm_bwd", dtype, width, w_dtype), build


def forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float):
    rows = kernel_rows(x)
    n_rows, width = rows.shape
    y = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, rstd
    kernel = launcher(_forward_entry(x.dtype, width, None if weight is None else weight.dtype), x.device)
    kernel(rows, param_or_placeholder(weight, x), y.view(n_rows, width), rstd, eps)
    return y, rstd


def backward(dy, x, weight, eps, y, rstd):
    rows, dy_rows = kernel_rows(x), kernel_rows(dy)
    n_rows, width = rows.shape
    dx = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, None if weight is None else torch.zeros_like(weight), None
    kernel = launcher(_backward_entry(x.dtype, width, None if weight is None else weight.dtype), x.device)
    if weight is None:
        kernel(dy_rows, rows, placeholder(x.device), rstd, dx.view(n_rows, width), placeholder(x.device))
        return dx, None, None
    n_blocks = persistent_grid(x.dtype, width, info_for(x.device).sm_count)[2]
    partial = buffers.empty((n_blocks, width), dtype=torch.float32, device=x.device)
    kernel(dy_rows, rows, weight.contiguous(), rstd, dx.view(n_rows, width), partial)
    dweight = column_sum(partial, buffers.empty((width,), dtype=weight.dtype, device=weight.device))
    return dx, dweight, None


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="saved")
