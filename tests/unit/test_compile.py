"""Ops under torch.compile: custom ops with fake implementations, full graphs, same results as eager."""

import pytest
import torch

import runtime.accelerators as acc


def _block(x, w):
    return acc.layer_norm(acc.rms_norm(x, w, backend="triton") * 2, backend="triton")


def test_compiled_full_graph_matches_eager_forward_and_backward():
    x, w = torch.randn(5, 48, requires_grad=True), torch.randn(48, requires_grad=True)
    compiled = torch.compile(_block, backend="aot_eager", fullgraph=True)
    y_c = compiled(x, w)  # compiled first: the backend decision happens while tracing
    grads_c = torch.autograd.grad(y_c.square().sum(), [x, w])
    y_e = _block(x, w)
    grads_e = torch.autograd.grad(y_e.square().sum(), [x, w])
    torch.testing.assert_close(y_c, y_e)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e)


def test_compiled_graph_serves_new_batch_sizes():
    w = torch.randn(48)
    compiled = torch.compile(lambda x: acc.rms_norm(x, w, backend="triton"), backend="aot_eager", fullgraph=True)
    for rows in (3, 5, 9):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(compiled(x), acc.rms_norm(x, w, backend="torch"), rtol=1e-5, atol=1e-5)


ELEMENTWISE = {
    "swiglu": lambda x: acc.swiglu(x, x * 2, backend="triton"),
    "dropout_add": lambda x: acc.dropout_add(x, x * 2, 0.0, backend="triton"),
    "bce_with_logits": lambda x: acc.binary_cross_entropy_with_logits(
        x, x.sigmoid(), reduction="none", backend="triton"
    ),
    "rms_norm": lambda x: acc.rms_norm(x, backend="triton"),
}


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic-dynamic", "dynamic"])
@pytest.mark.parametrize("op", sorted(ELEMENTWISE))
def test_compiled_full_graph_with_dynamic_shapes(op, dynamic):
    # the decision keys of these ops hold numel() or the last size, symbolic once shapes are dynamic
    compiled = torch.compile(ELEMENTWISE[op], backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for rows in (3, 5, 9):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(compiled(x), ELEMENTWISE[op](x))


def test_compiled_fallback_warns_and_runs_the_reference():
    x = torch.randn(4, 32)
    compiled = torch.compile(lambda x: acc.l2norm(x, backend="tilelang"), backend="aot_eager", fullgraph=True)
    with pytest.warns(acc.BackendFallbackWarning, match="l2norm: the tilelang backend"):
        y = compiled(x)
    torch.testing.assert_close(y, acc.l2norm(x, backend="torch"))


def test_compiled_dropout_draws_a_fresh_seed_per_call_in_a_full_graph():
    # the seed is drawn from torch's generator inside the graph (a device tensor argument of the custom
    # op), not frozen into it at trace time
    x = torch.randn(64, 32, requires_grad=True)
    residual = torch.zeros(64, 32)
    compiled = torch.compile(
        lambda x, r: acc.dropout_add(x, r, 0.5, backend="triton"), backend="aot_eager", fullgraph=True
    )
    first, second = compiled(x, residual), compiled(x, residual)
    assert not torch.equal(first, second)
    torch.manual_seed(3)
    again = compiled(x, residual)
    torch.manual_seed(3)
    assert torch.equal(compiled(x, residual), again)
    (grad,) = torch.autograd.grad(again.sum(), [x])
    torch.testing.assert_close(grad, (again != 0).float() * 2.0)  # the forward's mask, scaled by 1 / (1 - p)


def test_compiled_scalar_inputs_without_a_traceable_guard_scalar(monkeypatch):
    # Dynamo traces guard_scalar from torch 2.8 on; torch 2.4 to 2.7 skip it (a graph break: fullgraph fails), so there
    # the backend decision must keep its constant bool / int / float inputs without calling it. Emulated here: a
    # guard_scalar Dynamo does not trace, and the decision select_backend makes while compiling, its inputs described
    # as on those versions (traces_guard_scalar=False).
    from torch.fx.experimental import symbolic_shapes

    from runtime.accelerators import backends
    from runtime.accelerators.flash_attention import SPEC
    from runtime.accelerators.flash_attention.reference import flash_attention_reference

    monkeypatch.setattr(symbolic_shapes, "guard_scalar", torch._dynamo.disable(symbolic_shapes.guard_scalar))
    q, k, v = (torch.randn(2, 2, 9, 16) for _ in range(3))

    def attention(q, k, v, causal, dropout_p):  # dropout_p, scale and causal: float, None, bool
        inputs = dict(q=q, k=k, v=v, causal=causal, key_lengths=None, attn_mask=None, dropout_p=dropout_p, scale=None)
        described = backends._describe(SPEC, inputs, traces_guard_scalar=False)
        chosen = backends._decide_while_compiling(SPEC.name, "torch", q.device, described)
        assert chosen == "torch"
        return flash_attention_reference(q, k, v, causal, None, None, dropout_p, None)

    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    for causal in (True, False):
        torch.testing.assert_close(compiled(q, k, v, causal, 0.0), attention(q, k, v, causal, 0.0))


def _norms_dropout_mhc(x, residual, phi, alpha, bias):
    """layer_norm -> l2norm -> dropout_add (eval) -> mhc_pre, a stand-in block, mhc_post: on the torch backend."""
    h = acc.l2norm(acc.layer_norm(x, backend="torch"), backend="torch")
    h = acc.dropout_add(h, residual, 0.1, training=False, backend="torch")
    h_in, h_post, h_res = acc.mhc_pre(h, phi, alpha, bias, backend="torch")
    return acc.mhc_post(h, h_in * 2, h_post, h_res, backend="torch")


def test_compiled_norms_dropout_and_mhc_on_the_torch_backend():
    # torch 2.11's Dynamo cannot trace Tensor.unflatten (a Python method calling super().unflatten()): fullgraph failed
    # there on this chain. Torch 2.13 traces it into a call_method node: the chain's graph must hold none.
    n, C = 4, 16
    m = n * n + 2 * n
    inputs = [
        torch.randn(3, n, C, requires_grad=True),
        torch.randn(3, n, C),
        (torch.randn(n * C, m) * (n * C) ** -0.5).requires_grad_(),
        torch.tensor([0.8, 1.1, 1.3], requires_grad=True),
        (0.3 * torch.randn(m)).requires_grad_(),
    ]
    leaves = [x for x in inputs if x.requires_grad]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(_norms_dropout_mhc, backend=backend, fullgraph=True)
    out, expected = compiled(*inputs), _norms_dropout_mhc(*inputs)
    methods = {node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_method"}
    assert "unflatten" not in methods
    torch.testing.assert_close(out, expected)
    for grad, ref in zip(torch.autograd.grad(out.sum(), leaves), torch.autograd.grad(expected.sum(), leaves)):
        torch.testing.assert_close(grad, ref)


SAVING = {  # op -> (its KernelOp's module and name, a call on the triton backend, the results its backward reads)
    "rms_norm": ("rms_norm.KERNEL", lambda x: acc.rms_norm(x, backend="triton"), "saved"),
    "gelu": ("activation.GELU_KERNEL", lambda x: acc.gelu(x, backend="triton"), "arguments"),
    "bce_with_logits": (
        "bce_with_logits.UNIT_GRADIENT_KERNEL",
        lambda x: acc.binary_cross_entropy_with_logits(x, torch.rand_like(x), backend="triton"),
        "saved",
    ),
    "l2norm": ("l2norm.KERNEL", lambda x: acc.l2norm(x, backend="triton"), "results"),
}


@pytest.mark.parametrize("op", sorted(SAVING))
def test_compiled_backward_gets_the_results_its_backend_reads(op, monkeypatch):
    """The custom op's registered autograd saves what eager calls save (backward_reads): the backward op gets None for
    each result its backend does not read (so the graph keeps none of them), every other result as forward wrote it;
    the gradients are eager's."""
    import dataclasses
    import importlib

    module, name = SAVING[op][0].rsplit(".", 1)
    kernel_op = getattr(importlib.import_module(f"runtime.accelerators.{module}"), name)
    call, reads = SAVING[op][1:]
    kernels = kernel_op.kernels("triton")
    assert kernels.backward_reads == reads
    received = []

    def backward(*args):
        received.append(args)
        return kernels.backward(*args)

    monkeypatch.setattr(kernel_op, "_backends", {"triton": dataclasses.replace(kernels, backward=backward)})
    for cache in ("_infer", "_eager", "_native"):
        monkeypatch.setattr(kernel_op, cache, {})
    x = torch.randn(6, 40, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    torch.manual_seed(0)
    (grad,) = torch.autograd.grad(compiled(x).sum(), x)
    torch.manual_seed(0)
    (expected,) = torch.autograd.grad(call(x).sum(), x)
    torch.testing.assert_close(grad, expected)
    n_results = kernel_op.n_outputs + kernel_op.n_saved
    results = received[0][-n_results:]  # the compiled call's: the eager one ran its own autograd.Function
    first_saved = kernels.first_saved(kernel_op.n_outputs, n_results)
    assert all(r is None for r in results[:first_saved]), results
    assert all(isinstance(r, torch.Tensor) for r in results[first_saved:]), results
