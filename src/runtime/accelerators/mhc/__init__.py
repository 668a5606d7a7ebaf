"""mhc_pre / mhc_post: manifold-constrained hyper-connections (see reference.py for the math)."""

from __future__ import annotations

import torch

from ..autocast import without_autocast
from ..backends import Backend, OpSpec, select_backend
from ..checks import as_int, check_eps, check_same_device, check_tensor, dtype_reasons
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from .reference import mhc_post_reference, mhc_pre_reference

MAX_KERNEL_STREAMS = 8


def _reasons(backend: str, x: torch.Tensor, streams: int | None = None) -> list[str]:
    """streams: x.shape[-2], passed as a value (leading sizes are symbolic while compiling); explain() reads it from x."""
    reasons = dtype_reasons("x", x)
    streams = x.shape[-2] if streams is None else streams
    if streams > MAX_KERNEL_STREAMS:
        reasons.append(f"x has {streams} streams; the mhc kernels take at most {MAX_KERNEL_STREAMS}")
    return reasons


SPEC = OpSpec(name="mhc", priority=("triton", "tilelang"), reasons=_reasons)


def _fake_pre(x, phi, alpha, bias, eps, sinkhorn_iters):
    n, tokens = x.shape[-2], x.numel() // (x.shape[-2] * x.shape[-1])
    lead = x.shape[:-2]
    f32 = dict(dtype=torch.float32, device=x.device)
    return (
        x.new_empty(*lead, x.shape[-1]),
        torch.empty(*lead, n, **f32),
        torch.empty(*lead, n, n, **f32),
        torch.empty(tokens, phi.shape[1], **f32),
        torch.empty(tokens, **f32),
    )


def _triton_pre_kernels() -> KernelBackend:
    from .triton import PRE_KERNELS

    return PRE_KERNELS


def _tilelang_pre_kernels() -> KernelBackend:
    from .tilelang import PRE_KERNELS

    return PRE_KERNELS


def _triton_post_kernels() -> KernelBackend:
    from .triton import POST_KERNELS

    return POST_KERNELS


def _tilelang_post_kernels() -> KernelBackend:
    from .tilelang import POST_KERNELS

    return POST_KERNELS


# kernel modules: pre_forward(x, phi, alpha, bias, eps, iters) -> (h_in, H_post, H_res, h[tokens, n*n+2n] fp32, r[tokens] fp32)
#                 pre_backward(dh_in, dH_post, dH_res, x, phi, alpha, bias, eps, iters, *results) -> (dx, dphi, dalpha, dbias, None, None)
#                 post_forward(x, y, H_post, H_res) -> (x_next,)
#                 post_backward(dx_next, x, y, H_post, H_res, x_next) -> (dx, dy, dH_post, dH_res)
PRE = KernelOp(
    "mhc_pre",
    "Tensor x, Tensor phi, Tensor alpha, Tensor bias, float eps, int sinkhorn_iters",
    n_outputs=3,
    n_saved=2,
    fake_forward=_fake_pre,
    backends={
        "triton": _triton_pre_kernels,
        "tilelang": _tilelang_pre_kernels,
    },
)
POST = KernelOp(
    "mhc_post",
    "Tensor x, Tensor y, Tensor h_post, Tensor h_res",
    n_outputs=1,
    n_saved=0,
    fake_forward=lambda x, y, h_post, h_res: torch.empty_like(x),
    backends={
        "triton": _triton_post_kernels,
        "tilelang": _tilelang_post_kernels,
    },
)


def _check_streams(x: torch.Tensor) -> tuple[int, int]:
    check_tensor("x", x, min_dim=2)
    n, width = x.shape[-2], x.shape[-1]
    if n == 0 or width == 0:
        raise ValueError(f"x: expected [..., n, C] with n >= 1 streams and C >= 1, got shape {tuple(x.shape)}")
    return n, width


def _check_shape(name: str, value, expected: tuple, x: torch.Tensor) -> None:
    check_tensor(name, value)
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(value.shape)}")
    check_same_device(name, value, "x", x)


def mhc_pre(x, phi, alpha, bias, eps: float = 1e-6, sinkhorn_iters: int = 20, *, backend: Backend | None = None):
    """(h_in [..., C], H_post [..., n] fp32, H_res [..., n, n] fp32) from the streams x [..., n, C]."""
    n, width = _check_streams(x)
    m = n * n + 2 * n
    _check_shape("phi", phi, (n * width, m), x)
    _check_shape("alpha", alpha, (3,), x)
    _check_shape("bias", bias, (m,), x)
    check_eps(eps)
    sinkhorn_iters = as_int("sinkhorn_iters", sinkhorn_iters, least=1, expected="an integer >= 1")
    chosen = select_backend(
        SPEC,
        backend,
        x.device,
        (x.dtype, n),
        mhc_pre,
        x=x,
        phi=phi,
        alpha=alpha,
        bias=bias,
        eps=eps,
        sinkhorn_iters=sinkhorn_iters,
        streams=n,
    )
    if chosen == "torch" or x.numel() == 0:
        with without_autocast(x.device.type):  # the kernels' dtypes: autocast would run v @ phi in bf16
            return mhc_pre_reference(x, phi, alpha, bias, eps, sinkhorn_iters)
    return PRE(chosen, x, phi, alpha, bias, float(eps), sinkhorn_iters)


def mhc_post(x, y, H_post, H_res, *, backend: Backend | None = None):  # noqa: N803 (DESIGN.md's names)
    """x_next [..., n, C] with x_next[i] = sum_j H_res[i, j] x[j] + H_post[i] y."""
    n, width = _check_streams(x)
    lead = tuple(x.shape[:-2])
    _check_shape("y", y, (*lead, width), x)
    _check_shape("H_post", H_post, (*lead, n), x)
    _check_shape("H_res", H_res, (*lead, n, n), x)
    chosen = select_backend(
        SPEC, backend, x.device, (x.dtype, n), mhc_post, x=x, y=y, H_post=H_post, H_res=H_res, streams=n
    )
    if chosen == "torch" or x.numel() == 0:
        with without_autocast(x.device.type):  # the kernels' dtypes: autocast would run H_res @ x in bf16
            return mhc_post_reference(x, y, H_post, H_res)
    return POST(chosen, x, y, H_post, H_res)
