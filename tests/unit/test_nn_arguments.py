"""Errors of the nn modules name the argument the user gave and what was expected."""

import pytest
import torch

from runtime.accelerators import use_accelerators
from runtime.nn import AddLayerNorm, AddRMSNorm, LayerNorm, RMSNorm, SwiGLUFeedForward

NORMS = [RMSNorm, LayerNorm, AddRMSNorm, AddLayerNorm]


def _normed(norm, x):
    """The normalised output; the Add norms also take a residual and return the new one beside it."""
    return norm(x, torch.randn_like(x))[0] if isinstance(norm, (AddRMSNorm, AddLayerNorm)) else norm(x)


@pytest.mark.parametrize("affine", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("cls", NORMS, ids=lambda cls: cls.__name__)
def test_a_norm_names_x_and_its_width_when_the_width_is_wrong(cls, affine):
    # with a weight the op's check blamed the weight: "weight: expected shape (48,) ..., got (64,)"
    norm = cls(64, elementwise_affine=affine)
    width = "the weight's width" if affine else rf"{cls.__name__}\(dim=64\)"
    with use_accelerators(default="torch"):
        assert _normed(norm, torch.randn(2, 3, 64)).shape == (2, 3, 64)
        with pytest.raises(ValueError, match=rf"^x: expected the last dimension of size 64 \({width}\), got 48 "):
            _normed(norm, torch.randn(2, 3, 48))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"hidden": 32.0}, TypeError, "hidden: expected a positive int, got float 32.0"),
        ({"hidden": 0}, ValueError, "hidden: expected a positive int, got 0"),
        ({"d_model": 16.0}, TypeError, "d_model: expected a positive int, got float 16.0"),
        ({"d_out": 2.5}, TypeError, "d_out: expected None or a positive int, got float 2.5"),
    ],
    ids=["float-hidden", "zero-hidden", "float-d-model", "float-d-out"],
)
def test_swiglu_feed_forward_names_a_size_that_is_not_a_positive_int(kwargs, error, message):
    # before, the error named the inner Linear's in_features / out_features, and a zero hidden was accepted
    sizes = {"d_model": 16, "hidden": 32, **kwargs}
    with pytest.raises(error, match=f"^{message}$"):
        SwiGLUFeedForward(**sizes)


def test_swiglu_feed_forward_takes_numpy_sizes():
    np = pytest.importorskip("numpy")
    ffn = SwiGLUFeedForward(np.int64(16), np.int32(32), d_out=np.int64(1))
    assert ffn.gate_up.weight.shape == (64, 16) and ffn.down.weight.shape == (1, 32)
