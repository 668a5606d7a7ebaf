"""Second derivatives through the kernel backends on CUDA: differentiating a kernel backward's gradients again (after
create_graph=True) raises an error naming the op, for every op and kernel backend (eager calls, including the
C++ backward nodes of the Triton norms, which refuse create_graph=True at the first backward). The cases are
tests/op_cases.py's."""

import functools

import pytest
import torch

import runtime.accelerators as acc
from op_cases import DIFFERENTIABLE, second_backward


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("case", sorted(DIFFERENTIABLE))
def test_double_backward_names_the_op(case, backend):
    make_inputs, fn = DIFFERENTIABLE[case]
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
            second_backward(fn, inputs)
