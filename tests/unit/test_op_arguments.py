"""Scalar and flag arguments of the public ops: bad values are errors naming the argument, on every backend."""

import math

import pytest
import torch

from runtime.accelerators import (
    binary_cross_entropy_with_logits,
    dropout_add,
    embedding_bag_mean,
    mhc_pre,
    rms_norm,
)
from runtime.accelerators.checks import check_bool

BACKENDS = ["torch", "triton", "tilelang"]
NOT_BOOLS = ["yes", 1, 0, None, 1.0, torch.tensor(True)]


def _mhc_inputs(n=2, C=8):
    m = n * n + 2 * n
    return torch.randn(3, n, C), torch.randn(n * C, m) / 4, torch.tensor([0.8, 1.1, 1.3]), torch.randn(m) / 4


FLAG_CALLS = {
    "check_targets": lambda value, backend: binary_cross_entropy_with_logits(
        torch.randn(4), torch.rand(4), check_targets=value, backend=backend
    ),
    "training": lambda value, backend: dropout_add(torch.randn(4), torch.randn(4), 0.5, value, backend=backend),
    "include_last_offset": lambda value, backend: embedding_bag_mean(
        torch.randn(5, 4), torch.tensor([0, 1, 2]), torch.tensor([0, 2]), include_last_offset=value, backend=backend
    ),
    "sparse": lambda value, backend: embedding_bag_mean(
        torch.randn(5, 4), torch.tensor([[0, 1]]), sparse=value, backend=backend
    ),
    "check_indices": lambda value, backend: embedding_bag_mean(
        torch.randn(5, 4), torch.tensor([[0, 1]]), check_indices=value, backend=backend
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("flag", list(FLAG_CALLS))
def test_a_flag_that_is_not_a_bool_is_an_error(flag, backend):
    for value in NOT_BOOLS:
        with pytest.raises(TypeError, match=rf"^{flag}: expected a bool \(True or False\), got {type(value).__name__}"):
            FLAG_CALLS[flag](value, backend)


def test_check_bool_takes_true_false_and_symbolic_bools():
    check_bool("flag", True)
    check_bool("flag", False)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    size = env.create_symintnode(env.create_symbol(5, torch._dynamo.source.ConstantSource("n")), hint=5)
    check_bool("flag", size > 2)  # a SymBool, as a flag may be while compiling
    with pytest.raises(TypeError, match="flag: expected a bool"):
        check_bool("flag", size)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "eps, error, match",
    [
        (-1.0, ValueError, "eps: expected a finite float >= 0, got -1.0"),
        (math.nan, ValueError, "eps: expected a finite float >= 0, got nan"),
        (math.inf, ValueError, "eps: expected a finite float >= 0, got inf"),
        ("x", TypeError, "eps: expected a float >= 0, got str"),
        (True, TypeError, "eps: expected a float >= 0, got bool"),
    ],
    ids=["negative", "nan", "inf", "str", "bool"],
)
def test_mhc_pre_checks_eps_as_the_norms_do(eps, error, match, backend):
    x, phi, alpha, bias = _mhc_inputs()
    with pytest.raises(error, match=match):
        mhc_pre(x, phi, alpha, bias, eps, backend=backend)
    with pytest.raises(error, match=match):
        rms_norm(x, eps=eps, backend=backend)


def test_mhc_pre_takes_an_integer_or_zero_eps():
    x, phi, alpha, bias = _mhc_inputs()
    for eps in (0, 0.0, 1e-6):
        outs = mhc_pre(x, phi, alpha, bias, eps, backend="torch")
        assert all(torch.isfinite(o).all() for o in outs)
