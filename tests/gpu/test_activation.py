"""gelu (exact and tanh) and silu on CUDA: both kernel backends against float64, output and gradient (kernel outputs
poisoned with NaN by conftest), every dtype, sizes around the kernels' blocks, strided and misaligned inputs, large
inputs, an empty input and torch.compile."""

import math

import pytest
import torch

from runtime.accelerators import gelu, silu, use_accelerators
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
BACKENDS = ("triton", "tilelang")
KINDS = ("gelu", "gelu_tanh", "silu")
# sizes that are not multiples of the kernels' blocks: 1 element, a partial block only, full blocks plus a partial one
SHAPES = {"1": (1,), "37x200": (37, 200), "4097x3": (4097, 3), "3x8193": (3, 8193)}
CASES = [(bf16, s) for s in SHAPES] + [(f32, "37x200"), (f32, "4097x3"), (f16, "37x200"), (f16, "3x8193")]


@pytest.fixture(scope="module", autouse=True)
def _tilelang_kernels_compiled_in_parallel():
    if not torch.cuda.is_available():
        return
    from runtime.accelerators.activation import tilelang as kernels
    from runtime.accelerators.tilelang_common import precompile

    entries = [e for d in (f32, bf16, f16) for act in kernels.ACTIVATIONS for e in kernels.kernel_entries(d, act)]
    precompile(entries, torch.device("cuda", torch.cuda.current_device()))


@pytest.fixture(autouse=True)
def _no_fallback():
    with use_accelerators(fallback="error"):
        yield


def run(kind, x, backend):
    if kind == "silu":
        return silu(x, backend=backend)
    return gelu(x, "tanh" if kind == "gelu_tanh" else "none", backend=backend)


def textbook(kind, x):
    """(y, dy/dx) in float64."""
    x = x.double()
    if kind == "silu":
        s = torch.sigmoid(x)
        return x * s, s * (1 + x * (1 - s))
    if kind == "gelu":
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        return x * cdf, cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    # (1 + tanh(u)) / 2 = sigmoid(2u) and (1 - tanh(u)^2) / 4 = sigmoid(2u) sigmoid(-2u): 1 + tanh(u) would round to
    # zero in float64 too where tanh(u) is near -1
    k = math.sqrt(2 / math.pi)
    u = k * (x + 0.044715 * x**3)
    s, s_neg = torch.sigmoid(2 * u), torch.sigmoid(-2 * u)
    return x * s, s + 2 * x * s * s_neg * k * (1 + 3 * 0.044715 * x * x)


def check(kind, backend, x):
    x = x.detach().requires_grad_()
    y = run(kind, x, backend)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    y64, derivative = textbook(kind, x.detach())
    tag = f"{kind} {backend} {tuple(x.shape)} {x.dtype}"
    assert y.dtype == dx.dtype == x.dtype and y.shape == dx.shape == x.shape
    assert_close(f"{tag} y", y, y64, RTOL[x.dtype])
    assert_close(f"{tag} dx", dx, dy.double() * derivative, gradient_tolerance(x.dtype))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, shape", CASES, ids=[f"{str(d)[6:]}-{s}" for d, s in CASES])
def test_forward_backward_against_float64(dtype, shape, backend, kind):
    check(kind, backend, 3 * torch.randn(SHAPES[shape], device="cuda", dtype=dtype))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_misaligned_inputs(backend, kind):
    check(kind, backend, (3 * torch.randn(4097, 3, device="cuda", dtype=bf16)).t())
    check(kind, backend, 3 * torch.randn(3 * 4097 + 1, device="cuda", dtype=bf16)[1:].view(3, 4097))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_inputs_stay_finite(backend, kind):
    x = torch.tensor([-1e4, -100.0, -10.0, -1.0, 0.0, 1.0, 10.0, 100.0, 1e4], device="cuda", requires_grad=True)
    y = run(kind, x, backend)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    y64, derivative = textbook(kind, x.detach())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), derivative, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gelu_tanh_keeps_its_relative_accuracy_in_the_tail(backend):
    """Where tanh(u) is near -1 (x from -9 to -3) y and dy/dx are tiny: the kernels keep fp32's relative accuracy."""
    x = torch.linspace(-9, -3, 61, device="cuda", requires_grad=True)
    y = gelu(x, "tanh", backend=backend)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    y64, derivative = textbook("gelu_tanh", x.detach())
    assert ((y.double() - y64).abs() / y64.abs()).max() < 1e-5
    assert ((dx.double() - derivative).abs() / derivative.abs()).max() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_input(backend):
    x = torch.randn(0, 8, device="cuda", dtype=bf16, requires_grad=True)
    for kind in KINDS:
        y = run(kind, x, backend)
        assert y.shape == x.shape
        assert torch.autograd.grad(y, x, torch.randn_like(y))[0].shape == x.shape


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_matches_eager(backend, kind):
    x = (3 * torch.randn(37, 1000, dtype=bf16, device="cuda")).requires_grad_()
    dy = torch.randn_like(x)
    compiled = torch.compile(lambda x: run(kind, x, backend), fullgraph=True)
    y_c = compiled(x)
    (dx_c,) = torch.autograd.grad(y_c, x, dy)
    y_e = run(kind, x, backend)
    (dx_e,) = torch.autograd.grad(y_e, x, dy)
    assert torch.equal(y_c, y_e) and torch.equal(dx_c, dx_e)
