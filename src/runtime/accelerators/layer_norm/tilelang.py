"""LayerNorm in TileLang: y = (x - mean) * rstd * w + b over the last dimension, fp32 math.

One compiled kernel per (dtype, weight dtype, bias dtype, width) serves every row count.
The variance is taken from the centred row held in registers (two reductions, no
cancellation). Backward is one persistent kernel writing dx and one row of partial sums
of dweight and dbias per block; a column-sum kernel reduces them (no atomics). The kernels
are built by the row norms' family (norms_tilelang, flag centre).
"""

import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..norms_tilelang import backward_kernel, forward_kernel
from ..tilelang_common import (
    TL_DTYPE,
    Entry,
    RowPlan,
    column_sum_entry,
    info_for,
    kernel_rows,
    launcher,
    param_or_placeholder,
    persistent_row_grid,
    placeholder,
    plan_for,
    reduce_dtype,
    reduce_partials,
)

REGISTERS_PER_ELEMENT = 8  # backward register budget per fp32 row element a thread holds (see blocks_per_sm)


def persistent_grid(dtype: torch.dtype, width: int, sm_count: int) -> tuple[RowPlan, int, int]:
    """(plan, blocks per SM, blocks) of the persistent backward kernel."""
    return persistent_row_grid(dtype, width, sm_count, REGISTERS_PER_ELEMENT)


def kernel_entries(
    dtype: torch.dtype,
    width: int,
    w_dtype: torch.dtype | None,
    b_dtype: torch.dtype | None,
    device: torch.device | None = None,
) -> list[Entry]:
    """The kernels (forward, backward, and the parameter-gradient reduction) for these dtypes and
    width on `device` (None: the compile-only H100 default)."""
    entries = [_forward_entry(dtype, width, w_dtype, b_dtype), _backward_entry(dtype, width, w_dtype, b_dtype)]
    params = [d for d in (w_dtype, b_dtype) if d is not None]
    if params:
        n_blocks = persistent_grid(dtype, width, info_for(device).sm_count)[2]
        entries.append(column_sum_entry(reduce_dtype(params), n_blocks))
    return entries


def _forward_entry(dtype, width, w_dtype, b_dtype) -> Entry:
    def build(_):
        plan = plan_for(dtype, width)
        return forward_kernel(
            "layer_norm_fwd", TL_DTYPE[dtype], TL_DTYPE.get(w_dtype), TL_DTYPE.get(b_dtype), plan, centre=True
        )

    return ("layer_norm_fwd", dtype, width, w_dtype, b_dtype), build


def _backward_entry(dtype, width, w_dtype, b_dtype) -> Entry:
    def build(info):
        plan, per_sm, n_blocks = persistent_grid(dtype, width, info.sm_count)
        return backward_kernel(
            "layer_norm_bwd",
            TL_DTYPE[dtype],
            TL_DTYPE.get(w_dtype),
            TL_DTYPE.get(b_dtype),
            plan,
            n_blocks,
            per_sm,
            centre=True,
        )

    return ("layer_norm_bwd", dtype, width, w_dtype, b_dtype), build


def forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float):
    rows = kernel_rows(x)
    n_rows, width = rows.shape
    y = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    rstd = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, mean, rstd
    kernel = launcher(_forward_entry(x.dtype, width, _dtype(weight), _dtype(bias)), x.device)
    kernel(rows, param_or_placeholder(weight, x), param_or_placeholder(bias, x), y.view(n_rows, width), mean, rstd, eps)
    return y, mean, rstd


def backward(dy, x, weight, bias, eps, y, mean, rstd):
    rows, dy_rows = kernel_rows(x), kernel_rows(dy)
    n_rows, width = rows.shape
    dx = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, _zeros_like(weight), _zeros_like(bias), None
    kernel = launcher(_backward_entry(x.dtype, width, _dtype(weight), _dtype(bias)), x.device)
    params = [p for p in (weight, bias) if p is not None]
    if not params:
        kernel(dy_rows, rows, placeholder(x.device), mean, rstd, dx.view(n_rows, width), placeholder(x.device))
        return dx, None, None, None
    n_blocks = persistent_grid(x.dtype, width, info_for(x.device).sm_count)[2]
    partial = buffers.empty((n_blocks, len(params), width), dtype=torch.float32, device=x.device)
    kernel(dy_rows, rows, param_or_placeholder(weight, x), mean, rstd, dx.view(n_rows, width), partial)
    grads = reduce_partials(partial.view(n_blocks, -1), params)
    dweight = grads.pop(0) if weight is not None else None
    dbias = grads.pop(0) if bias is not None else None
    return dx, dweight, dbias, None


def _dtype(t: torch.Tensor | None):
    return None if t is None else t.dtype


def _zeros_like(t: torch.Tensor | None):
    return None if t is None else torch.zeros_like(t)


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="saved")
