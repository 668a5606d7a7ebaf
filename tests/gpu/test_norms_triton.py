"""The Triton row-norm kernels on CUDA: outputs and every gradient vs float64 (outputs poisoned by conftest)."""

import dataclasses

import pytest
import torch

from norm_reference import reference64
from recorded_launches import RecordedLaunches
from runtime.accelerators import l2norm, layer_norm, norms_triton, rms_norm
from runtime.accelerators.layer_norm import triton as layer_norm_triton
from runtime.accelerators.rms_norm import triton as rms_norm_triton
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = {"f32": f32, "bf16": bf16, "f16": f16}
WIDTHS = (48, 200, 1000, 4095, 8192)
ROWS = (1, 37, 1000)
OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm, "l2norm": l2norm}
# parameter variants as (weight, bias); "x" takes x's dtype, "f32" is mixed precision when x is not fp32
VARIANTS = {
    "rms_norm": [(None, None), ("x", None), ("f32", None)],
    "layer_norm": [(None, None), ("x", "x"), ("f32", "f32"), ("x", None), (None, "f32")],
    "l2norm": [(None, None)],
}


def check_op(op, shape, dtype, weight_dtype=None, bias_dtype=None):
    x = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
    width = shape[-1]
    params = {}
    if weight_dtype is not None:
        params["weight"] = (1 + 0.5 * torch.randn(width, device="cuda")).to(weight_dtype).requires_grad_()
    if bias_dtype is not None:
        params["bias"] = torch.randn(width, dtype=bias_dtype, device="cuda", requires_grad=True)
    y = OPS[op](x, **params, backend="triton")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *params.values()], dy)

    x64 = x.detach().double().requires_grad_()
    params64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    y64 = reference64(op, x64, **params64)
    grads64 = torch.autograd.grad(y64, [x64, *params64.values()], dy.double())

    tag = f"{op} {tuple(shape)} {dtype} w={weight_dtype} b={bias_dtype}"
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(f"{tag} y", y, y64, RTOL[dtype])
    for name, tensor, grad, grad64 in zip(["x", *params], [x, *params.values()], grads, grads64):
        assert grad.dtype == tensor.dtype
        assert_close(f"{tag} d{name}", grad, grad64, gradient_tolerance(tensor.dtype))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(OPS))
def test_norm_triton(op, dtype, width):
    """Parameter variants rotate over the widths, so every variant meets every dtype (one kernel pair per case)."""
    variants = VARIANTS[op]
    weight, bias = variants[(WIDTHS.index(width) + list(DTYPES).index(dtype)) % len(variants)]
    resolve = {None: None, "x": DTYPES[dtype], "f32": f32}
    for rows in ROWS:
        check_op(op, (rows, width), DTYPES[dtype], resolve[weight], resolve[bias])


@pytest.mark.parametrize("op", list(OPS))
def test_norm_triton_3d(op):
    """Leading dims are flattened; 10000 rows make every persistent backward program loop over tiles."""
    weight, bias = {"rms_norm": (f32, None), "layer_norm": (f32, bf16), "l2norm": (None, None)}[op]
    check_op(op, (4, 2500, 200), bf16, weight, bias)


@pytest.mark.parametrize("op", list(OPS))
def test_norm_triton_empty_batch(op):
    x = torch.randn(0, 3, 200, dtype=bf16, device="cuda", requires_grad=True)
    params = {} if op == "l2norm" else {"weight": torch.randn(200, device="cuda", requires_grad=True)}
    y = OPS[op](x, **params, backend="triton")
    assert y.shape == x.shape and y.dtype == bf16
    grads = torch.autograd.grad(y, [x, *params.values()], torch.randn_like(y))
    assert grads[0].shape == x.shape
    if params:
        assert torch.equal(grads[1], torch.zeros_like(params["weight"]))


def test_layer_norm_triton_compiled():
    """Under torch.compile the kernels run as custom ops; results and gradients match eager."""
    x = torch.randn(37, 1000, dtype=bf16, device="cuda", requires_grad=True)
    weight = torch.randn(1000, device="cuda", requires_grad=True)
    bias = torch.randn(1000, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    compiled = torch.compile(lambda x, w, b: layer_norm(x, w, b, backend="triton"), fullgraph=True)
    y = compiled(x, weight, bias)
    grads = torch.autograd.grad(y, [x, weight, bias], dy)
    y_eager = layer_norm(x, weight, bias, backend="triton")
    grads_eager = torch.autograd.grad(y_eager, [x, weight, bias], dy)
    assert torch.equal(y, y_eager)
    for grad, grad_eager in zip(grads, grads_eager):
        assert torch.equal(grad, grad_eager)


def _sum_partials_launches(op, rows, width) -> list:
    """The grids of sum_partials' launches in one backward of the op's Triton module at rows x width, with the
    default launch choices (those of the public op's eager backward, Python's or the native node's)."""
    recorder = RecordedLaunches()
    launch = dataclasses.replace(norms_triton.PARAMETER_BACKWARD, sum_partials_kernel=recorder)
    x = torch.randn(rows, width, dtype=bf16, device="cuda")
    parameters = [torch.randn(width, dtype=bf16, device="cuda")] * (2 if op == "layer_norm" else 1)
    module, eps = {"rms_norm": (rms_norm_triton, 1e-6), "layer_norm": (layer_norm_triton, 1e-5)}[op]
    args = (x, *parameters, eps)
    module.backward(torch.randn_like(x), *args, *module.forward(*args), launch=launch)
    return recorder.grids


def _norm_step(op, rows=8192, width=128):
    """step() runs the op forward and backward on the triton backend and returns every gradient; step.check(grads)
    compares them with float64."""
    x = torch.randn(rows, width, dtype=bf16, device="cuda", requires_grad=True)
    params = {"weight": (1 + 0.5 * torch.randn(width, device="cuda")).to(bf16).requires_grad_()}
    if op == "layer_norm":
        params["bias"] = torch.randn(width, dtype=bf16, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        y = OPS[op](x, **params, backend="triton")
        return torch.autograd.grad(y, [x, *params.values()], dy)

    def check(grads):
        x64 = x.detach().double().requires_grad_()
        params64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
        grads64 = torch.autograd.grad(reference64(op, x64, **params64), [x64, *params64.values()], dy.double())
        for name, grad, grad64 in zip(["x", *params], grads, grads64):
            assert_close(f"{op} d{name}", grad, grad64, gradient_tolerance(bf16))

    step.check = check
    return step


def _assert_equal(tag, got, expected):
    for name, a, b in zip(("dx", "dweight", "dbias"), got, expected):
        assert torch.equal(a, b), f"{tag}: {name} differs"


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_one_launch_backward_under_cuda_graphs_and_streams(op):
    """8192x128: the backward's last program adds the partials (no sum_partials launch), counting on a counter kept
    per stream, or one per call while a graph is captured. Eager runs repeat bit for bit; so do two graphs captured
    on one stream, replayed many times, alone and concurrently on two streams, with eager calls in between; and
    eager calls on two streams at once. Every counter is back at zero afterwards."""
    assert not _sum_partials_launches(op, 8192, 128), "the 8192x128 backward takes the two-launch path"
    step = _norm_step(op)
    expected = step()
    step.check(expected)
    _assert_equal("eager rerun", step(), expected)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch.cuda.graph asks
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graphs, outputs = [], []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs.append(step())
        graphs.append(graph)
    for i in range(20):
        for graph, out in zip(graphs, outputs):
            graph.replay()
            _assert_equal(f"replay {i}", out, expected)
        _assert_equal(f"eager between replays {i}", step(), expected)

    streams = torch.cuda.Stream(), torch.cuda.Stream()
    for i in range(20):  # the two graphs at once, then eager calls at once, on two streams
        for stream, graph in zip(streams, graphs):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.replay()
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        for out in outputs:
            _assert_equal(f"concurrent replay {i}", out, expected)
        results = []
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                results.append(step())
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        for got in results:
            _assert_equal(f"concurrent eager {i}", got, expected)
    torch.cuda.synchronize()
    for counter, *_ in norms_triton._scratch.values():
        assert counter.item() == 0
