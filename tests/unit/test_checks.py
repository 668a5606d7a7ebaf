"""The shared argument checks (checks.py)."""

import re

import numpy as np
import pytest
import torch

import runtime.accelerators as acc
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


def _sparse_argument_calls(sparse):
    """(argument name, a call of a public op with that one argument sparse)."""
    x, rows, w = torch.randn(4, 8), torch.randn(3, 8), torch.randn(8)
    q4, q3 = torch.randn(1, 2, 3, 4), torch.randn(5, 2, 4)
    idx, cu = torch.randint(0, 10, (3, 2)), torch.tensor([0, 2, 5])
    table = torch.randn(10, 4)
    return [
        ("x", lambda: acc.rms_norm(sparse(x))),
        ("weight", lambda: acc.rms_norm(x, sparse(w))),
        ("bias", lambda: acc.layer_norm(x, w, sparse(w))),
        ("x", lambda: acc.l2norm(sparse(x))),
        ("residual", lambda: acc.add_rms_norm(x, sparse(x))),
        ("gate", lambda: acc.swiglu(sparse(x), x)),
        ("x", lambda: acc.dropout_add(sparse(x), x)),
        ("x", lambda: acc.gelu(sparse(x))),
        ("targets", lambda: acc.binary_cross_entropy_with_logits(x, sparse(x.sigmoid()))),
        ("weight", lambda: acc.linear(x, sparse(rows))),
        ("scores", lambda: acc.top_k(sparse(x), 2)),
        ("temperature", lambda: acc.sample(x, temperature=sparse(torch.ones(4)))),
        ("indices", lambda: acc.embedding_bag_mean(table, sparse(idx))),
        ("values", lambda: acc.embedding_bag_collection([table], sparse(idx[:, 0]), cu[:2])),
        ("q", lambda: acc.flash_attention(sparse(q4), q4, q4)),
        ("key_lengths", lambda: acc.flash_attention(q4, q4, q4, key_lengths=sparse(torch.tensor([2])))),
        ("cu_seqlens_q", lambda: acc.flash_attention(q3, q3, q3, cu_seqlens_q=sparse(cu.int()), cu_seqlens_k=cu.int())),
        ("cu_seqlens", lambda: acc.silu_attention(q3, q3, q3, sparse(cu), max_seqlen=3)),
        ("num_targets", lambda: acc.silu_attention(q3, q3, q3, cu, max_seqlen=3, num_targets=sparse(cu[1:]))),
        (
            "x",
            lambda: acc.mhc_post(
                sparse(torch.randn(2, 4, 8)), torch.randn(2, 8), torch.randn(2, 4), torch.randn(2, 4, 4)
            ),
        ),
        (
            "cu_seqlens",
            lambda: acc.chunk_gated_delta_rule(
                *(torch.randn(1, 5, 2, 4) for _ in range(3)),
                -torch.rand(1, 5, 2),
                torch.rand(1, 5, 2),
                cu_seqlens=sparse(cu),
            ),
        ),
    ]


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_sparse_argument_is_refused_by_name(layout, backend):
    """A sparse tensor failed deep inside torch (reshape, is_contiguous, a missing sparse kernel), or was read as
    dense by some ops; every tensor argument is checked for a strided layout where the op checks it."""

    def sparse(t):
        return t.to_sparse() if layout == "sparse_coo" or t.dim() < 2 else t.to_sparse_csr()  # CSR: 2-D and up

    for name, call in _sparse_argument_calls(sparse):
        with pytest.raises(TypeError, match=rf"^{name}: expected a strided \(dense\) tensor, got layout "):
            with acc.use_accelerators(default=backend):
                call()


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _meta_reading_calls():
    """(argument name, a call on meta tensors of a public op that reads that argument's values on the host)."""
    x, q4, q3 = _meta(4, 8), _meta(1, 2, 3, 4), _meta(5, 2, 16)
    cu, table = _meta(3, dtype=torch.int64), _meta(10, 4)
    gdr = [_meta(1, 5, 2, 16) for _ in range(3)] + [_meta(1, 5, 2), _meta(1, 5, 2)]
    return [
        ("targets", lambda: acc.binary_cross_entropy_with_logits(x, x, check_targets=True)),
        ("top_k", lambda: acc.sample(x, top_k=_meta(4, dtype=torch.int64))),
        ("temperature", lambda: acc.sample(x, temperature=_meta(4))),
        ("indices", lambda: acc.embedding_bag_mean(table, _meta(3, 2, dtype=torch.int64))),
        ("offsets", lambda: acc.embedding_bag_collection([table], _meta(5, dtype=torch.int64), cu)),
        ("key_lengths", lambda: acc.flash_attention(q4, q4, q4, key_lengths=_meta(1, dtype=torch.int64))),
        ("cu_seqlens_q", lambda: acc.flash_attention(q3, q3, q3, cu_seqlens_q=cu.int(), cu_seqlens_k=cu.int())),
        ("cu_seqlens", lambda: acc.silu_attention(q3, q3, q3, cu, max_seqlen=3)),
        ("cu_seqlens", lambda: acc.chunk_gated_delta_rule(*gdr, cu_seqlens=cu)),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_meta_argument_whose_values_are_read_is_refused_by_name(backend):
    """The host reads of argument values failed on meta tensors with torch's 'Cannot copy out of meta tensor' or
    'item() cannot be called on meta tensors', naming nothing."""
    for name, call in _meta_reading_calls():
        with pytest.raises(
            ValueError, match=rf"^{name}: a meta tensor has no values, and the op reads them on the host"
        ):
            with acc.use_accelerators(default=backend):
                call()


def test_ops_that_read_no_value_infer_shapes_on_meta():
    """top_k and sample need no value for their shapes: the reference's nonzero (a size read from the values) failed."""
    values, indices = acc.top_k(_meta(3, 7), 2)
    assert values.shape == indices.shape == (3, 2) and indices.dtype == torch.int64 and values.is_meta
    ids = acc.sample(_meta(3, 7), top_k=2, top_p=0.5)
    assert ids.shape == (3,) and ids.dtype == torch.int64 and ids.is_meta
    table = _meta(10, 4)
    bags = acc.embedding_bag_mean(table, _meta(3, 2, dtype=torch.int64), check_indices=False)
    assert bags.shape == (3, 4) and bags.is_meta
