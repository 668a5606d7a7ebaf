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
    spec = importlib.util.spec_from_file_location(f"unit_{name}", UNIT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the unit module imports its cases from test_compile_ops: importable under that name while it loads, and only then
# (tests/gpu has a test_compile_ops of its own)
_gpu_module = sys.modules.get("test_compile_ops")
sys.modules["test_compile_ops"] = _load("test_compile_ops")
try:
    cases = _load("test_double_backward")
finally:
    if _gpu_module is None:
        del sys.modules["test_compile_ops"]
    else:
        sys.modules["test_compile_ops"] = _gpu_module


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("case", sorted(cases.DIFFERENTIABLE))
def test_double_backward_names_the_op(case, backend):
    make_inputs, fn = cases.DIFFERENTIABLE[case]
    inputs = tuple(
        x.detach().to("cuda").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in make_inputs()
    )
    fn = functools.partial(fn, backend)
    with acc.use_accelerators(fallback="error"):
        try:
            fn(*inputs)
        except acc.BackendUnavailableError as error:  # the backend cannot run this op or these inputs here
            pytest.skip(str(error))
        with pytest.raises(RuntimeError, match="double backward"):
            cases._second_backward(fn, inputs)
