"""add_rms_norm / add_layer_norm in TileLang: total = x + residual (rounded to the inputs' dtype), y = norm(total),
fp32 math. The math and the outputs are the Triton module's (see add_norm/triton.py).

One compiled kernel per (dtype, weight dtype, bias dtype, width, centred or not) serves every row count (rows are a
dynamic dimension), built by the row norms' TileLang family (norms_tilelang, flag residual). Backward is one
persistent kernel: each block loops over row groups, writes dtotal (both dx and dresidual) and keeps its share of
dweight / dbias in registers, then one partial row each per block; a column-sum kernel adds them (no atomics).
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

# backward register budget per fp32 row element a thread holds (tilelang_common.blocks_per_sm), from ptxas on sm_90a
# at 16 elements a thread (tools/tilelang_resources.py): 94-101 registers for rms, 118-121 for layer
REGISTERS_PER_ELEMENT = {False: 6, True: 8}


def persistent_grid(dtype: torch.dtype, width: int, sm_count: int, centre: bool) -> tuple[RowPlan, int, int]:
    """(plan, blocks per SM, blocks) of the persistent backward kernel."""
    return persistent_row_grid(dtype, width, sm_count, REGISTERS_PER_ELEMENT[centre])


def kernel_entries(
    dtype: torch.dtype,
    width: int,
    w_dtype: torch.dtype | None,
    b_dtype: torch.dtype | None,
    centre: bool,
    device: torch.device | None = None,
) -> list[Entry]:
    """The kernels (forward, backward, and the parameter-gradient reduction) for these dtypes, width and norm (centre:
    layer norm) on `device` (None: the compile-only H100 default)."""
    entries = [
        _forward_entry(dtype, width, w_dtype, b_dtype, centre),
        _backward_entry(dtype, width, w_dtype, b_dtype, centre),
    ]
    params = [d for d in (w_dtype, b_dtype) if d is not None]
    if params:
        n_blocks = persistent_grid(dtype, width, info_for(device).sm_count, centre)[2]
        entries.append(column_sum_entry(reduce_dtype(params), n_blocks))
    return entries


def _forward_entry(dtype, width, w_dtype, b_dtype, centre) -> Entry:
    def build(_):
        plan = plan_for(dtype, width)
        return forward_kernel(
            "add_norm_fwd",
            TL_DTYPE[dtype],
            TL_DTYPE.get(w_dtype),
            TL_DTYPE.get(b_dtype),
            plan,
            centre=centre,
            residual=True,
        )

    return ("add_norm_fwd", dtype, width, w_dtype, b_dtype, centre), build


def _backward_entry(dtype, width, w_dtype, b_dtype, centre) -> Entry:
    def build(info):
        plan, per_sm, n_blocks = persistent_grid(dtype, width, info.sm_count, centre)
        w_tl, b_tl = TL_DTYPE.get(w_dtype), TL_DTYPE.get(b_dtype)
        return backward_kernel(
            "add_norm_bwd", TL_DTYPE[dtype], w_tl, b_tl, plan, n_blocks, per_sm, centre=centre, residual=True
        )

    return ("add_norm_bwd", dtype, width, w_dtype, b_dtype, centre), build


def _dtype(t: torch.Tensor | None):
    return None if t is None else t.dtype


def _forward(x, residual, weight, bias, eps: float, centre: bool):
    rows, r_rows = kernel_rows(x), kernel_rows(residual)
    n_rows, width = rows.shape
    y = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    total = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    mean = buffers.empty((n_rows,), dtype=torch.float32, device=x.device) if centre else None
    if n_rows:
        kernel = launcher(_forward_entry(x.dtype, width, _dtype(weight), _dtype(bias), centre), x.device)
        kernel(
            rows, r_rows, param_or_placeholder(weight, x), param_or_placeholder(bias, x), y.view(n_rows, width),
            total.view(n_rows, width), placeholder(x.device) if mean is None else mean, rstd, eps,
        )  # fmt: skip
    return (y, total, rstd, mean) if centre else (y, total, rstd)


def _backward(dy, dnew, weight, bias, total, rstd, mean):
    """(dtotal, dweight, dbias); dtotal is both dx and dresidual."""
    dy_rows, dn_rows = kernel_rows(dy), kernel_rows(dnew)
    n_rows, width = dy_rows.shape
    dtotal = buffers.empty(total.shape, dtype=total.dtype, device=total.device)
    params = [p for p in (weight, bias) if p is not None]
    if n_rows == 0:
        return dtotal, *(None if p is None else torch.zeros_like(p) for p in (weight, bias))
    device, centre = total.device, mean is not None
    kernel = launcher(_backward_entry(total.dtype, width, _dtype(weight), _dtype(bias), centre), device)
    n_blocks = persistent_grid(total.dtype, width, info_for(device).sm_count, centre)[2]
    partial = buffers.empty((n_blocks, len(params), width), dtype=torch.float32, device=device) if params else None
    kernel(
        dy_rows, dn_rows, total.view(n_rows, width), param_or_placeholder(weight, total),
        placeholder(device) if mean is None else mean, rstd, dtotal.view(n_rows, width),
        placeholder(device) if partial is None else partial,
    )  # fmt: skip
    if not params:
        return dtotal, None, None
    grads = reduce_partials(partial.view(n_blocks, -1), params)
    return dtotal, grads.pop(0) if weight is not None else None, grads.pop(0) if bias is not None else None


def rms_forward(x, residual, weight, eps: float):
    return _forward(x, residual, weight, None, eps, centre=False)


def rms_backward(dy, dnew, x, residual, weight, eps, y, total, rstd):
    """x, residual and y are not read (x and residual are None in eager calls)."""
    dtotal, dweight, _ = _backward(dy, dnew, weight, None, total, rstd, None)
    return dtotal, dtotal, dweight, None


def layer_forward(x, residual, weight, bias, eps: float):
    return _forward(x, residual, weight, bias, eps, centre=True)


def layer_backward(dy, dnew, x, residual, weight, bias, eps, y, total, rstd, mean):
    """x, residual and y are not read (x and residual are None in eager calls)."""
    dtotal, dweight, dbias = _backward(dy, dnew, weight, bias, total, rstd, mean)
    return dtotal, dtotal, dweight, dbias, None


RMS_KERNELS = KernelBackend(forward=rms_forward, backward=rms_backward)
LAYER_KERNELS = KernelBackend(forward=layer_forward, backward=layer_backward)
