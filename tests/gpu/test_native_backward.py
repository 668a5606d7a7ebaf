"""The C++ backward nodes of eager Triton norm calls (runtime.accelerators.native) on CUDA: the gradients bit for bit
those of the autograd.Function they replace, under CUDA graphs, side streams, saved-tensor hooks and the errors
autograd users rely on. (test_norms_triton.py checks the same calls against float64 with poisoned outputs.)"""

import contextlib
import importlib

import pytest
import torch

from runtime.accelerators import l2norm, layer_norm, native, rms_norm
from runtime.accelerators.kernel_op import KernelOp

NODES = {"rms_norm": "RmsNormTritonBackward", "layer_norm": "LayerNormTritonBackward", "l2norm": "L2NormTritonBackward"}


def call(op: str, x, with_params: bool):
    """(y, the tensors to differentiate) of op on the Triton backend."""
    width = x.shape[-1]
    w = torch.randn(width, device="cuda", dtype=x.dtype, requires_grad=True) if with_params else None
    b = torch.randn(width, device="cuda", dtype=x.dtype, requires_grad=True) if with_params else None
    if op == "rms_norm":
        return rms_norm(x, w, backend="triton"), [t for t in (x, w) if t is not None]
    if op == "layer_norm":
        return layer_norm(x, w, b, backend="triton"), [t for t in (x, w, b) if t is not None]
    return l2norm(x, backend="triton"), [x]


@contextlib.contextmanager
def python_backward(op: str):
    """Eager calls of op take the autograd.Function within the block."""
    kernel_op: KernelOp = importlib.import_module(f"runtime.accelerators.{op}").KERNEL
    kernel_op._native["triton"] = None
    try:
        yield
    finally:
        kernel_op._native.pop("triton")


@pytest.fixture(autouse=True)
def _native_here():
    if native.reasons():
        pytest.skip(f"native nodes cannot run here: {native.reasons()}")


def gradient(shape, dtype, kind: str):
    if kind == "expanded":
        return torch.ones((), device="cuda", dtype=dtype).expand(*shape)
    if kind == "strided":
        return torch.randn(*shape[:-1], 2 * shape[-1], device="cuda", dtype=dtype)[..., ::2]
    return torch.randn(*shape, device="cuda", dtype=dtype)


CASES = [
    (torch.bfloat16, (8192, 128), True, "dense"), (torch.bfloat16, (8192, 128), False, "dense"),
    (torch.float16, (3, 1000, 200), True, "expanded"), (torch.float32, (4097, 48), True, "strided"),
    (torch.bfloat16, (131072, 64), True, "dense"), (torch.bfloat16, (1, 37), True, "dense"),
]  # fmt: skip


@pytest.mark.parametrize("op", sorted(NODES))
@pytest.mark.parametrize("dtype, shape, with_params, grad_kind", CASES, ids=lambda v: str(v))
def test_the_node_gives_the_python_backward_bit_for_bit(op, dtype, shape, with_params, grad_kind):
    x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    assert_node_matches_python(op, x, gradient(shape, dtype, grad_kind), with_params)


def assert_node_matches_python(op: str, x, dy, with_params: bool):
    """op's output and gradients through the C++ node equal those through the autograd.Function, bit for bit."""
    torch.manual_seed(1)
    y, inputs = call(op, x, with_params)
    assert y.grad_fn.name() == NODES[op]
    got = torch.autograd.grad(y, inputs, dy)
    with python_backward(op):
        torch.manual_seed(1)
        y_ref, inputs_ref = call(op, x, with_params)
        assert y_ref.grad_fn.name() != NODES[op]
        want = torch.autograd.grad(y_ref, [x, *inputs_ref[1:]], dy)
    assert torch.equal(y, y_ref)
    for g, r in zip(got, want):
        assert torch.equal(g, r)


@pytest.mark.parametrize("op", sorted(NODES))
def test_rows_that_are_not_a_view(op):
    """x transposed: its rows are a copy, made once for the forward and the node's saved input."""
    x = torch.randn(96, 300, device="cuda", dtype=torch.bfloat16, requires_grad=True).t()
    assert_node_matches_python(op, x, torch.randn(300, 96, device="cuda", dtype=torch.bfloat16), True)


def test_wide_rows_keep_the_python_backward():
    """Rows wide enough that the parameter gradients take a second launch (sum_partials)."""
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y, _ = call("rms_norm", x, True)
    assert y.grad_fn.name() != NODES["rms_norm"]


@pytest.mark.parametrize("op", sorted(NODES))
def test_forward_and_backward_captured_in_a_cuda_graph(op):
    x = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    torch.manual_seed(1)
    y, inputs = call(op, x, True)
    want = torch.autograd.grad(y, inputs, dy)
    params = inputs[1:]
    # an autograd graph alive from before the capture would keep x's gradient accumulator on the default stream,
    # which the capture cannot wait on (torch warns of the mismatch)
    del y
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks
        for _ in range(2):
            torch.autograd.grad(_call_with(op, x, params), [x, *params], dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = _call_with(op, x, params)
        assert y_graph.grad_fn.name() == NODES[op]
        got = torch.autograd.grad(y_graph, [x, *params], dy)
    for _ in range(3):  # replays reuse the graph's scratch: the counter must come back to zero each time
        graph.replay()
        torch.cuda.synchronize()
        for g, r in zip(got, want):
            assert torch.equal(g, r)
    # eager calls after the graph still agree (their scratch was never the graph's)
    for g, r in zip(torch.autograd.grad(_call_with(op, x, params), [x, *params], dy), want):
        assert torch.equal(g, r)


def _call_with(op, x, params):
    if op == "rms_norm":
        return rms_norm(x, *params, backend="triton")
    if op == "layer_norm":
        return layer_norm(x, *params, backend="triton")
    return l2norm(x, backend="triton")


def test_a_side_stream():
    x = torch.randn(8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    want = torch.autograd.grad(rms_norm(x, w, backend="triton"), [x, w], dy)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = torch.autograd.grad(rms_norm(x, w, backend="triton"), [x, w], dy)
    torch.cuda.current_stream().wait_stream(side)
    for g, r in zip(got, want):
        assert torch.equal(g, r)


def test_retained_graph_and_saved_tensor_hooks():
    x = torch.randn(1000, 200, device="cuda", dtype=torch.float16, requires_grad=True)
    w = torch.randn(200, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn_like(x)
    y = layer_norm(x, w, None, backend="triton")
    first = torch.autograd.grad(y, [x, w], dy, retain_graph=True)
    second = torch.autograd.grad(y, [x, w], dy)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t.cpu(), lambda t: t.cuda()):
        y_hooked = layer_norm(x, w, None, backend="triton")
    assert packed, "the node's saved tensors go through the hooks"
    third = torch.autograd.grad(y_hooked, [x, w], dy)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_errors():
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    with pytest.raises(RuntimeError, match="RmsNormTritonBackward: double backward"):
        torch.autograd.grad(rms_norm(x, w, backend="triton"), [x, w], dy, create_graph=True)
    y = rms_norm(x, w, backend="triton")
    torch.autograd.grad(y, [x, w], dy)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(y, [x, w], dy)
    y = rms_norm(x, w, backend="triton")
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, [x, w], dy)
