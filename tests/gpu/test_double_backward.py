"""Second derivatives through the kernel backends on CUDA: differentiating a kernel backward's gradients again (after
create_graph=True) raises an error naming the op, for every op and kernel backend (eager calls, including the
C++ backward nodes of the Triton norms, which refuse create_graph=True at the first backward). The cases are
tests/unit/test_double_backward.py's."""

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import runtime.accelerators as acc

UNIT = Path(__file__).parents[1] / "unit"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, UNIT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_load("test_compile_ops")  # test_double_backward imports its cases
cases = _load("test_double_backward")


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("case", sorted(cases.DIFFERENTIABLE))
def test_double_backward_names_the_op(case, backend):
    make_inputs, fn = cases.DIFFERENTIABLE[case]
    inputs = tuple(
        x.detach().to("cuda").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in make_inputs()
    )
    fn = functools.partial(fn, backend)
    with acc.use_accelerators(fallback="error"):
        try:
            fn(*inputs)
        except acc.BackendUnavailableError as error:  # the backend cannot run this op or these inputs here
            pytest.skip(str(error))
        with pytest.raises(RuntimeError, match="double backward"):
            cases._second_backward(fn, inputs)
