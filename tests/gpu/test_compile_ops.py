"""Every public op compiled by inductor with fullgraph=True on strided inputs on CUDA, on the triton and tilelang
backends (where they run): inductor checks each custom op's real strides against its fake ones; outputs and gradients
equal eager ones. The cases are tests/op_cases.py's, as on the CPU tier."""

import functools

import pytest
import torch

import runtime.accelerators as acc
from op_cases import CASES, run_case
from runtime.accelerators.testing import assert_close


def _to_cuda(inputs):
    return tuple(
        x.detach().to("cuda").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs
    )


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_inductor_full_graph_on_strided_inputs_matches_eager(case, backend):
    make_inputs, fn = CASES[case]
    inputs = _to_cuda(make_inputs())
    fn = functools.partial(fn, backend)
    with acc.use_accelerators(fallback="error"):
        torch.manual_seed(5)
        try:
            expected_outputs, expected_grads = run_case(fn, inputs)
        except acc.BackendUnavailableError as error:  # the backend cannot run this op or these inputs here
            pytest.skip(str(error))
        torch._dynamo.reset()
        # fallback_random: dropout draws its seed from torch's generator in the compiled graph as in eager calls
        with torch._inductor.config.patch(force_disable_caches=True, fallback_random=True):
            compiled = torch.compile(fn, backend="inductor", fullgraph=True)
            torch.manual_seed(5)
            outputs, grads = run_case(compiled, inputs)
    names = [f"output {i}" for i in range(len(outputs))] + [f"gradient {i}" for i in range(len(grads))]
    for name, out, expected in zip(names, outputs + grads, expected_outputs + expected_grads):
        assert_close(f"{case} {name}", out, expected, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_norms_dropout_and_mhc_on_the_torch_backend(dtype):
    """layer_norm -> l2norm -> dropout_add (eval) -> mhc_pre / mhc_post on the torch backend in one graph: on torch
    2.11, Dynamo could not trace the Tensor.unflatten the mhc reference called."""
    n, C = 4, 64
    m = n * n + 2 * n

    def chain(x, residual, phi, alpha, bias):
        h = acc.l2norm(acc.layer_norm(x, backend="torch"), backend="torch")
        h = acc.dropout_add(h, residual, 0.1, training=False, backend="torch")
        h_in, h_post, h_res = acc.mhc_pre(h, phi, alpha, bias, backend="torch")
        return acc.mhc_post(h, h_in * 2, h_post, h_res, backend="torch")

    inputs = [
        torch.randn(8, n, C, device="cuda", dtype=dtype, requires_grad=True),
        torch.randn(8, n, C, device="cuda", dtype=dtype),
        (torch.randn(n * C, m, device="cuda") * (n * C) ** -0.5).requires_grad_(),
        torch.tensor([0.8, 1.1, 1.3], device="cuda", requires_grad=True),
        (0.3 * torch.randn(m, device="cuda")).requires_grad_(),
    ]
    leaves = [x for x in inputs if x.requires_grad]
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        out = torch.compile(chain, backend="inductor", fullgraph=True)(*inputs)
        grads = torch.autograd.grad(out.float().sum(), leaves)
    expected = chain(*inputs)
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close("x_next", out, expected, rtol)
    for i, (grad, ref) in enumerate(zip(grads, torch.autograd.grad(expected.float().sum(), leaves))):
        assert_close(f"gradient {i}", grad, ref, 2 * rtol)
