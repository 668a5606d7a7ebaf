"""Scalar and flag arguments of the public ops: bad values are errors naming the argument, on every backend."""

import math

import pytest
import torch

from runtime.accelerators import mhc_pre, rms_norm


def _mhc_inputs(n=2, C=8):
    m = n * n + 2 * n
    return torch.randn(3, n, C), torch.randn(n * C, m) / 4, torch.tensor([0.8, 1.1, 1.3]), torch.randn(m) / 4


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
