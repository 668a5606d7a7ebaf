"""swiglu on the CPU: the reference against float64 textbook math, the Triton kernels under
TRITON_INTERPRET=1 (forward and backward), the TileLang kernels compiled for sm_90a, dispatch and errors."""

import re
import warnings

import pytest
import torch

from conftest import SM90A, requires_nvcc
from runtime.accelerators.backends import BackendFallbackWarning, BackendUnavailableError
from runtime.accelerators.config import use_accelerators
from runtime.accelerators.swiglu import swiglu
from runtime.accelerators.swiglu.reference import swiglu_reference
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def textbook(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = gate.double(), up.double()
    return g / (1 + torch.exp(-g)) * u


def textbook_grads(gate, up, dy):
    g, u, dy = gate.double(), up.double(), dy.double()
    s = 1 / (1 + torch.exp(-g))
    return dy * u * (s + g * s * (1 - s)), dy * g * s


def check(backend, gate, up, rtol=None):
    """Output and both gradients against float64 textbook math."""
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    y = swiglu(gate, up, backend=backend)
    dy = torch.randn_like(y)
    dgate, dup = torch.autograd.grad(y, (gate, up), dy)
    rtol = rtol if rtol is not None else RTOL[gate.dtype]
    ref_dgate, ref_dup = textbook_grads(gate.detach(), up.detach(), dy)
    tag = f"{backend} {tuple(gate.shape)} {gate.dtype}"
    assert y.dtype == gate.dtype and y.shape == gate.shape
    assert_close(f"{tag} y", y, textbook(gate.detach(), up.detach()), rtol)
    assert_close(f"{tag} dgate", dgate, ref_dgate, gradient_tolerance(gate.dtype, rtol))
    assert_close(f"{tag} dup", dup, ref_dup, gradient_tolerance(gate.dtype, rtol))


@pytest.mark.parametrize("dtype", [f32, bf16, f16], ids=["f32", "bf16", "f16"])
def test_reference_matches_textbook_math(dtype):
    check("torch", 3 * torch.randn(4, 37, dtype=dtype), torch.randn(4, 37, dtype=dtype))


def test_reference_keeps_float64():
    g, u = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    assert swiglu_reference(g, u).dtype == torch.float64
    torch.testing.assert_close(swiglu_reference(g, u), textbook(g, u), rtol=1e-14, atol=1e-14)


def test_reference_is_stable_for_large_gates():
    g = torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4])
    y = swiglu(g, torch.ones_like(g), backend="torch")
    torch.testing.assert_close(y, torch.tensor([0.0, 0.0, 0.0, 100.0, 1e4]))


@pytest.mark.parametrize("shape", [(1,), (37,), (3, 50)], ids=["1", "37", "3x50"])
def test_triton_interpreter_forward_backward(shape):
    check("triton", 3 * torch.randn(shape), torch.randn(shape))


def test_triton_interpreter_bf16():
    check("triton", 3 * torch.randn(2, 37, dtype=bf16), torch.randn(2, 37, dtype=bf16))


def test_triton_interpreter_strided_inputs():
    gate = 3 * torch.randn(50, 3).t()  # not contiguous
    check("triton", gate, torch.randn(3, 50))


def test_triton_interpreter_large_gates_are_finite():
    g = torch.tensor([-1e4, -100.0, -1.0, 0.0, 1.0, 100.0, 1e4], requires_grad=True)
    u = torch.ones(7, requires_grad=True)
    y = swiglu(g, u, backend="triton")
    dg, du = torch.autograd.grad(y, (g, u), torch.ones_like(y))
    for t in (y, dg, du):
        assert torch.isfinite(t).all(), t
    torch.testing.assert_close(y, swiglu_reference(g.detach(), u.detach()))


def test_empty_input():
    g = torch.randn(0, 8, requires_grad=True)
    y = swiglu(g, torch.randn(0, 8), backend="triton")
    assert y.shape == (0, 8)
    y.sum().backward()
    assert g.grad.shape == (0, 8)


# --------------------------------------------------------------------------- TileLang, compile-only


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_tilelang_kernels_compile_for_sm90a(direction):
    import tilelang

    from runtime.accelerators.swiglu import tilelang as kernels
    from runtime.accelerators.tilelang_common import device_info

    key, build = getattr(kernels, f"{direction}_entry")(bf16)
    kernel = tilelang.compile(build(device_info(None)), target=SM90A)
    source = kernel.get_kernel_source()
    n = kernel.params[0].shape[0]
    assert not isinstance(n, int) and not hasattr(n, "value"), f"the element count must be dynamic, got {n}"
    # every global load and store is a 16-byte vector in the full-block path
    tensors = "G|U|Y" if direction == "forward" else "DY|G|U|DG|DU"
    assert len(re.findall(rf"\*\(uint4\*\)\(({tensors}) \+", source)) == (3 if direction == "forward" else 5)


# --------------------------------------------------------------------------- dispatch and errors


def test_tilelang_on_cpu_falls_back_with_a_warning():
    g, u = torch.randn(10), torch.randn(10)
    with pytest.warns(BackendFallbackWarning, match="swiglu: the tilelang backend cannot run.*CUDA"):
        y = swiglu(g, u, backend="tilelang")
    torch.testing.assert_close(y, swiglu_reference(g, u))


def test_unsupported_dtype_falls_back_or_raises():
    g, u = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    with pytest.warns(BackendFallbackWarning, match="gate has dtype float64"):
        swiglu(g, u, backend="triton")
    with use_accelerators(fallback="error"), pytest.raises(BackendUnavailableError, match="swiglu.*triton.*float64"):
        swiglu(g, u, backend="triton")


def test_auto_picks_triton_under_the_interpreter():
    g, u = torch.randn(10), torch.randn(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = swiglu(g, u, backend="auto")
    torch.testing.assert_close(y, swiglu_reference(g, u))


@pytest.mark.parametrize(
    "gate, up, error, match",
    [
        ([1.0], torch.randn(1), TypeError, "gate: expected a torch.Tensor, got list"),
        (torch.randn(3), torch.ones(3, dtype=torch.int64), TypeError, "up: expected a floating-point tensor"),
        (torch.randn(3), torch.randn(4), ValueError, r"up: expected the shape of gate \(3,\), got \(4,\)"),
        (torch.randn(2, 3), torch.randn(3), ValueError, r"up: expected the shape of gate \(2, 3\)"),
        (torch.randn(3), torch.randn(3, dtype=bf16), TypeError, "up: expected the dtype of gate"),
        (torch.randn(3), torch.randn(3, device="meta"), ValueError, "up: expected a tensor on cpu like gate"),
    ],
    ids=["gate-list", "up-int", "shape", "no-broadcast", "dtype", "device"],
)
def test_errors_name_the_argument(gate, up, error, match):
    with pytest.raises(error, match=match):
        swiglu(gate, up)
