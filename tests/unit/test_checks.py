"""The shared argument checks (checks.py)."""

import re

import numpy as np
import pytest
import torch

from runtime.accelerators import embedding_bag_collection, embedding_bag_mean, l2norm, layer_norm, rms_norm
from runtime.accelerators.checks import as_padding_idx, check_tensor
from runtime.nn import EmbeddingBagCollection, EmbeddingBagMean


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


@pytest.mark.parametrize(
    "padding_idx, error, got",
    [(5, ValueError, "int 5"), (-6, ValueError, "int -6"), (True, TypeError, "bool True"), ("x", TypeError, "str 'x'")],
)
def test_padding_idx_has_one_message_in_the_op_the_collection_and_the_modules(padding_idx, error, got):
    """The same check everywhere; the collection module read int("x") before checking (an unclear 'invalid literal')."""
    expected = rf"padding_idx: expected None or an int in \[-5, 5\) \(num_embeddings{{}}\), got {re.escape(got)}$"
    weight, indices = torch.randn(5, 3), torch.zeros(2, 1, dtype=torch.int64)
    values, offsets = torch.zeros(2, dtype=torch.int64), torch.tensor([0, 1, 2])
    calls = [
        ("", lambda: embedding_bag_mean(weight, indices, padding_idx=padding_idx)),
        ("", lambda: EmbeddingBagMean(5, 3, padding_idx=padding_idx)),
        (" of table 0", lambda: embedding_bag_collection([weight], values, offsets, padding_idx=padding_idx)),
        (" of table 'user'", lambda: EmbeddingBagCollection({"user": (5, 3)}, padding_idx=padding_idx)),
    ]
    for table, call in calls:
        with pytest.raises(error, match=expected.format(re.escape(table))):
            call()


def test_padding_idx_counts_from_the_end_and_takes_numpy_ints():
    assert as_padding_idx(None, 5) is None
    assert as_padding_idx(-5, 5) == 0 and as_padding_idx(np.int64(4), 5) == 4
    assert type(as_padding_idx(np.int32(-1), 5)) is int
