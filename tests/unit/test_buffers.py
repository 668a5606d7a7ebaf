"""Output allocation (accelerators/buffers.py): contiguous outputs, and poisoning that reaches every caller."""

import re
from pathlib import Path

import torch

import runtime.accelerators as acc
from runtime.accelerators import buffers


def test_empty_like_is_contiguous_and_takes_a_dtype():
    x = torch.randn(4, 6).t()
    out = buffers.empty_like(x, dtype=torch.float16)
    assert out.shape == x.shape and out.dtype == torch.float16 and out.is_contiguous()


def test_poison_outputs_fills_and_restores():
    x = torch.randn(3, 5)
    with buffers.poison_outputs():
        with buffers.poison_outputs():
            assert buffers.empty_like(x).isnan().all()
        assert buffers.empty((2,), dtype=torch.int32, device=x.device).eq(torch.iinfo(torch.int32).min).all()
        assert buffers.empty_like(x, dtype=torch.float64).isnan().all()
    assert buffers.empty_like is not buffers._poisoned_empty_like and not buffers._poison


def test_no_module_imports_the_rebound_name():
    """poison_outputs() rebinds buffers.empty_like: a module that imported the name would allocate unpoisoned."""
    sources = Path(acc.__file__).parent.rglob("*.py")
    offenders = [str(p) for p in sources if re.search(r"from\s+\S*buffers\s+import[^\n]*\bempty_like\b", p.read_text())]
    assert offenders == []
