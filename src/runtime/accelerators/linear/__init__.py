"""linear(x, weight, bias=None, activation=None): act(x @ weight^T + bias), weight [N, K] as in nn.Linear.

activation: None, "relu", "gelu", "gelu_tanh", "silu" or "swiglu". For "swiglu" the weight is [2F, K] (gate rows
first, then up rows; bias [2F]) and the result silu(gate) * up, [..., F]. Under autocast, x, weight and bias run in
the autocast dtype (as F.linear does): fp32 parameters with bf16 activations give a bf16 result and fp32 gradients.
"""

from __future__ import annotations

import torch

from ..autocast import autocast_enabled, autocast_inputs
from ..backends import Backend, OpSpec, select_backend
from ..checks import check_same_device, check_tensor
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from .reference import ACTIVATIONS, SAVES_PREACT, linear_reference

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def input_reasons(
    backend: str, x=None, weight=None, rows: int | None = None, activation: str | None = None
) -> list[str]:
    """Why a kernel backend cannot run these inputs (empty: it can). `rows`: the weight's rows (read apart from the
    weight, whose leading size torch.compile may leave symbolic)."""
    reasons = []
    if x is not None:
        if x.dtype not in KERNEL_DTYPES:
            reasons.append(
                f"x has dtype {_dtype_name(x.dtype)}; the {backend} kernels (tensor-core GEMMs) take bfloat16 and float16 "
                "(run under autocast, or cast the inputs)"
            )
        if x.shape[-1] % 8:
            reasons.append(
                f"K = {x.shape[-1]} (the last size of x) is not a multiple of 8, as the {backend} kernels need"
            )
        if backend == "triton" and x.device.type == "cpu" and x.dtype == torch.bfloat16:
            # seen with Triton 3.9: the interpreter's tl.dot multiplies bfloat16 operands' raw bits
            reasons.append(
                "bfloat16 on the CPU: the Triton interpreter computes bfloat16 dot products wrongly; use float16 there"
            )
    if rows is None and weight is not None:
        rows = weight.shape[0]
    if rows is not None:
        columns = rows // 2 if activation == "swiglu" else rows
        if columns % 8:
            what = (
                f"F = {columns} (half the weight's rows, swiglu)"
                if activation == "swiglu"
                else f"N = {rows} (the weight's rows)"
            )
            reasons.append(f"{what} is not a multiple of 8, as the {backend} kernels need")
    return reasons


def input_priority(activation=None) -> tuple[str, ...] | None:
    """torch first for a plain GEMM (no activation): F.linear is cuBLAS with the bias in its epilogue, and on the H200
    the Triton persistent kernel ran 0.89-0.93x of it from K = 256 (1.13x at K = 128), TileLang's 0.67-0.77x
    (docs/benchmark/linear.md). Measured "auto" times all three and keeps the fastest per shape class."""
    return ("torch", "triton", "tilelang") if activation is None else None


SPEC = OpSpec(
    name="linear", priority=("triton", "tilelang"), reasons=input_reasons, input_priority=input_priority, widths=("x",)
)


def _fake_forward(x, weight, bias, activation):
    rows, lead = weight.shape[0], x.shape[:-1]
    y = x.new_empty(*lead, rows // 2 if activation == "swiglu" else rows)
    return y, x.new_empty((*lead, rows) if activation in SAVES_PREACT else (0,))


def _triton_kernels() -> KernelBackend:
    from .triton import KERNELS

    return KERNELS


def _tilelang_kernels() -> KernelBackend:
    from .tilelang import KERNELS

    return KERNELS


# kernel modules: forward(x [..., K], weight, bias, activation) -> (y [..., N or F], z: the saved pre-activation, or
#                 an empty tensor where backward reads none)
#                 backward(dy, x, weight, bias, activation, y, z) -> (dx, dweight, dbias, None)
KERNEL = KernelOp(
    "linear",
    "Tensor x, Tensor weight, Tensor? bias, str? activation",
    n_outputs=1,
    n_saved=1,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_kernels,
        "tilelang": _tilelang_kernels,
    },
)


def check_linear_inputs(x, weight, bias, activation) -> None:
    check_tensor("x", x, min_dim=1)
    check_tensor("weight", weight)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight: expected shape (N, {x.shape[-1]}) ([out_features, in_features], K = the last size of x), "
            f"got {tuple(weight.shape)}"
        )
    if activation == "swiglu" and weight.shape[0] % 2:
        raise ValueError(
            f"weight: swiglu needs an even number of rows (gate rows, then up rows), got {weight.shape[0]}"
        )
    check_same_device("weight", weight, "x", x)
    autocast = autocast_enabled(x.device.type)
    if weight.dtype != x.dtype and not autocast:
        raise TypeError(
            f"weight: expected dtype {_dtype_name(x.dtype)} like x (or run under autocast), got {_dtype_name(weight.dtype)}"
        )
    if bias is not None:
        check_tensor("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},) (the weight's rows), got {tuple(bias.shape)}")
        check_same_device("bias", bias, "x", x)
        if bias.dtype != x.dtype and not autocast:
            raise TypeError(
                f"bias: expected dtype {_dtype_name(x.dtype)} like x (or run under autocast), got {_dtype_name(bias.dtype)}"
            )


def _autocast(x, weight, bias):
    """Under autocast the GEMM runs in the autocast dtype, as F.linear does."""
    return autocast_inputs(x.device.type, x, weight, bias)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    check_linear_inputs(x, weight, bias, activation)
    x, weight, bias = _autocast(x, weight, bias)
    k, rows = x.shape[-1], weight.shape[0]
    columns = rows // 2 if activation == "swiglu" else rows
    key = (x.dtype, k % 8 == 0, columns % 8 == 0, activation)
    chosen = select_backend(
        SPEC, backend, x.device, key, linear, x=x, weight=weight, bias=bias, rows=rows, activation=activation
    )
    if chosen == "torch" or x.numel() == 0 or rows == 0:
        return linear_reference(x, weight, bias, activation)
    return KERNEL(chosen, x, weight, bias, activation)
