"""The Triton radix sort of embedding-bag indices (radix_sort.py) under the interpreter: keys and permutation equal to
torch.sort(stable=True)'s, and the Triton backward with the radix sort against float64 and bit for bit against its
torch.sort fallback. Small digits and tiles make several passes and tiles cheap here."""

import dataclasses

import pytest
import torch

from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.embedding_bag_mean import radix_sort
from runtime.accelerators.embedding_bag_mean import triton as triton_kernels
from runtime.accelerators.embedding_bag_mean.radix_sort import RadixLaunch
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance
from test_embedding_bag_mean import check_triton, hot_indices, mean_bags64, run_triton, table


def mapped_sort(flat: torch.Tensor, num_embeddings: int):
    """torch.sort(stable=True) of the keys the radix sort sorts: out-of-range ones as num_embeddings."""
    keys = torch.where((flat >= 0) & (flat < num_embeddings), flat, num_embeddings).to(torch.int32)
    return torch.sort(keys, stable=True)


def _random(n, rows, dtype=torch.int64):
    return torch.randint(0, rows, (n,), dtype=dtype)


def _out_of_range(n, rows, past_int32=True):
    """Indices in [-2, rows + 3), every 7th outside [0, rows): +-2**40 (past_int32), rows and -1."""
    flat = torch.randint(-2, rows + 3, (n,))
    bad = torch.tensor([-(2**40), 2**40, rows, -1] if past_int32 else [rows, -1])
    flat[::7] = bad[torch.arange(0, n, 7) % bad.numel()]
    return flat


SORTS = {
    # id: (num_embeddings, indices, launch)
    "empty": (50, lambda: _random(0, 50), RadixLaunch(tile=16)),
    "one-key": (50, lambda: torch.tensor([17]), RadixLaunch(tile=16)),
    "hot-row-3-tiles": (50, lambda: torch.full((40,), 7), RadixLaunch(digit_bits=3, tile=16)),
    "50-rows-1-pass-int32": (50, lambda: _random(100, 50, torch.int32), RadixLaunch(tile=16)),
    "1000-rows-2-passes": (
        1000,
        lambda: hot_indices(150, 1000, hot=999, copies=40),
        RadixLaunch(digit_bits=5, tile=32),
    ),
    "5000-rows-5-passes-int32": (5000, lambda: _random(90, 5000, torch.int32), RadixLaunch(digit_bits=3, tile=16)),
    "out-of-range-sentinel": (37, lambda: _out_of_range(80, 37), RadixLaunch(digit_bits=3, tile=16)),
}


@pytest.mark.parametrize("case", list(SORTS))
def test_radix_sort_equals_stable_torch_sort(case):
    num_embeddings, make, launch = SORTS[case]
    flat = make()
    # filled beside the sort, a share per pass, by fill programs of 32 elements (several a pass); NaN guard bands
    # around it must stay
    launch = dataclasses.replace(launch, zero_block=16, zero_steps=2)
    buffer = torch.full((3003 + 64,), float("nan"), dtype=torch.bfloat16)
    zero = buffer[32:-32].view(3, 1001)
    with poison_outputs():  # an unwritten key or position fails
        keys, perm = radix_sort.sort(flat, num_embeddings, launch, zero=zero)
    assert torch.equal(zero, torch.zeros_like(zero))
    assert buffer[:32].isnan().all() and buffer[-32:].isnan().all(), "the fill wrote outside its tensor"
    expected = mapped_sort(flat, num_embeddings)
    assert keys.dtype == perm.dtype == torch.int32
    assert torch.equal(keys, expected.values), f"keys {keys.tolist()} != {expected.values.tolist()}"
    assert torch.equal(perm.long(), expected.indices), f"perm {perm.tolist()} != {expected.indices.tolist()}"


def test_plan_and_fits():
    assert radix_sort.plan(1_000_000, RadixLaunch()) == (10, 2)  # 20 bits
    assert radix_sort.plan(1000, RadixLaunch()) == (10, 1)
    assert radix_sort.plan(1024, RadixLaunch()) == (6, 2)  # the sentinel 1024 needs an 11th bit
    assert radix_sort.plan(5000, RadixLaunch(digit_bits=3)) == (3, 5)
    assert radix_sort.fits(65536, 1_000_000) and not radix_sort.fits(65537, 1_000_000)  # 64 tiles x 1024 buckets
    assert radix_sort.fits(1 << 19, 1000, RadixLaunch(digit_bits=6)) and not radix_sort.fits(0, 1000)


def test_radix_sort_errors():
    with pytest.raises(ValueError, match="RadixLaunch.tile: expected a power of two >= 16, got 48"):
        RadixLaunch(tile=48)
    with pytest.raises(ValueError, match="RadixLaunch.digit_bits: expected 1 to 16, got 0"):
        RadixLaunch(digit_bits=0)
    with pytest.raises(TypeError, match="radix sort: expected 1-D int32 or int64 indices, got 2-D torch.int64"):
        radix_sort.sort(torch.zeros(2, 2, dtype=torch.int64), 5)
    with pytest.raises(TypeError, match="got 1-D torch.float32"):
        radix_sort.sort(torch.zeros(3), 5)
    with pytest.raises(
        ValueError, match="radix sort: zero must be a contiguous tensor on cpu, got a non-contiguous one on cpu"
    ):
        radix_sort.sort(torch.zeros(3, dtype=torch.int64), 5, zero=torch.zeros(4, 4).t())


# --------------------------------------------------------------------------- the backward's sorts

NEVER_FITS = RadixLaunch(max_counts=0)  # radix_sort.fits is False for any keys: the backward sorts with torch.sort
# the radix sort with 3-bit digits and 16-key tiles: two passes over 50 rows, five over 5000
SMALL_DIGITS = RadixLaunch(digit_bits=3, tile=16)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_radix_backward_2d_padding_and_a_hot_row(sparse):
    indices = hot_indices(20 * 5, 50, hot=7, copies=70).reshape(20, 5)  # a row across chunks and tiles
    indices[3] = 11  # an all-padding bag
    gradient = triton_kernels.GradientLaunch(radix=SMALL_DIGITS)
    check_triton(table(50, 37), indices, padding_idx=11, sparse=sparse, gradient=gradient)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_radix_backward_offsets_int32_5_passes(sparse):
    indices = hot_indices(75, 5000, hot=4321, copies=40, dtype=torch.int32)
    offsets = torch.tensor([0, 3, 3, 40, 41, 41, 75], dtype=torch.int32)
    gradient = triton_kernels.GradientLaunch(radix=SMALL_DIGITS)
    check_triton(table(5000, 20), indices, offsets, -1, include_last_offset=True, sparse=sparse, gradient=gradient)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.slow
def test_radix_and_torch_sorts_give_the_same_gradient_bits(sparse):
    """Either sort's keys give the segment edges (no `first`), the combine kernel its segment's first chunk by a
    backward search (block_j = 2: several steps for a row over 7 chunks): the same sums in the same order."""
    weight, indices = table(50, 24), hot_indices(60 * 5, 50, hot=30, copies=220).reshape(60, 5)
    grads = {}
    for sort, launch in (("torch", NEVER_FITS), ("radix", SMALL_DIGITS)):
        segments = triton_kernels.sort_for_gradient(indices.reshape(-1), 50, radix=launch)
        assert segments.first is None  # no searchsorted launch on either path
        assert segments.perm.dtype == (torch.int32 if sort == "radix" else torch.int64)  # which sort ran
        gradient = triton_kernels.GradientLaunch(radix=launch, block_j=2)
        torch.manual_seed(0)  # the same incoming gradient for both sorts
        _, grads[sort], _ = run_triton(weight, indices, padding_idx=3, sparse=sparse, gradient=gradient)
    if sparse:
        assert torch.equal(grads["torch"]._indices(), grads["radix"]._indices())
        grads = {k: g._values() for k, g in grads.items()}
    assert torch.equal(grads["torch"], grads["radix"])


@pytest.mark.parametrize("sort", ["torch", "radix"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_unchecked_out_of_range_indices_are_left_out(sort, sparse):
    """check_indices=False: out-of-range rows count as padding (the radix sort's sentinel sorts them last).

    Not past int32 with torch.sort (where the radix sort does not fit): sort_keys casts int64 keys to int32, so that 2**40 becomes row 0 (an
    unspecified value, as the API allows unchecked, in bounds); the radix sort reads the int64 keys themselves."""
    gradient = triton_kernels.GradientLaunch(radix=NEVER_FITS if sort == "torch" else SMALL_DIGITS)
    flat = _out_of_range(60, 37, past_int32=sort == "radix")
    offsets = torch.arange(0, 60, 4)
    weight = table(37, 16)
    out, grad, grad_out = run_triton(
        weight, flat, offsets, padding_idx=5, sparse=sparse, check_indices=False, gradient=gradient
    )
    weight64 = weight.detach().double().requires_grad_()
    as_padding = torch.where((flat >= 0) & (flat < 37), flat, 5)
    out64 = mean_bags64(weight64, as_padding, offsets, padding_idx=5)
    (grad64,) = torch.autograd.grad(out64, weight64, grad_out.double())
    if sparse:
        assert grad.is_coalesced() and set(grad._indices()[0].tolist()) == set(as_padding[as_padding != 5].tolist())
        grad = grad.to_dense()
    assert_close("out", out, out64, RTOL[torch.float32])
    assert_close("grad weight", grad, grad64, gradient_tolerance(torch.float32))


def test_radix_sort_falls_back_to_torch_sort_past_max_counts():
    launch = RadixLaunch(digit_bits=3, tile=16, max_counts=16)  # 2 tiles of 8 buckets
    # the permutation's dtype tells the sorts apart: int32 from the radix sort, int64 from torch.sort
    assert triton_kernels.sort_for_gradient(_random(32, 50), 50, radix=launch).perm.dtype == torch.int32
    assert triton_kernels.sort_for_gradient(_random(33, 50), 50, radix=launch).perm.dtype == torch.int64  # 3 tiles
