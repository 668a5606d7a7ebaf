"""gelu and silu on the CPU: the reference against float64 textbook math, the Triton kernels under TRITON_INTERPRET=1
(set by conftest) forward and backward, the TileLang kernels compiled for sm_90a, torch.compile, the nn modules,
dispatch and errors."""

import math

import pytest
import torch

import runtime.accelerators as acc
from conftest import SM90A, requires_nvcc
from runtime.accelerators import gelu, silu
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance
from runtime.nn import GELU, SiLU

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
KINDS = ("gelu", "gelu_tanh", "silu")


def run(kind, x, backend):
    if kind == "silu":
        return silu(x, backend=backend)
    return gelu(x, "tanh" if kind == "gelu_tanh" else "none", backend=backend)


def textbook(kind, x):
    """(y, dy/dx) in float64 from the formulas."""
    x = x.double()
    if kind == "silu":
        s = 1 / (1 + torch.exp(-x))
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


def check(kind, backend, x, rtol=None):
    x = x.detach().requires_grad_()
    with poison_outputs():
        y = run(kind, x, backend)
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
    y64, derivative = textbook(kind, x.detach())
    rtol = RTOL[x.dtype] if rtol is None else rtol
    tag = f"{kind} {backend} {tuple(x.shape)} {x.dtype}"
    assert y.dtype == dx.dtype == x.dtype and y.shape == dx.shape == x.shape
    assert_close(f"{tag} y", y, y64, rtol)
    assert_close(f"{tag} dx", dx, dy.double() * derivative, gradient_tolerance(x.dtype, rtol))


@pytest.mark.parametrize("dtype", [f32, bf16, f16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("kind", KINDS)
def test_reference_matches_textbook_math(kind, dtype):
    check(kind, "torch", (3 * torch.randn(37, 200)).to(dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_reference_is_torch(kind):
    x = torch.randn(50, dtype=torch.float64)
    expected = {"gelu": torch.nn.functional.gelu(x), "gelu_tanh": torch.nn.functional.gelu(x, approximate="tanh"),
                "silu": torch.nn.functional.silu(x)}[kind]  # fmt: skip
    assert torch.equal(run(kind, x, "torch"), expected)


SHAPES = {"1": (1,), "37": (37,), "37x200": (37, 200), "2x1000": (2, 1000)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
def test_triton_forward_backward(kind, shape):
    check(kind, "triton", 3 * torch.randn(SHAPES[shape]))


@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "f16"])
@pytest.mark.parametrize("kind", KINDS)
def test_triton_half_precision(kind, dtype):
    check(kind, "triton", (3 * torch.randn(37, 8)).to(dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_triton_strided_input(kind):
    check(kind, "triton", 3 * torch.randn(200, 37).t())


@pytest.mark.parametrize("kind", KINDS)
def test_triton_large_inputs_are_finite(kind):
    x = torch.tensor([-1e4, -100.0, -10.0, -1.0, 0.0, 1.0, 10.0, 100.0, 1e4], requires_grad=True)
    y = run(kind, x, "triton")
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    y_ref = run(kind, x.detach(), "torch")
    x64 = x.detach().double().requires_grad_()
    (dx_ref,) = torch.autograd.grad(run(kind, x64, "torch"), x64, torch.ones_like(x64))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref.float(), rtol=1e-5, atol=1e-6)


def test_triton_gelu_tanh_keeps_its_relative_accuracy_in_the_tail():
    """Where tanh(u) is near -1 (x from -9 to -3) y and dy/dx are tiny: computed through sigmoid(2u), not 1 + tanh(u),
    they keep fp32's relative accuracy."""
    x = torch.linspace(-9, -3, 61, requires_grad=True)
    y = gelu(x, "tanh", backend="triton")
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    y64, derivative = textbook("gelu_tanh", x.detach())
    assert ((y.double() - y64).abs() / y64.abs()).max() < 1e-5
    assert ((dx.double() - derivative).abs() / derivative.abs()).max() < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_backward_recomputes_from_x(kind):
    """The output is not kept for backward: changing it in place after the forward changes nothing."""
    x = (3 * torch.randn(37, 8)).requires_grad_()
    y = run(kind, x, "triton")
    dy = torch.randn_like(y)
    with torch.no_grad():
        y.fill_(123.0)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_close(f"{kind} dx", dx, dy.double() * textbook(kind, x.detach())[1], gradient_tolerance(f32))


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_full_graph_matches_eager(kind):
    x = (3 * torch.randn(37, 24)).requires_grad_()
    compiled = torch.compile(lambda x: run(kind, x, "triton"), backend="aot_eager", fullgraph=True)
    dy = torch.randn(37, 24)
    y_c = compiled(x)
    (dx_c,) = torch.autograd.grad(y_c, x, dy)
    y_e = run(kind, x, "triton")
    (dx_e,) = torch.autograd.grad(y_e, x, dy)
    torch.testing.assert_close(y_c, y_e)
    torch.testing.assert_close(dx_c, dx_e)


def test_empty_input():
    x = torch.randn(0, 8, requires_grad=True)
    for kind in KINDS:
        y = run(kind, x, "triton")
        assert y.shape == x.shape
        assert torch.autograd.grad(y, x, torch.randn_like(y))[0].shape == x.shape


def test_errors():
    with pytest.raises(ValueError, match="approximate: expected 'none' or 'tanh', got 'erf'"):
        gelu(torch.randn(3), "erf")
    with pytest.raises(ValueError, match="approximate: expected 'none' or 'tanh', got None"):
        gelu(torch.randn(3), None)
    with pytest.raises(ValueError, match="approximate: expected 'none' or 'tanh', got 'Tanh'"):
        GELU("Tanh")
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        silu(torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got list"):
        gelu([1.0, 2.0])


def test_dispatch_fallback_and_explain():
    x = torch.randn(4, dtype=torch.float64)
    with pytest.warns(
        acc.BackendFallbackWarning, match="activation: the triton backend cannot run these inputs: x has dtype float64"
    ):
        assert silu(x, backend="triton").dtype == torch.float64
    with acc.use_accelerators(fallback="error"):
        with pytest.raises(acc.BackendUnavailableError, match="activation: the tilelang backend .*CUDA"):
            gelu(torch.randn(4), backend="tilelang")
    assert "activation" in acc.OP_NAMES
    assert "activation: configured 'auto'" in acc.explain("activation", x=torch.randn(3))


def test_modules_follow_the_config():
    x = 3 * torch.randn(5, 8)
    with acc.use_accelerators(ops={"activation": "triton"}, fallback="error"):
        torch.testing.assert_close(GELU("tanh")(x), torch.nn.GELU("tanh")(x))
        torch.testing.assert_close(GELU()(x), torch.nn.GELU()(x))
        torch.testing.assert_close(SiLU()(x), torch.nn.SiLU()(x))
    assert GELU(backend="torch").state_dict() == {} and repr(GELU("tanh")) == "GELU(approximate='tanh', backend=None)"


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("dtype, act", [(bf16, 0), (f32, 1), (f16, 2)], ids=["silu-bf16", "gelu-f32", "gelu_tanh-f16"])
def test_tilelang_kernels_compile_for_sm90a(dtype, act):
    kernels = pytest.importorskip(
        "runtime.accelerators.activation.tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
    )
    import tilelang

    from runtime.accelerators.tilelang_common import device_info

    info = device_info(None)
    for key, build in kernels.kernel_entries(dtype, act):
        kernel = tilelang.compile(build(info), target=SM90A)
        source = kernel.get_kernel_source()
        assert "__global__" in source
        size = kernel.params[0].shape[0]
        assert not isinstance(size, int) and not hasattr(size, "value"), f"{key}: the length must be dynamic"
        if dtype.itemsize == 2:
            assert "uint4" in source, f"{key}: expected 16-byte accesses"
