"""top_k and sample on CUDA, for the triton and the tilelang kernels: one program per row and split rows (their
candidates merged in rounds) against the exact reference at V in {1000, 50257, 1M, 16M}, bf16 ties included, the
select with and without its threshold filter; sample's ids equal to the torch backend's from the same generator state,
its frequencies against the restricted distribution, NaN rows, CUDA-graph capture. Kernel outputs are poisoned with
NaN by conftest."""

import importlib
import math

import pytest
import torch

from conftest import capture_graph
from runtime.accelerators import sample, top_k, use_accelerators
from runtime.accelerators.sampling.reference import top_k_reference

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16

# (rows, V, k, dtype): a few rows of a long vocabulary take the split path, many rows one program each
CASES = {
    "1x1000-k5-f32": (1, 1000, 5, f32),
    "2x1000-k1000-f32": (2, 1000, 1000, f32),  # the whole row
    "7x50257-k50-bf16": (7, 50257, 50, bf16),
    "300x50257-k2048-f16": (300, 50257, 2048, f16),
    "64x1M-k64-bf16": (64, 2**20, 64, bf16),
    "3x1M-k1-f32": (3, 10**6, 1, f32),
    "1x16M-k100-bf16": (1, 2**24, 100, bf16),
    "1x16M-k2048-f32": (1, 2**24 - 3, 2048, f32),
}


BACKENDS = ["triton", "tilelang"]


def kernels(backend: str):
    return importlib.import_module(f"runtime.accelerators.sampling.{backend}")


@pytest.fixture(scope="module", autouse=True)
def _tilelang_kernels_compiled_in_parallel():
    from runtime.accelerators.tilelang_common import precompile

    precompile(kernels("tilelang").entries(), torch.device("cuda", torch.cuda.current_device()))


def check_top_k(x, k, largest, backend):
    with use_accelerators(fallback="error"):
        values, indices = top_k(x, k, largest=largest, backend=backend)
    ref_values, ref_indices = top_k_reference(x, k, largest)
    assert torch.equal(indices, ref_indices), (indices != ref_indices).nonzero()[:5]
    assert torch.equal(values, ref_values)
    torch.testing.assert_close(values, torch.topk(x, k, largest=largest).values, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_top_k_matches_the_exact_reference(case, backend):
    rows, width, k, dtype = CASES[case]
    x = torch.randn(rows, width, device="cuda", dtype=dtype)
    check_top_k(x, k, True, backend)
    check_top_k(x, k, False, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_ties_and_all_equal_rows(backend):
    tied = torch.randint(-3, 4, (5, 50257), device="cuda").to(bf16)
    for k in (1, 5, 2048):
        check_top_k(tied, k, True, backend)
        check_top_k(tied, k, False, backend)
    check_top_k(torch.full((2, 2**20), 0.25, device="cuda"), 300, True, backend)
    equal = torch.full((2, 1000), 0.5, device="cuda")  # k = the whole row
    check_top_k(equal, 1000, True, backend)
    check_top_k(equal, 1000, False, backend)
    # an all-equal split row at k = 2048: its candidates merged in three rounds
    check_top_k(torch.full((1, 2**24), 0.5, device="cuda"), 2048, True, backend)
    ties = torch.randint(0, 2, (1, 2**24), device="cuda").to(f16)
    for k in (100, 2048):  # split rows, all ties: the candidates merged once at k = 100, in three rounds at 2048
        check_top_k(ties, k, True, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_signed_zeros_nan_infinities_and_strided_rows(backend):
    x = torch.randn(4, 3001, device="cuda")
    x[:, ::7] = 0.0
    x[:, 3::11] = -0.0
    x[1, 5], x[2, 9], x[3, 100] = math.nan, math.inf, -math.inf
    with use_accelerators(fallback="error"):
        values, indices = top_k(x, 40, backend=backend)
    ref_values, ref_indices = top_k_reference(x, 40)
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=0, equal_nan=True)
    for k in (1, 40):  # smallest: NaN last
        check_top_k(x, k, False, backend)
    strided = torch.randn(2000, 6, device="cuda", dtype=bf16).t()
    check_top_k(strided, 33, True, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [1000, 50257, 2**20])
def test_sample_gives_the_torch_backends_ids(width, backend):
    rows = 256 if width < 2**20 else 64
    logits = torch.randn(rows, width, device="cuda", dtype=bf16) * 3
    per_row = {
        "top_k": torch.randint(1, 51, (rows,), device="cuda"),
        "top_p": torch.rand(rows, device="cuda") * 0.9 + 0.1,
        "temperature": torch.rand(rows, device="cuda") + 0.2,
    }
    for kwargs in ({"top_k": 50, "top_p": 0.9}, per_row, {"top_k": min(2048, width), "temperature": 0.7}):
        ids = {}
        for name in ("torch", backend):
            with use_accelerators(fallback="error"):
                ids[name] = sample(logits, generator=torch.Generator("cuda").manual_seed(1), backend=name, **kwargs)
        # equal up to floating-point ties at the CDF boundaries (softmax and cumsum rounding differ a little)
        agree = (ids["torch"] == ids[backend]).float().mean().item()
        assert agree >= 0.99, (kwargs.keys(), agree)
        assert (ids[backend] >= 0).all()


@pytest.mark.parametrize("dtype", [f32, f16], ids=["f32", "f16"])
def test_tilelang_sample_other_dtypes_and_greedy(dtype):
    """The draw kernels of the other dtypes (the test above runs bf16) and top_k = 1: the argmax, lower id on ties."""
    logits = (torch.randn(64, 50257, device="cuda") * 2).to(dtype)
    kwargs = {"top_k": 50, "top_p": 0.9, "temperature": 0.8}
    ids = {}
    for name in ("torch", "tilelang"):
        with use_accelerators(fallback="error"):
            ids[name] = sample(logits, generator=torch.Generator("cuda").manual_seed(2), backend=name, **kwargs)
    assert (ids["torch"] == ids["tilelang"]).float().mean().item() >= 0.99
    with use_accelerators(fallback="error"):
        greedy = sample(logits, top_k=1, backend="tilelang")
    assert torch.equal(greedy, top_k_reference(logits, 1)[1][:, 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_frequencies_match_the_restricted_distribution(backend):
    """100000 draws of one row at top_k = 20, top_p = 0.8: each id's count within 5 standard deviations of its
    binomial mean (plus one), none outside the kept set."""
    n, width = 100000, 1000
    row = torch.randn(width, device="cuda", dtype=torch.float64) * 2
    z = row / 0.8
    order = torch.sort(z, descending=True, stable=True).indices[:20]
    p = torch.softmax(z[order], -1)
    kept = (torch.cumsum(p, -1) - p) < 0.8
    q = torch.zeros(width, device="cuda", dtype=torch.float64)
    q[order[kept]] = p[kept] / p[kept].sum()
    with use_accelerators(fallback="error"):
        ids = sample(row.float().expand(n, width).contiguous(), temperature=0.8, top_k=20, top_p=0.8, backend=backend)
    counts = torch.bincount(ids, minlength=width).double()
    assert (counts[q == 0] == 0).all()
    sigma = torch.sqrt(n * q * (1 - q))
    assert ((counts - n * q).abs() <= 5 * sigma + 1).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_nan_row_gives_minus_one_without_a_sync(backend):
    logits = torch.randn(4, 5000, device="cuda")
    logits[2, 17] = math.nan
    with use_accelerators(fallback="error"):
        ids = sample(logits, top_k=10, backend=backend)
    reference = sample(logits, top_k=10, backend="torch")
    assert ids[2] == reference[2] == -1 and (ids[[0, 1, 3]] >= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_captured_in_a_cuda_graph(backend):
    logits = torch.randn(32, 150000, device="cuda", dtype=bf16)
    graph, (values, ids) = capture_graph(
        lambda: (top_k(logits, 64, backend=backend)[0], sample(logits, top_k=50, top_p=0.9, backend=backend))
    )
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(values, top_k_reference(logits, 64)[0])
    assert (ids >= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_split_matches_one_program_per_row(backend):
    x = torch.randn(3, 200003, device="cuda", dtype=bf16)
    for segments in (1, 5, 64, (64, 8), (64, 8, 2)):  # tuples: the candidates merged in two and three rounds
        values, indices = kernels(backend).top_k_forward(x, 257, True, segments=segments)
        assert torch.equal(indices, top_k_reference(x, 257)[1]), segments


@pytest.mark.parametrize("backend", BACKENDS)
def test_select_with_and_without_the_filter(backend):
    """The select's threshold filter (the default), its full path and its fallback (a capacity below k: more pass
    than the scratch holds) give the same exact result: random rows, ties at the k-th value, an all-equal row, split
    rows."""
    x = torch.randn(64, 2**20, device="cuda", dtype=bf16)
    kth = x[2].topk(64).values[-1]
    x[1] = 0.5
    x[2, ::1000] = kth
    for select in ({}, {"filter": False}, {"capacity": 63}, {"segments": 8}):
        for largest in (True, False):
            values, indices = kernels(backend).top_k_forward(x, 64, largest, **select)
            ref_values, ref_indices = top_k_reference(x, 64, largest)
            assert torch.equal(indices, ref_indices), (select, largest)
            assert torch.equal(values, ref_values)


def test_tilelang_split_rows_with_ties_across_segments():
    """Ties at the k-th value spread over segments (some shorter than k): the second select takes the lowest indices."""
    x = torch.randint(0, 3, (2, 100000), device="cuda").to(f32)
    for segments, k in ((7, 2048), (200, 1000), (3, 1)):  # 200 segments: each shorter than k, padded
        for largest in (True, False):
            values, indices = kernels("tilelang").top_k_forward(x, k, largest, segments=segments)
            ref_values, ref_indices = top_k_reference(x, k, largest)
            assert torch.equal(indices, ref_indices), (segments, k, largest)
            assert torch.equal(values, ref_values)


def test_tilelang_top_k_of_many_rows_and_k_sizes():
    """More rows than a grid's y dimension holds, and every k bucket of the bitonic sort."""
    x = torch.randn(70000, 40, device="cuda", dtype=f16)
    check_top_k(x, 7, True, "tilelang")
    y = torch.randn(9, 5000, device="cuda")
    for k in (1, 2, 3, 17, 64, 255, 256, 1023, 2048):
        check_top_k(y, k, True, "tilelang")
