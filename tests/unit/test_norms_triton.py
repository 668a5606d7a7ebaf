"""The Triton row-norm kernels under TRITON_INTERPRET=1 (set by conftest), through the public API.

Forward and every gradient against float64 textbook math at tiny odd shapes.
"""

import dataclasses
import threading

import pytest
import torch

from norm_reference import reference64
from recorded_launches import RecordedLaunches
from runtime.accelerators import l2norm, layer_norm, norms_triton, rms_norm
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.layer_norm import triton as layer_norm_triton
from runtime.accelerators.rms_norm import triton as rms_norm_triton
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm, "l2norm": l2norm}


def check_op(op, shape, dtype, weight_dtype=None, bias_dtype=None, strided=False):
    """Forward and all gradients of OPS[op] on the triton backend vs float64; strided: rows with padding and
    parameters that are every other element of a tensor."""
    width = shape[-1]
    pad = 8 if strided else 0
    step = 2 if strided else 1
    x = torch.randn(*shape[:-1], width + pad, dtype=dtype)[..., :width].requires_grad_()
    params = {}
    if weight_dtype is not None:
        params["weight"] = (1 + 0.5 * torch.randn(width * step, dtype=weight_dtype))[::step].requires_grad_()
    if bias_dtype is not None:
        params["bias"] = torch.randn(width * step, dtype=bias_dtype)[::step].requires_grad_()

    with poison_outputs():
        y = OPS[op](x, **params, backend="triton")
        dy = torch.randn(*shape[:-1], width + pad, dtype=dtype)[..., :width]
        grads = torch.autograd.grad(y, [x, *params.values()], dy)

    x64 = x.detach().double().requires_grad_()
    params64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    y64 = reference64(op, x64, **params64)
    grads64 = torch.autograd.grad(y64, [x64, *params64.values()], dy.double())

    assert y.dtype == dtype and y.shape == x.shape
    assert_close(f"{op} y", y, y64, RTOL[dtype])
    for name, tensor, grad, grad64 in zip(["x", *params], [x, *params.values()], grads, grads64):
        assert grad.dtype == tensor.dtype, f"d{name} has dtype {grad.dtype}, expected {tensor.dtype}"
        assert_close(f"{op} d{name}", grad, grad64, gradient_tolerance(tensor.dtype))


# (shape, x dtype, weight dtype, bias dtype); (150, 48) spans 3 tiles (the last partial) over 2 persistent backward programs
NORM_CASES = [
    pytest.param((3, 48), f32, None, None, id="3x48-f32-noweight"),
    pytest.param((7, 200), bf16, f32, f32, id="7x200-bf16-f32params"),
    pytest.param((150, 48), f16, f16, f16, id="150x48-f16-params"),
    pytest.param((2, 3, 200), bf16, bf16, None, id="2x3x200-bf16-weightonly"),
]


@pytest.mark.parametrize("shape, dtype, weight_dtype, bias_dtype", NORM_CASES)
def test_layer_norm_triton(shape, dtype, weight_dtype, bias_dtype):
    check_op("layer_norm", shape, dtype, weight_dtype, bias_dtype)


@pytest.mark.parametrize("shape, dtype, weight_dtype, bias_dtype", NORM_CASES)
def test_rms_norm_triton(shape, dtype, weight_dtype, bias_dtype):
    check_op("rms_norm", shape, dtype, weight_dtype)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        pytest.param((3, 48), f32, id="3x48-f32"),
        pytest.param((7, 200), bf16, id="7x200-bf16"),
        pytest.param((2, 35, 48), f16, id="2x35x48-f16"),
    ],
)
def test_l2norm_triton(shape, dtype):
    check_op("l2norm", shape, dtype)


@pytest.mark.parametrize("op", list(OPS))
def test_strided_rows(op):
    """x and dy whose rows are padded (row stride != width) are read in place, not copied wrong; strided
    parameters are read as what they hold."""
    params = {"l2norm": (None, None), "rms_norm": (f32, None), "layer_norm": (f32, f32)}[op]
    check_op(op, (7, 48), f32, *params, strided=True)


def test_layer_norm_triton_bias_only():
    check_op("layer_norm", (70, 48), bf16, None, f32)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("shape, dtype, weight_dtype, bias_dtype", NORM_CASES)
def test_forward_without_autograd_matches_the_differentiable_forward(op, shape, dtype, weight_dtype, bias_dtype):
    """With nothing to differentiate the kernel module's `infer` runs (no statistics kept): same y, bit for bit."""
    x = torch.randn(*shape, dtype=dtype)
    params = {}
    if weight_dtype is not None:
        params["weight"] = 1 + 0.5 * torch.randn(shape[-1], dtype=weight_dtype)
    if bias_dtype is not None and op == "layer_norm":
        params["bias"] = torch.randn(shape[-1], dtype=bias_dtype)
    with poison_outputs():
        with torch.no_grad():
            inferred = OPS[op](x, **params, backend="triton")
        trained = OPS[op](x.requires_grad_(), **params, backend="triton")
    assert inferred.grad_fn is None and trained.grad_fn is not None
    assert torch.equal(inferred, trained.detach())


def _norm_inputs(op, rows, width, dtype):
    x = torch.randn(rows, width, dtype=dtype, requires_grad=True)
    params = {"weight": (1 + 0.5 * torch.randn(width)).requires_grad_()}
    if op == "layer_norm":
        params["bias"] = torch.randn(width, requires_grad=True)
    return x, params, torch.randn(rows, width, dtype=dtype)


KERNELS = {"rms_norm": rms_norm_triton, "layer_norm": layer_norm_triton}
EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5}
SEVERAL_PROGRAMS = norms_triton.ParameterBackwardLaunch(max_programs=5)


def recorded(launch):
    """(launch with its sum_partials kernel recording its launches, the grids it records)."""
    recorder = RecordedLaunches()
    return dataclasses.replace(launch, sum_partials_kernel=recorder), recorder.grids


def kernel_grads(op, x, params, dy, launch):
    """The gradients of x and the parameters by the op's Triton module, its backward launched as `launch`."""
    parameters = [params["weight"].detach()] + ([params.get("bias")] if op == "layer_norm" else [])
    args = (x.detach(), *[None if p is None else p.detach() for p in parameters], EPS[op])
    with poison_outputs():
        results = KERNELS[op].forward(*args)
        grads = KERNELS[op].backward(dy, *args, *results, launch=launch)
    return grads[: 1 + len(params)]


def check_kernel_grads(op, x, params, dy, grads):
    """grads (of x and the parameters) against float64."""
    x64 = x.detach().double().requires_grad_()
    params64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    grads64 = torch.autograd.grad(reference64(op, x64, **params64), [x64, *params64.values()], dy.double())
    for name, tensor, grad, grad64 in zip(["x", *params], [x, *params.values()], grads, grads64):
        assert grad.dtype == tensor.dtype, f"d{name} has dtype {grad.dtype}, expected {tensor.dtype}"
        assert_close(f"{op} d{name}", grad, grad64, gradient_tolerance(tensor.dtype))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_one_launch_backward_with_several_programs(op):
    """The last of several persistent programs (each looping over tiles) adds every program's partials: the
    gradients match float64 and the two-launch path (sum_partials), and repeat bit for bit; the counter is back at
    zero after each backward, so a second backward gives the same bits."""
    several_programs, launches = recorded(SEVERAL_PROGRAMS)
    x, params, dy = _norm_inputs(op, 1000, 48, bf16)  # 16 tiles over 5 programs
    first = kernel_grads(op, x, params, dy, several_programs)
    check_kernel_grads(op, x, params, dy, first)
    counter, _ = norms_triton.backward_scratch(x.device, 0)
    assert counter.item() == 0
    again = kernel_grads(op, x, params, dy, several_programs)
    assert counter.item() == 0
    assert not launches, "the backward took the two-launch path"
    for a, b in zip(first, again):
        assert torch.equal(a, b)

    # every backward adds its partials in sum_partials
    two_launches = kernel_grads(op, x, params, dy, dataclasses.replace(several_programs, finish_max_steps=0))
    assert len(launches) == 1
    assert torch.equal(first[0], two_launches[0])
    for a, b in zip(first[1:], two_launches[1:]):
        assert_close(f"{op} one vs two launches", a, b.double(), 1e-6)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_two_launch_backward(op):
    """Wide rows over many programs add their partials in a second launch (sum_partials): forced here."""
    two_launches, launches = recorded(norms_triton.ParameterBackwardLaunch(finish_max_steps=0))
    for (rows, width), dtype, weight_dtype, bias_dtype in [((150, 48), f16, f16, f16), ((7, 200), bf16, f32, None)]:
        x = torch.randn(rows, width, dtype=dtype)
        params = {"weight": (1 + 0.5 * torch.randn(width, dtype=weight_dtype)).requires_grad_()}
        if op == "layer_norm" and bias_dtype is not None:
            params["bias"] = torch.randn(width, dtype=bias_dtype).requires_grad_()
        dy = torch.randn(rows, width, dtype=dtype)
        check_kernel_grads(op, x, params, dy, kernel_grads(op, x, params, dy, two_launches))
    assert len(launches) == 2


def test_backward_scratch_grows_and_is_kept_per_thread():
    device = torch.device("cpu")
    counter, small = norms_triton.backward_scratch(device, 10)
    same_counter, large = norms_triton.backward_scratch(device, 10**5)
    assert same_counter is counter and large.numel() >= 10**5
    assert norms_triton.backward_scratch(device, 10)[1] is large
    others = []
    thread = threading.Thread(target=lambda: others.append(norms_triton.backward_scratch(device, 10)))
    thread.start()
    thread.join()
    assert others[0][0] is not counter
