"""add_rms_norm / add_layer_norm on CUDA: both kernel backends against float64, y, the new residual and the gradients
of x, residual, weight and bias with gradients flowing into both outputs (kernel outputs poisoned with NaN by
conftest); fp32 / bf16 / fp16 with fp32 parameters (mixed precision), odd shapes, strided inputs, an empty batch,
torch.compile, and repeatable parameter gradients."""

import pytest
import torch

from norm_reference import reference64
from runtime.accelerators import add_layer_norm, add_rms_norm, use_accelerators
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
BACKENDS = ("triton", "tilelang")
OPS = {"rms": add_rms_norm, "layer": add_layer_norm}
EPS = {"rms": 1e-6, "layer": 1e-5}
NORM = {"rms": "rms_norm", "layer": "layer_norm"}
# (op, shape, x dtype, weight dtype, bias dtype): every dtype, rows 1 / 37 / 1000 / 10000 (past one wave of the
# persistent backward), widths 48 / 200 / 1000 / 4095 / 8192, parameters of x's dtype, fp32, absent
CASES = {
    "rms-37x200-f32-w": ("rms", (37, 200), f32, f32, None),
    "rms-1x4095-bf16-w_f32": ("rms", (1, 4095), bf16, f32, None),
    "rms-1000x1000-f16-w_f16": ("rms", (1000, 1000), f16, f16, None),
    "rms-4x2500x200-bf16-w_f32": ("rms", (4, 2500, 200), bf16, f32, None),
    "rms-37x8192-bf16": ("rms", (37, 8192), bf16, None, None),
    "layer-37x200-f32-wb": ("layer", (37, 200), f32, f32, f32),
    "layer-1x4095-f16-wb_f32": ("layer", (1, 4095), f16, f32, f32),
    "layer-1000x1000-bf16-wb_bf16": ("layer", (1000, 1000), bf16, bf16, bf16),
    "layer-4x2500x200-bf16-w_f32-b_bf16": ("layer", (4, 2500, 200), bf16, f32, bf16),
    "layer-37x48-f16": ("layer", (37, 48), f16, None, None),
    "layer-37x8192-bf16-b_f32": ("layer", (37, 8192), bf16, None, f32),
}


def _entries(op, dtype, width, weight_dtype, bias_dtype):
    from runtime.accelerators.add_norm import tilelang as kernels

    device = torch.device("cuda", torch.cuda.current_device())
    return kernels.kernel_entries(dtype, width, weight_dtype, bias_dtype, op == "layer", device)


@pytest.fixture(scope="module", autouse=True)
def _tilelang_kernels_compiled_in_parallel():
    if not torch.cuda.is_available():
        return
    from runtime.accelerators.tilelang_common import precompile

    wanted = []
    for op, shape, dtype, weight_dtype, bias_dtype in CASES.values():
        wanted += _entries(op, dtype, shape[-1], weight_dtype, bias_dtype)
    wanted += _entries("rms", bf16, 200, f32, None) + _entries("layer", bf16, 200, f32, f32)  # strided, compiled
    precompile(wanted, torch.device("cuda", torch.cuda.current_device()))


@pytest.fixture(autouse=True)
def _no_fallback():
    """A kernel backend that cannot run must fail the test, not quietly run the torch reference."""
    with use_accelerators(fallback="error"):
        yield


def textbook(op, x, residual, weight=None, bias=None, dtype=torch.float64):
    """The op's definition in the precision of x: new_residual is x + residual held in x's dtype (`dtype`), and y is
    the norm of that rounded sum; the rounding passes gradients straight through, as a cast does."""
    exact = x + residual
    total = exact + (exact.to(dtype).double() - exact).detach()
    return reference64(NORM[op], total, weight, bias, EPS[op]), total


def make_params(width, weight_dtype, bias_dtype):
    params = {}
    if weight_dtype is not None:
        params["weight"] = (1 + 0.5 * torch.randn(width, device="cuda")).to(weight_dtype).requires_grad_()
    if bias_dtype is not None:
        params["bias"] = torch.randn(width, device="cuda").to(bias_dtype).requires_grad_()
    return params


def check(op, backend, x, residual, params):
    x, residual = x.detach().requires_grad_(), residual.detach().requires_grad_()
    y, total = OPS[op](x, residual, **params, backend=backend)
    dy, dnew = torch.randn_like(y), torch.randn_like(total)
    inputs = [x, residual, *params.values()]
    grads = torch.autograd.grad((y, total), inputs, (dy, dnew))

    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    x64, r64, *p64 = inputs64
    y64, total64 = textbook(op, x64, r64, **dict(zip(params, p64)), dtype=x.dtype)
    grads64 = torch.autograd.grad((y64, total64), inputs64, (dy.double(), dnew.double()))

    dtype = x.dtype
    tag = f"{op} {backend} {tuple(x.shape)} {dtype} " + " ".join(f"{k}={v.dtype}" for k, v in params.items())
    assert y.dtype == total.dtype == dtype and y.shape == total.shape == x.shape
    assert_close(f"{tag} y", y, y64, RTOL[dtype])
    assert_close(f"{tag} new_residual", total, total64, RTOL[dtype])
    for name, tensor, grad, grad64 in zip(["x", "residual", *params], inputs, grads, grads64):
        assert grad.dtype == tensor.dtype and grad.shape == tensor.shape
        assert_close(f"{tag} d{name}", grad, grad64, gradient_tolerance(tensor.dtype))
    return grads


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_and_every_gradient_against_float64(backend, case):
    op, shape, dtype, weight_dtype, bias_dtype = CASES[case]
    x, residual = torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype)
    check(op, backend, x, residual, make_params(shape[-1], weight_dtype, bias_dtype))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs(backend, op):
    """x with padded rows and residual transposed twice over (not contiguous): read as they hold."""
    x = torch.randn(37, 208, device="cuda", dtype=bf16)[:, :200]
    residual = torch.randn(200, 37, device="cuda", dtype=bf16).t()
    check(op, backend, x, residual, make_params(200, f32, f32 if op == "layer" else None))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend, op):
    x = torch.randn(0, 3, 200, device="cuda", dtype=bf16, requires_grad=True)
    residual = torch.randn(0, 3, 200, device="cuda", dtype=bf16, requires_grad=True)
    weight = torch.randn(200, device="cuda", requires_grad=True)
    y, total = OPS[op](x, residual, weight, backend=backend)
    assert y.shape == total.shape == x.shape and y.dtype == bf16
    grads = torch.autograd.grad((y, total), [x, residual, weight], (torch.randn_like(y), torch.randn_like(total)))
    assert grads[0].shape == x.shape and torch.equal(grads[2], torch.zeros_like(weight))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_gradients_repeat_bit_for_bit(backend, op):
    """The parameter partials are added in a fixed order: two backward passes give the same bits."""
    x = torch.randn(8192, 1000, device="cuda", dtype=bf16, requires_grad=True)
    residual = torch.randn_like(x, requires_grad=True)
    params = make_params(1000, f32, f32 if op == "layer" else None)
    dy, dnew = torch.randn_like(x), torch.randn_like(x)

    def grads():
        return torch.autograd.grad(
            OPS[op](x, residual, **params, backend=backend), [x, residual, *params.values()], (dy, dnew)
        )

    first, second = grads(), grads()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_matches_eager(backend, op):
    """Under torch.compile the kernels run as custom ops: the same bits as eager, dx and dresidual unaliased."""
    x = torch.randn(37, 1000, dtype=bf16, device="cuda", requires_grad=True)
    residual = torch.randn_like(x, requires_grad=True)
    params = list(make_params(1000, f32, f32 if op == "layer" else None).values())
    dy, dnew = torch.randn_like(x), torch.randn_like(x)
    fn = lambda x, r, *p: OPS[op](x, r, *p, backend=backend)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    out_c = compiled(x, residual, *params)
    grads_c = torch.autograd.grad(out_c, [x, residual, *params], (dy, dnew))
    out_e = fn(x, residual, *params)
    grads_e = torch.autograd.grad(out_e, [x, residual, *params], (dy, dnew))
    for a, b in zip((*out_c, *grads_c), (*out_e, *grads_e)):
        assert torch.equal(a, b)
    assert grads_c[0].data_ptr() != grads_c[1].data_ptr()
