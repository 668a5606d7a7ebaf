"""Every public op compiled by inductor with fullgraph=True on strided inputs on CUDA, on the triton and tilelang
backends (where they run): inductor checks each custom op's real strides against its fake ones; outputs and gradients
equal eager ones. The cases are tests/unit/test_compile_ops.py's."""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

import runtime.accelerators as acc
from runtime.accelerators.testing import assert_close

_spec = importlib.util.spec_from_file_location("unit_compile_ops", Path(__file__).parents[1] / "unit" / "test_compile_ops.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def _to_cuda(inputs):
    return tuple(
        x.detach().to("cuda").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs
    )


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_inductor_full_graph_on_strided_inputs_matches_eager(case, backend):
    make_inputs, fn = cases.CASES[case]
    inputs = _to_cuda(make_inputs())
    fn = functools.partial(fn, backend)
    with acc.use_accelerators(fallback="error"):
        torch.manual_seed(5)
        try:
            expected_outputs, expected_grads = cases._run(fn, inputs)
        except acc.BackendUnavailableError as error:  # the backend cannot run this op or these inputs here
            pytest.skip(str(error))
        torch._dynamo.reset()
        # fallback_random: dropout draws its seed from torch's generator in the compiled graph as in eager calls
        with torch._inductor.config.patch(force_disable_caches=True, fallback_random=True):
            compiled = torch.compile(fn, backend="inductor", fullgraph=True)
            torch.manual_seed(5)
            outputs, grads = cases._run(compiled, inputs)
    names = [f"output {i}" for i in range(len(outputs))] + [f"gradient {i}" for i in range(len(grads))]
    for name, out, expected in zip(names, outputs + grads, expected_outputs + expected_grads):
        assert_close(f"{case} {name}", out, expected, 1e-5)
