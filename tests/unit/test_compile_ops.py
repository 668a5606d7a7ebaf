"""Every public op compiled with fullgraph=True on strided (non-contiguous) inputs, on the triton backend under the
interpreter: the compiled graph's custom ops return exactly the strides their fake implementations promised (what
inductor asserts at run time), and outputs and gradients equal eager ones."""

import functools
import inspect

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils._pytree import tree_leaves

import runtime.accelerators as acc

B, L, H, D = 2, 9, 4, 16


def _significant_strides(t: torch.Tensor) -> tuple:
    """The strides the compiler checks: those of dimensions longer than 1."""
    return tuple(stride if size > 1 else None for size, stride in zip(t.shape, t.stride()))


class _StrideCheck(torch.fx.Interpreter):
    """Runs a compiled graph, checking each taac custom op's real results against the fake ones it was traced with."""

    checked: list

    def run_node(self, node):
        result = super().run_node(node)
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "taac":
            reals, fakes = tree_leaves(result), tree_leaves(node.meta["val"])
            assert len(reals) == len(fakes), f"{target}: {len(reals)} results, traced with {len(fakes)}"
            for i, (real, fake) in enumerate(zip(reals, fakes)):
                if not isinstance(real, torch.Tensor):
                    continue
                assert (tuple(real.shape), real.dtype) == (tuple(fake.shape), fake.dtype), f"{target} result {i}"
                assert _significant_strides(real) == _significant_strides(fake), (
                    f"{target} result {i}: strides {real.stride()}, traced with {fake.stride()} (shape {tuple(real.shape)})"
                )
            self.checked.append(str(target))
        return result


def _stride_checking_backend(checked: list):
    def compiler(gm, example_inputs):
        def run(*args):
            interpreter = _StrideCheck(gm)
            interpreter.checked = checked
            return interpreter.run(*args)

        return make_boxed_func(run)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def _randn(*shape, scale=1.0):
    return (scale * torch.randn(*shape)).requires_grad_()


# Each case: (make the leaf inputs, fn(backend, *inputs)). The functions take strided views of their inputs, as models
# do (transposes, slices, the unbound heads of a fused projection).


def _norm_inputs():
    return _randn(48, 7), _randn(96), _randn(96)


def _attention(backend, x, key_lengths):
    q, k, v = x.view(B, L, 3, H, D).unbind(2)  # a fused QKV projection
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return acc.flash_attention(q, k, v, causal=True, key_lengths=key_lengths, backend=backend)


def _gdr_inputs(requires_grad=True):
    T, heads, K = 21, 2, 16
    tensors = (
        torch.randn(B, T, 2 * heads * K),  # q and k from one projection
        torch.randn(B, heads, T, K),  # v, heads first
        torch.randn(B, 2 * heads, T),  # g and beta, heads first
        torch.randn(B, heads, K, K, 2)[..., 0],  # the initial state, strided
    )
    return tuple(t.requires_grad_(requires_grad) for t in tensors)


def _gdr(function, backend, qk, v, gb, state):
    heads, K = v.shape[1], v.shape[-1]
    q, k = qk.view(B, -1, 2, heads, K).unbind(2)
    g, beta = gb.transpose(1, 2).chunk(2, dim=-1)
    return function(
        q, k, v.transpose(1, 2), F.logsigmoid(g), beta.sigmoid(), initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, backend=backend,
    )  # fmt: skip


def _mhc_inputs(n=4, C=8):
    m = n * n + 2 * n
    return (
        _randn(C, B, 3, n).detach().permute(1, 2, 3, 0).requires_grad_(),  # x [B, 3, n, C], C not innermost
        _randn(m, n * C, scale=(n * C) ** -0.5),
        (torch.tensor([0.8, 1.1, 1.3]) + 0.1 * torch.randn(3)).requires_grad_(),
        _randn(2 * m, scale=0.3),
        _randn(C, B, 3),
    )


def _mhc(backend, x, phi, alpha, bias, y):
    h_in, h_post, h_res = acc.mhc_pre(x, phi.t(), alpha, bias[::2], backend=backend)
    return h_in, h_post, h_res, acc.mhc_post(x, h_in * y.permute(1, 2, 0), h_post, h_res, backend=backend)


def _bags():
    return _randn(80, 5), torch.randint(0, 40, (6, 8))  # the table: every other row of the weight


CASES = {
    "rms_norm": (lambda: _norm_inputs()[:2], lambda backend, x, w: acc.rms_norm(x.t(), w[::2], backend=backend)),
    "layer_norm": (_norm_inputs, lambda backend, x, w, b: acc.layer_norm(x.t(), w[::2], b[1::2], backend=backend)),
    "l2norm": (lambda: _norm_inputs()[:1], lambda backend, x: acc.l2norm(x.t(), backend=backend)),
    "flash_attention": (
        lambda: (_randn(B, L, 3 * H * D), torch.tensor([9, 4])),
        _attention,
    ),
    "chunk_gated_delta_rule": (_gdr_inputs, functools.partial(_gdr, acc.chunk_gated_delta_rule)),
    "fused_recurrent_gated_delta_rule": (
        lambda: _gdr_inputs(requires_grad=False),  # forward-only kernels
        functools.partial(_gdr, acc.fused_recurrent_gated_delta_rule),
    ),
    "binary_cross_entropy_with_logits": (
        lambda: (_randn(7, 2, 10), torch.rand(10, 7), torch.rand(7, 20), torch.rand(20)),
        lambda backend, x, y, w, pw: acc.binary_cross_entropy_with_logits(
            x[:, 0], y.t(), w[:, ::2], pw[::2], reduction="none", backend=backend
        ),
    ),
    "binary_cross_entropy_with_logits-mean": (
        lambda: (_randn(7, 2, 10), torch.rand(10, 7, requires_grad=True)),
        lambda backend, x, y: acc.binary_cross_entropy_with_logits(x[:, 1], y.t(), backend=backend),
    ),
    "swiglu": (lambda: (_randn(5, 2, 24),), lambda backend, x: acc.swiglu(*x.unbind(1), backend=backend)),
    "dropout_add": (
        lambda: (_randn(24, 5), _randn(5, 48)),
        lambda backend, x, r: acc.dropout_add(x.t(), r[:, ::2], 0.25, backend=backend),
    ),
    "embedding_bag_mean": (_bags, lambda backend, w, i: acc.embedding_bag_mean(w[::2], i[:, ::2], backend=backend)),
    "embedding_bag_mean-offsets": (
        lambda: (*_bags(), torch.tensor([0, 3, 3, 9])),
        lambda backend, w, i, offsets: acc.embedding_bag_mean(
            w[::2], i.t().flatten()[::3], offsets, padding_idx=2, backend=backend
        ),
    ),
    "mhc_pre-mhc_post": (_mhc_inputs, _mhc),
    "add_rms_norm": (
        lambda: (_randn(48, 7), _randn(7, 96), _randn(96)),
        lambda backend, x, r, w: acc.add_rms_norm(x.t(), r[:, ::2], w[::2], backend=backend),
    ),
    "add_layer_norm": (
        lambda: (_randn(48, 7), _randn(7, 96), _randn(96), _randn(96)),
        lambda backend, x, r, w, b: acc.add_layer_norm(x.t(), r[:, ::2], w[::2], b[1::2], backend=backend),
    ),
    "gelu-silu": (
        lambda: (_randn(24, 5),),
        lambda backend, x: (
            acc.gelu(x.t(), backend=backend),
            acc.gelu(x.t(), "tanh", backend=backend),
            acc.silu(x.t(), backend=backend),
        ),
    ),
    "silu_attention": (
        lambda: (_randn(21, 3 * 2 * 16), torch.tensor([0, 5, 5, 21], dtype=torch.int32), _randn(16), _randn(2, 12)),
        lambda backend, x, cu, position, time_bias: acc.silu_attention(
            *x.view(21, 3, 2, 16).unbind(1),
            cu,
            max_seqlen=16,
            position_bias=position[::2],
            time_bias=time_bias[:, ::2],
            timestamps=torch.arange(21) * 37,
            backend=backend,
        ),
    ),
    "top_k-sample": (  # forward-only kernels: no input requires grad
        lambda: (torch.randn(300, 3),),
        lambda backend, x: (
            *acc.top_k(x.t(), 7, backend=backend),
            acc.sample(x.t(), temperature=0.7, top_k=5, top_p=0.9, backend=backend),
        ),
    ),
    "linear": (  # fp16: the interpreter's bf16 dot is wrong, and the kernels take no fp32
        lambda: tuple(
            t.half().requires_grad_() for t in (torch.randn(16, 40), 0.2 * torch.randn(64, 16), torch.randn(64))
        ),
        lambda backend, x, w, b: acc.linear(x.t(), w[::2], b[::2], "gelu", backend=backend),
    ),
}

# public names of runtime.accelerators that are not ops
NOT_OPS = {"explain", "active_config", "set_accelerators", "use_accelerators"}
# ops that run outside the compiled graph today (a graph break, so fullgraph=True fails): strict xfails, which turn
# into failures the day they compile
GRAPH_BREAKS = {
    "embedding_bag_collection": (
        lambda: ([_randn(10, 8), _randn(12, 16)], torch.tensor([1, 2, 3, 4, 5, 11]), torch.tensor([0, 2, 3, 3, 6])),
        lambda backend, weights, values, offsets: acc.embedding_bag_collection(
            weights, values, offsets, backend=backend
        ),
    ),
}


def test_every_public_op_has_a_case():
    ops = {name for name in acc.__all__ if inspect.isfunction(getattr(acc, name))}
    covered = {op for case in [*CASES, *GRAPH_BREAKS] for op in case.split("-") if op in ops}
    assert ops - NOT_OPS - covered == set(), "add a case to CASES for each public op"


def _run(fn, inputs):
    """fn's outputs and the gradients of a weighted sum of them (fixed weights), with respect to every input that
    requires one."""
    outputs = tuple(o for o in tree_leaves(fn(*inputs)) if isinstance(o, torch.Tensor))
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not leaves:
        return outputs, ()
    generator = torch.Generator().manual_seed(1)
    loss = sum(
        (o.float() * torch.randn(o.shape, generator=generator).to(o.device)).sum() for o in outputs if o.requires_grad
    )
    return outputs, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize(
    "case",
    sorted(CASES)
    + [
        pytest.param(case, marks=pytest.mark.xfail(strict=True, reason="runs outside the graph"))
        for case in GRAPH_BREAKS
    ],
)
def test_compiled_full_graph_on_strided_inputs_matches_eager(case):
    make_inputs, fn = {**CASES, **GRAPH_BREAKS}[case]
    fn, inputs = functools.partial(fn, "triton"), make_inputs()
    checked = []
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=_stride_checking_backend(checked), fullgraph=True)
    with acc.use_accelerators(fallback="error"):
        torch.manual_seed(5)
        outputs, grads = _run(compiled, inputs)
        torch.manual_seed(5)
        expected_outputs, expected_grads = _run(fn, inputs)
    assert any(name.endswith("_forward.default") for name in checked), checked
    if expected_grads:
        assert any(name.endswith("_backward.default") for name in checked), checked
    for i, (out, expected) in enumerate(zip(outputs + grads, expected_outputs + expected_grads)):
        torch.testing.assert_close(out, expected, msg=lambda m, i=i: f"{case} result {i}: {m}")


def test_fused_qkv_attention_under_inductor():
    """inductor checks every custom op's real strides against its fake ones: the fused QKV case of the report."""
    inputs = (_randn(B, L, 3 * H * D), torch.tensor([9, 4]))
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(functools.partial(_attention, "triton"), backend="inductor", fullgraph=True)
        outputs, grads = _run(compiled, inputs)
    expected_outputs, expected_grads = _run(functools.partial(_attention, "triton"), inputs)
    for out, expected in zip(outputs + grads, expected_outputs + expected_grads):
        torch.testing.assert_close(out, expected)
