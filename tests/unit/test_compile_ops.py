"""Every public op compiled with fullgraph=True on strided (non-contiguous) inputs, on the triton backend under the
interpreter: the compiled graph's custom ops return exactly the strides their fake implementations promised (what
inductor asserts at run time), and outputs and gradients equal eager ones."""

import functools
import inspect

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils._pytree import tree_leaves

import runtime.accelerators as acc
from op_cases import CASES, GRAPH_BREAKS, NOT_OPS, B, D, H, L, fused_qkv_attention, randn_leaf, run_case


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


def test_every_public_op_has_a_case():
    ops = {name for name in acc.__all__ if inspect.isfunction(getattr(acc, name))}
    covered = {op for case in [*CASES, *GRAPH_BREAKS] for op in case.split("-") if op in ops}
    assert ops - NOT_OPS - covered == set(), "add a case to CASES for each public op"


@pytest.mark.parametrize(
    "case",
    sorted(CASES)
    + [
        pytest.param(case, marks=pytest.mark.xfail(strict=True, reason="runs outside the graph"))
        for case in GRAPH_BREAKS
    ],
)
@pytest.mark.slow
def test_compiled_full_graph_on_strided_inputs_matches_eager(case):
    make_inputs, fn = {**CASES, **GRAPH_BREAKS}[case]
    fn, inputs = functools.partial(fn, "triton"), make_inputs()
    checked = []
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=_stride_checking_backend(checked), fullgraph=True)
    with acc.use_accelerators(fallback="error"):
        torch.manual_seed(5)
        outputs, grads = run_case(compiled, inputs)
        torch.manual_seed(5)
        expected_outputs, expected_grads = run_case(fn, inputs)
    assert any(name.endswith("_forward.default") for name in checked), checked
    if expected_grads:
        assert any(name.endswith("_backward.default") for name in checked), checked
    for i, (out, expected) in enumerate(zip(outputs + grads, expected_outputs + expected_grads)):
        torch.testing.assert_close(out, expected, msg=lambda m, i=i: f"{case} result {i}: {m}")


@pytest.mark.slow
def test_fused_qkv_attention_under_inductor():
    """inductor checks every custom op's real strides against its fake ones: the fused QKV case of the report."""
    inputs = (randn_leaf(B, L, 3 * H * D), torch.tensor([9, 4]))
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.compile(functools.partial(fused_qkv_attention, "triton"), backend="inductor", fullgraph=True)
        outputs, grads = run_case(compiled, inputs)
    expected_outputs, expected_grads = run_case(functools.partial(fused_qkv_attention, "triton"), inputs)
    for out, expected in zip(outputs + grads, expected_outputs + expected_grads):
        torch.testing.assert_close(out, expected)
