"""KernelOp's eager path: what it saves for backward, and the arguments a backend's backward gets."""

import dataclasses

import pytest
import torch

import runtime.accelerators as acc
from runtime.accelerators.bce_with_logits import KERNEL as BCE
from runtime.accelerators.bce_with_logits import UNIT_GRADIENT_KERNEL as BCE_UNIT_GRADIENT
from runtime.accelerators.dropout_add import KERNEL as DROPOUT_ADD
from runtime.accelerators.gated_delta_rule import CHUNK
from runtime.accelerators.kernel_backend import KernelBackend
from runtime.accelerators.kernel_op import KernelOp
from runtime.accelerators.layer_norm import KERNEL as LAYER_NORM
from runtime.accelerators.rms_norm import KERNEL as RMS_NORM


def replace_kernels(monkeypatch, kernel_op, backend: str, **entries) -> KernelBackend:
    """For this test, kernel_op runs a copy of the backend's KernelBackend with `entries` replaced (its per-backend
    caches emptied, so that nothing resolved before is used). Returns the original."""
    original = kernel_op.kernels(backend)
    monkeypatch.setattr(kernel_op, "_backends", {backend: dataclasses.replace(original, **entries)})
    for cache in ("_infer", "_eager", "_native"):
        monkeypatch.setattr(kernel_op, cache, {})
    return original


def spy_on_backward(monkeypatch, kernel_op, backend: str) -> list:
    """The arguments of each call of the backend's backward, for this test."""
    received = []
    backward = kernel_op.kernels(backend).backward
    replace_kernels(monkeypatch, kernel_op, backend, backward=lambda *args: received.append(args) or backward(*args))
    return received


def test_arguments_come_back_in_schema_order():
    """Tensor arguments are saved, plain values kept on ctx; backward gets them back in the schema's order, also
    where values sit between tensors."""
    x, weight, bias, residual, seed = (torch.randn(2) for _ in range(5))
    assert LAYER_NORM.arguments((x, weight, bias), (1e-5,)) == (x, weight, bias, 1e-5)
    assert DROPOUT_ADD.arguments((x, residual, seed), (0.1,)) == (x, residual, 0.1, seed)
    q, k, v, g, beta, state, cu = (torch.randn(2) for _ in range(7))
    args = (q, k, v, g, beta, 0.5, state, True, False, cu)
    assert CHUNK.arguments(CHUNK.tensors_of(args), CHUNK.values_of(args)) == args


def test_bce_backward_recomputes_from_the_arguments(monkeypatch):
    """bce's KERNEL (backward_reads="arguments"): the loss is neither saved nor passed, the arguments are (None for
    the absent weight and pos_weight)."""
    logits, targets = torch.randn(6, requires_grad=True), torch.rand(6, requires_grad=True)
    received = spy_on_backward(monkeypatch, BCE, "triton")
    loss = acc.binary_cross_entropy_with_logits(logits, targets, backend="triton")
    saved = loss.grad_fn.saved_tensors
    assert len(saved) == 4 and saved[0] is logits and saved[1] is targets and saved[2:] == (None, None)
    torch.autograd.grad(loss, (logits, targets))
    assert received[0][-1] is None  # the loss


def test_bce_gradient_from_the_forward_saves_the_logits_and_that_gradient_alone(monkeypatch):
    """Small eager bce calls whose logits alone need a gradient run UNIT_GRADIENT_KERNEL: it saves the logits and
    the forward's unit gradient, not the targets (unread_args) nor the loss (backward_reads="saved"); its backward
    scales that gradient, and KERNEL's backward never runs."""
    logits, targets = torch.randn(2, 3, requires_grad=True), torch.rand(2, 3)
    replace_kernels(monkeypatch, BCE, "triton", backward=lambda *args: pytest.fail("the backend's backward ran"))
    received = spy_on_backward(monkeypatch, BCE_UNIT_GRADIENT, "triton")
    loss = acc.binary_cross_entropy_with_logits(logits, targets, backend="triton")
    logits_, *unread, unit = loss.grad_fn.saved_tensors
    assert logits_ is logits and unread == [None, None, None]
    assert unit.shape == (2, 3) and unit.dtype == torch.float32
    (dlogits,) = torch.autograd.grad(loss, logits, torch.tensor(2.0))
    expected = 2.0 * (torch.sigmoid(logits.detach()) - targets) / 6
    torch.testing.assert_close(dlogits, expected)
    assert received[0][2:5] == (None, None, None) and received[0][-2] is None  # targets, weights, loss


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_backward_that_reads_the_saved_statistics(op, monkeypatch):
    """The Triton norms' backward reads the statistics forward stores (backward_reads="saved"): an eager forward saves
    the arguments and those statistics, not y; backward gets None for y and forward's statistics, and gives the
    gradients of the custom ops' path."""
    kernel_op = {"rms_norm": RMS_NORM, "layer_norm": LAYER_NORM}[op]
    kernels = kernel_op.kernels("triton")
    assert kernels.backward_reads == "saved"
    x = torch.randn(5, 48, requires_grad=True)
    params = {"weight": torch.randn(48, requires_grad=True)}
    if op == "layer_norm":
        params["bias"] = torch.randn(48, requires_grad=True)
    received = spy_on_backward(monkeypatch, kernel_op, "triton")
    y = getattr(acc, op)(x, **params, backend="triton")
    saved = y.grad_fn.saved_tensors
    n_stats = 2 if op == "layer_norm" else 1
    assert len(saved) == 1 + len(params) + n_stats and all(a is b for a, b in zip(saved, (x, *params.values())))
    assert all(t.shape == (5,) and t.dtype == torch.float32 for t in saved[-n_stats:])
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *params.values()], dy)
    results = received[0][-1 - n_stats :]
    assert results[0] is None and all(a is b for a, b in zip(results[1:], saved[-n_stats:]))
    # the results the custom ops pass (forward's y too) give the same gradients
    args = (x.detach(), *(p.detach() for p in params.values()), 1e-5 if op == "layer_norm" else 1e-6)
    results = kernels.forward(*args)
    for got, want in zip(grads, kernels.backward(dy, *args, *results)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bce_gradient_from_the_forward_twice(reduction):
    """The forward writes the unit gradient and backward scales it (fp32: one multiply): a second backward over the
    same graph (retain_graph) gives the same gradient, so backward does not scale the saved unit gradient in place."""
    logits, targets = torch.randn(7, requires_grad=True), torch.rand(7)
    loss = acc.binary_cross_entropy_with_logits(logits, targets, reduction=reduction, backend="triton")
    grad = torch.randn_like(loss)
    first = torch.autograd.grad(loss, logits, grad, retain_graph=True)[0]
    second = torch.autograd.grad(loss, logits, grad)[0]
    assert first.dtype == torch.float32 and torch.equal(first, second)
    reference = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction=reduction)
    expected = torch.autograd.grad(reference, logits, grad)[0]
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-7)


def test_kernel_backend_checks_its_declaration():
    forward = lambda x: (x,)  # noqa: E731
    with pytest.raises(ValueError, match="backward_reads"):
        KernelBackend(forward=forward, backward=forward, backward_reads="outputs")
    with pytest.raises(TypeError, match="KernelBackend.infer"):
        KernelBackend(forward=forward, infer="infer")
    with pytest.raises(ValueError, match="native_forward"):
        KernelBackend(forward=forward, native_forward=forward)


def _kernel_op(name: str, backends: dict) -> KernelOp:
    return KernelOp(name, "Tensor x", n_outputs=1, n_saved=0, fake_forward=torch.empty_like, backends=backends)


def test_kernel_op_checks_its_loaders():
    """A loader that is not a function fails when the op is declared; one that returns something else than a
    KernelBackend, at its first use, naming the op and the backend; a backend the op has not, naming those it has."""
    with pytest.raises(TypeError, match="test_not_callable: the 'triton' backend's loader is not callable"):
        _kernel_op("test_not_callable", {"triton": "runtime.accelerators.rms_norm.triton:KERNELS"})
    op = _kernel_op("test_wrong_loader", {"triton": lambda: lambda x: (x,)})
    with pytest.raises(TypeError, match="test_wrong_loader: the 'triton' backend's loader returned function"):
        op.kernels("triton")
    with pytest.raises(ValueError, match="test_wrong_loader: no 'tilelang' kernels; it has triton"):
        op.kernels("tilelang")


def test_loaders_run_on_first_use_alone():
    """A backend's loader runs at its first use, once: declaring the op imports no kernel module."""
    kernels, calls = KernelBackend(forward=lambda x: (x * 2,)), []
    op = _kernel_op("test_first_use", {"triton": lambda: calls.append(1) or kernels})
    assert calls == []
    x = torch.randn(3)
    torch.testing.assert_close(op("triton", x), x * 2)
    torch.testing.assert_close(op("triton", x), x * 2)
    assert calls == [1] and op.kernels("triton") is kernels


def kernel_ops() -> list:
    import importlib

    from runtime.accelerators.config import OP_NAMES

    modules = [importlib.import_module(f"runtime.accelerators.{op}") for op in OP_NAMES]
    modules.append(importlib.import_module("runtime.accelerators.flash_attention.varlen"))
    return [value for module in modules for value in vars(module).values() if isinstance(value, KernelOp)]


def test_every_kernel_op_loads_its_declarations():
    """Each KernelOp's loaders return KernelBackends (where the backend's library imports here)."""
    from runtime.accelerators.backends import library_reasons

    ops = kernel_ops()
    assert len({op.name for op in ops}) == len(ops) >= 18
    for op in ops:
        assert "triton" in op.loaders and set(op.loaders) <= {"triton", "tilelang"}, op.name
        for backend, loader in op.loaders.items():
            if not library_reasons(backend):
                assert isinstance(loader(), KernelBackend), (op.name, backend)


def test_importing_the_package_imports_no_kernel_module():
    """The loaders are called on a backend's first use: importing the public API (and the nn wrappers) imports none
    of the ops' triton.py / tilelang.py."""
    import subprocess
    import sys

    code = (
        "import sys, runtime.accelerators, runtime.nn\n"
        "print([m for m in sys.modules if m.startswith('runtime.') and m.rsplit('.', 1)[-1] in ('triton', 'tilelang')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_an_op_outside_graphs_registers_no_custom_ops_and_breaks_the_graph():
    """in_graphs=False: no custom ops (no fake needed); under torch.compile the call runs eagerly outside the graph,
    through the same eager path, its gradient included."""
    kernels = KernelBackend(forward=lambda x, scale: (x * scale,), backward=lambda g, x, scale, out: (g * scale, None))
    op = KernelOp(
        "test_outside_graphs", "Tensor x, float scale", 1, 0, None, {"triton": lambda: kernels}, in_graphs=False
    )
    assert op._forward_op is None and not hasattr(torch.ops.taac, "test_outside_graphs_forward")
    x = torch.randn(5, requires_grad=True)
    breaks = []

    def backend(gm, example_inputs):
        breaks.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: op("triton", x.sin(), 3.0).cos(), backend=backend)
    out = compiled(x)
    torch.testing.assert_close(out, (3.0 * x.detach().sin()).cos())
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(grad, -(3.0 * x.detach().sin()).sin() * 3.0 * x.detach().cos())
    assert len(breaks) == 2  # the graphs before and after the call
    with pytest.raises(ValueError, match="test_no_fake: fake_forward is required"):
        KernelOp("test_no_fake", "Tensor x", 1, 0, None, {"triton": lambda: kernels})


def test_unread_arguments_are_saved_as_none():
    """unread_args: eager calls save None in their place, whatever their position among the tensor arguments."""
    kernels = KernelBackend(forward=lambda a, b, c, d: (a + c,))
    op = KernelOp(
        "test_unread", "Tensor a, Tensor b, Tensor? c, float d", 1, 0, torch.add, {"triton": lambda: kernels},
        unread_args=("b",),
    )  # fmt: skip
    a, b, c = torch.randn(3), torch.randn(3), torch.randn(3)
    assert op.saved_tensors_of((a, b, c, 1.0)) == (a, None, c)


def test_the_collection_declares_its_triton_kernels():
    """embedding_bag_collection reaches its Triton entry points through a loader returning a KernelBackend."""
    from runtime.accelerators.backends import library_reasons
    from runtime.accelerators.embedding_bag_mean import collection

    assert set(collection.BACKENDS) == {"triton"}
    if not library_reasons("triton"):
        kernels = collection.BACKENDS["triton"]()
        assert isinstance(kernels, KernelBackend) and kernels.backward_reads == "saved"
