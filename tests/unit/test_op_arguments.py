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


def test_numpy_scalars_are_taken_as_the_python_numbers_they_equal():
    # numpy ints and floats (what a config read with numpy or a sweep over np.linspace gives) are numbers.Integral /
    # numbers.Real: every scalar argument takes them as the Python number, with the same result
    np = pytest.importorskip("numpy")
    from runtime.accelerators import embedding_bag_collection, flash_attention, silu_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 16) for _ in range(3))
    for dropout_p in (np.float32(0.0), np.float64(0.0)):
        torch.testing.assert_close(
            flash_attention(q, k, v, dropout_p=dropout_p, backend="torch"), flash_attention(q, k, v, backend="torch")
        )
    packed = [x.transpose(1, 2).reshape(6, 2, 16) for x in (q, k, v)]
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    varlen = flash_attention(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    numpy_varlen = flash_attention(
        *packed,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=np.int64(4),
        max_seqlen_k=np.int32(4),
        dropout_p=np.float32(0.0),
    )
    torch.testing.assert_close(numpy_varlen, varlen)
    hstu = silu_attention(*packed, cu, max_seqlen=4, alpha=0.5, backend="torch")
    numpy_hstu = silu_attention(
        *packed, cu, max_seqlen=np.int64(4), alpha=np.float32(0.5), dropout_p=np.float64(0.0), backend="torch"
    )
    torch.testing.assert_close(numpy_hstu, hstu)

    x, phi, alpha, bias = _mhc_inputs()
    for a, b in zip(
        mhc_pre(x, phi, alpha, bias, sinkhorn_iters=np.int64(3)), mhc_pre(x, phi, alpha, bias, sinkhorn_iters=3)
    ):
        torch.testing.assert_close(a, b)

    weight, indices = torch.randn(5, 4), torch.tensor([[0, 4], [4, 4]])
    torch.testing.assert_close(
        embedding_bag_mean(weight, indices, padding_idx=np.int64(-1)),
        embedding_bag_mean(weight, indices, padding_idx=4),
    )
    values, offsets = torch.tensor([0, 4, 1]), torch.tensor([0, 2, 3])
    torch.testing.assert_close(
        embedding_bag_collection([weight], values, offsets, padding_idx=[np.int64(4)]),
        embedding_bag_collection([weight], values, offsets, padding_idx=[4]),
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda: __import__("runtime.accelerators").accelerators.flash_attention(
            *(torch.randn(1, 1, 2, 16) for _ in range(3)), dropout_p=True
        ),
        lambda: dropout_add(torch.randn(4), torch.randn(4), True),
    ],
    ids=["flash_attention", "dropout_add"],
)
def test_a_bool_dropout_probability_is_an_error(call):
    with pytest.raises(TypeError, match="p: expected a dropout probability"):
        call()


def test_a_numpy_bool_flag_is_named_as_numpy_in_the_error():
    np = pytest.importorskip("numpy")
    # numpy's bool type is named "bool": the message read "expected a bool (True or False), got bool np.True_"
    with pytest.raises(
        TypeError, match=r"training: expected a bool \(True or False\), got numpy\.bool.* \(pass bool\(value\)\)"
    ):
        dropout_add(torch.randn(4), torch.randn(4), 0.5, np.bool_(True))
