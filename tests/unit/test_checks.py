"""The shared argument checks (checks.py)."""

import pytest
import torch

from runtime.accelerators import l2norm, layer_norm, rms_norm
from runtime.accelerators.checks import check_tensor


def test_dtype_errors_list_every_accepted_dtype():
    expected = r"x: expected a floating-point tensor \(float64, float32, bfloat16 or float16\), got torch.int64"
    with pytest.raises(TypeError, match=expected):
        check_tensor("x", torch.ones(2, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"\(float64, float32, bfloat16 or float16\), got torch.float8_e4m3fn"):
        check_tensor("x", torch.ones(2).to(torch.float8_e4m3fn))
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        check_tensor("x", torch.ones(2, dtype=dtype))
    for op in (rms_norm, l2norm, layer_norm):
        with pytest.raises(TypeError, match=r"float64, float32, bfloat16 or float16"):
            op(torch.ones(2, 3, dtype=torch.int32))
