"""autocast_inputs: the casts the ops make under autocast, without a no-op `.to` for a tensor already in its dtype."""

import torch

from runtime.accelerators.autocast import autocast_enabled, autocast_inputs, autocast_to_float32


def test_outside_autocast_the_tensors_are_returned_as_they_are():
    x, w = torch.randn(2, 3), torch.randn(3, 3, dtype=torch.float64)
    out = autocast_inputs("cpu", x, w, None)
    assert out[0] is x and out[1] is w and out[2] is None


def test_under_autocast_only_tensors_of_another_dtype_are_cast():
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    w = torch.randn(3, 3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same, cast, none = autocast_inputs("cpu", x, w, None)
    assert same is x and none is None
    assert cast.dtype == torch.bfloat16 and cast.grad_fn is not None  # differentiable, as w.to(bfloat16)
    assert torch.equal(cast, w.to(torch.bfloat16))


def test_meta_tensors_pass_through_as_autocast_has_no_meta_device():
    """torch.is_autocast_enabled("meta") raises: the helpers treat a device autocast lacks as not autocasting."""
    x = torch.empty(4, device="meta", dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_inputs("meta", x)[0] is x
        assert autocast_to_float32("meta", x)[0] is x
        assert not autocast_enabled("meta")
