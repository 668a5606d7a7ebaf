"""Numerics helpers shared by the tests and the benchmark."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# relative RMS error bounds per dtype (gradients get twice these; an op may set tighter ones)
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
RTOL_ATTENTION_FP32 = 1e-4


def relative_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has any NaN or inf)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("nan")
    norm = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff / norm if norm > 0 else diff


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.numel() == 0:
        return 0.0
    return (out.detach().double().cpu() - ref.detach().double().cpu()).abs().max().item()


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    """Relative RMS error within rtol; NaN never passes. Prints the ratio and the max-abs error."""
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    error = relative_rms_error(out, ref)
    message = f"{name}: relative RMS error {error:.3e} (bound {rtol:.1e}), max abs {max_abs_error(out, ref):.3e}"
    print(message)
    if not error <= rtol:  # also false for NaN
        raise AssertionError(message)


def poison_(tensor: torch.Tensor) -> torch.Tensor:  # for buffers a test allocates itself
    """Fill with NaN (floating) or an out-of-range value, so an unwritten element fails the check."""
    if tensor.is_floating_point():
        return tensor.fill_(float("nan"))
    return tensor.fill_(torch.iinfo(tensor.dtype).min)


def gradient_tolerance(dtype: torch.dtype, rtol: float | None = None) -> float:
    return 2 * (rtol if rtol is not None else RTOL[dtype])


def compiled_kernels(fn) -> int | None:
    """How many compiled kernels a Triton kernel holds over all devices (a direct_launch wrapper: its JITFunction's);
    None where this Triton keeps no JITFunction.device_caches to count."""
    caches = getattr(getattr(fn, "kernel", fn), "device_caches", None)
    return None if caches is None else sum(len(c[0]) for c in caches.values())


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """torch.use_deterministic_algorithms(True) within the block, the previous mode restored after."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def differentiable(forward, backward, n_outputs: int):
    """A kernel backend's forward(*args) and backward(*grad_outputs, *args, *results) (kernel_op's convention) as one
    function of args that autograd differentiates, returning the first n_outputs results: how tests run a launcher's
    variants (keyword arguments bound with functools.partial) forward and backward without the op's dispatch."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            results = tuple(forward(*args))
            ctx.args, ctx.results = args, results
            ctx.mark_non_differentiable(*results[n_outputs:])
            return results

        @staticmethod
        def backward(ctx, *grad_outputs):
            return tuple(backward(*grad_outputs[:n_outputs], *ctx.args, *ctx.results))

    return lambda *args: Function.apply(*args)[:n_outputs]
