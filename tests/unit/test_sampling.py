"""top_k and sample on the CPU: exact agreement of top_k with a stable-sort oracle and torch.topk (random, tied and
all-equal scores), the Triton kernels under TRITON_INTERPRET=1 (the single-program and the split-row paths), sample's
support and frequencies against the restricted distribution in float64, the same ids on every backend from the same
generator state, the host-side plan the kernel backends share, dispatch and every error (the TileLang kernels are
compiled for sm_90a in test_sampling_tilelang.py)."""

import math
import warnings

import numpy as np
import pytest
import torch

from runtime.accelerators import explain, sample, top_k
from runtime.accelerators.backends import BackendFallbackWarning, BackendUnavailableError
from runtime.accelerators.config import use_accelerators
from runtime.accelerators.sampling import MAX_K, SPEC, select_plan
from runtime.accelerators.sampling import triton as kernels
from runtime.accelerators.sampling.reference import restricted_draw, sample_reference
from runtime.accelerators.sampling.select_plan import as_rows, segments_per_row, select_rounds, split_rows

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def oracle(x: torch.Tensor, k: int, largest: bool = True) -> torch.Tensor:
    """Indices of the k best per row by a stable sort in float64: NaN above everything, -0.0 equal to +0.0, ties by
    ascending index."""
    x = x.double()
    nan = torch.isnan(x)
    rank = torch.where(nan, torch.full_like(x, math.inf), x) + 0.0  # + 0.0 turns -0.0 into +0.0
    if largest:  # NaN first: a stable sort on (is NaN, value) descending
        order = torch.sort(rank, dim=-1, descending=True, stable=True).indices
        order = order.gather(
            -1, torch.sort(nan.gather(-1, order).to(torch.int8), dim=-1, descending=True, stable=True).indices
        )
    else:  # NaN last
        order = torch.sort(rank, dim=-1, stable=True).indices
        order = order.gather(-1, torch.sort(nan.gather(-1, order).to(torch.int8), dim=-1, stable=True).indices)
    return order[..., :k]


def check_top_k(backend, x, k, largest=True):
    values, indices = top_k(x, k, largest=largest, backend=backend)
    expected = oracle(x, k, largest)
    assert indices.dtype == torch.int64 and values.dtype == x.dtype
    assert torch.equal(indices, expected), f"{backend} {tuple(x.shape)} k={k} largest={largest}\n{indices}\n{expected}"
    torch.testing.assert_close(values, torch.topk(x, k, largest=largest).values, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(values, x.gather(-1, expected), rtol=0, atol=0, equal_nan=True)


def scores(kind: str, shape, dtype=f32):
    if kind == "random":
        return torch.randn(shape, dtype=dtype)
    if kind == "tied":
        return torch.randint(-3, 4, shape).to(dtype)
    return torch.full(shape, 0.5, dtype=dtype)  # all equal


# the Triton kernel over a whole 1000-wide row (k = V) on tied scores only: random and all-equal rows at that k run on
# the GPU tier (test_top_k_matches_the_exact_reference, test_top_k_ties_and_all_equal_rows)
TOP_K_CASES = [
    (backend, kind, width, k)
    for backend in ("torch", "triton")
    for kind in ("random", "tied", "equal")
    for width in (37, 1000)
    for k in (1, 5, "V")
    if not (backend == "triton" and width == 1000 and k == "V" and kind != "tied")
]


@pytest.mark.parametrize("backend, kind, width, k", TOP_K_CASES)
@pytest.mark.slow
def test_top_k_matches_stable_oracle_and_torch_topk(backend, kind, width, k):
    k = width if k == "V" else k
    x = scores(kind, (2 if k == 1000 else 3, width))
    check_top_k(backend, x, k, largest=True)
    check_top_k(backend, x, k, largest=False)


@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "f16"])
def test_top_k_half_precision_ties(dtype):
    x = scores("tied", (2, 1000), dtype) / 4 + scores("random", (2, 1000), dtype) / 64  # many equal half values
    for backend in ("torch", "triton"):
        check_top_k(backend, x, 50)
        check_top_k(backend, x, 50, largest=False)


def test_top_k_signed_zeros_nan_and_infinities():
    x = torch.tensor([[0.0, -0.0, 1.0, math.nan, -0.0, 0.0, math.nan, -1.0, math.inf, -math.inf, 2.0]])
    for backend in ("torch", "triton"):
        for k in (1, 3, 6, 11):
            check_top_k(backend, x, k)
            check_top_k(backend, x, k, largest=False)


@pytest.mark.parametrize("segments, kind", [(3, "random"), (7, "tied")])
@pytest.mark.slow
def test_triton_split_rows_select_per_segment_then_over_the_candidates(segments, kind):
    """The path long rows take on the GPU: each segment's k candidates, padded where a segment is shorter than k,
    then a select over them."""
    x = scores(kind, (2, 1000))
    for k, largest in ((5, True), (150, False)):  # 1000 / 7 segments: shorter than 150
        values, indices = kernels.top_k_forward(x, k, largest, segments=segments, block=64)
        assert torch.equal(indices, oracle(x, k, largest))
        assert torch.equal(values, x.gather(-1, indices))


def filter_rows(kind: str, rows: int = 2, width: int = 2000, k: int = 40) -> torch.Tensor:
    """Rows that stress the select's threshold filter: its bound, the ties at the k-th value, the fallback."""
    x = torch.randn(rows, width)
    if kind == "tied_at_kth":  # 30 more entries equal to the k-th largest value, spread over the row
        kth = torch.topk(x, k).values[:, -1:]
        x[:, torch.randperm(width)[:30]] = kth
    elif kind == "equal":
        x = torch.full((rows, width), -1.5)
    elif kind == "ascending":
        x = torch.sort(x).values
    elif kind == "descending":
        x = torch.sort(x, descending=True).values
    elif kind == "specials":  # signed zeros, NaN and infinities among the best and the worst
        picks = torch.randperm(width)[:120].view(6, 20)
        for values, where in zip((0.0, -0.0, math.nan, math.inf, -math.inf, 5.0), picks):
            x[:, where] = values
    return x


def check_kernel(x, k, largest, **launch):
    values, indices = kernels.top_k_forward(x, k, largest, **launch)
    expected = oracle(x, k, largest)
    assert torch.equal(indices, expected), f"{launch} k={k} largest={largest}\n{indices}\n{expected}"
    torch.testing.assert_close(values, x.gather(-1, expected), rtol=0, atol=0, equal_nan=True)


# the filter's formulations: masked steps (the default), and whole tiles read unmasked, two or three per iteration
# (rows of 2000 at block 256: three or two iterations, then masked steps over the rest)
FILTER_FORMS = {
    "masked": kernels.FilterLaunch(),
    "tiles2": kernels.FilterLaunch(tiles=2),
    "tiles3": kernels.FilterLaunch(tiles=3, warps=8),
}


@pytest.mark.parametrize("kind", ["random", "tied_at_kth", "equal", "ascending", "descending", "specials"])
@pytest.mark.parametrize(
    "filter_, form", [(True, "masked"), (True, "tiles2"), (True, "tiles3"), (False, "masked")], ids=lambda v: str(v)
)
def test_triton_select_with_and_without_the_filter_matches_the_oracle(kind, filter_, form):
    """Both paths of the select (block 256: eight steps per row), the filter in each formulation, on rows built for
    the filter: its bound from the group maxima, ties at the k-th value (the first k of them kept, the first taken),
    an all-equal row (exactly k kept), NaN, infinities and signed zeros among the best."""
    x = filter_rows(kind)
    for k, largest in ((40, True), (40, False), (1, True)):
        check_kernel(x, k, largest, block=256, filter=filter_, capacity=512, filter_launch=FILTER_FORMS[form])


@pytest.mark.parametrize(
    "launch",
    [
        kernels.FilterLaunch(step=512, warps=4),
        kernels.FilterLaunch(warps=8, stages=3),
        kernels.FilterLaunch(step=512, tiles=2),
        kernels.FilterLaunch(tiles=4, stages=2),
    ],
    ids=["wider-step", "pipelined", "tiles-wider-step", "tiles-pipelined"],
)
def test_triton_filter_launches_give_the_same_result(launch):
    """The filter's launch options (a step wider than the select's block, so more group maxima; a load pipeline)
    change how it runs, not what it keeps: ties at the k-th value, an all-equal row, split rows."""
    for kind in ("tied_at_kth", "equal"):
        x = filter_rows(kind)
        check_kernel(x, 40, True, block=256, capacity=512, filter_launch=launch)
        check_kernel(x, 40, False, block=256, capacity=512, filter_launch=launch)
    check_kernel(filter_rows("random"), 20, True, segments=3, block=128, filter_launch=launch)


@pytest.mark.parametrize("filter_", [True, False], ids=["filter", "full"])
@pytest.mark.slow
def test_triton_select_rows_shorter_than_the_block_strided_and_split(filter_):
    """k up to the whole row, BLOCK below k (the bound says nothing: every entry passes), rows apart by more than
    their width, bf16 ties, and split rows whose segments are shorter than k (the second select over padded
    candidates)."""
    x = torch.randn(3, 37)
    for k in (37, 30):
        check_kernel(x, k, True, block=16, filter=filter_)
        check_kernel(x, k, False, block=16, filter=filter_)
    sliced = torch.randn(2, 1500)[:, :1000]
    assert as_rows(sliced).stride(0) == 1500
    check_kernel(sliced, 25, True, block=128, filter=filter_)
    check_kernel(scores("tied", (2, 1000), bf16), 25, False, block=128, filter=filter_)
    for segments, k in ((3, 10), (7, 150)):  # 1000 / 7 segments: shorter than 150
        check_kernel(filter_rows("tied_at_kth", width=1000, k=k), k, True, segments=segments, block=64, filter=filter_)


@pytest.mark.parametrize("form", list(FILTER_FORMS))
def test_triton_filter_keeps_few_on_a_random_row_and_exactly_k_on_an_equal_one(form):
    """How many entries each (row, segment) keeps: those above the bound and the first k equal to it, so about k on a
    random row and exactly k on an all-equal one; the kernel selects over them where they fit the capacity, over the
    whole segment otherwise (a capacity below k); the result is exact every way, and every formulation of the
    filter keeps the same entries."""
    width, k, block, capacity, launch = 3000, 20, 256, 512, FILTER_FORMS[form]

    def select(x, segments, capacity):
        seg_stride = -(-width // segments)
        return kernels._select_launch(x, None, width, segments, seg_stride, k, True, True, block, capacity, launch)

    random, equal = torch.randn(1, width), torch.full((1, width), 2.0)
    for x in (random, equal):
        out_x, out_idx, kept = select(x, 1, capacity)
        assert kept.shape == (1, 1) and k <= kept.item() <= capacity, kept
        assert torch.equal(out_idx.sort().values, oracle(x, k).sort().values)
        _, _, kept_masked = kernels._select_launch(x, None, width, 1, width, k, True, True, block, capacity)
        assert torch.equal(kept, kept_masked)
    assert select(equal, 1, capacity)[2].item() == k
    # a random row in two segments: each keeps about k (for distinct keys block * -ln(1 - k / block) pass)
    kept = select(random, 2, capacity)[2]
    assert kept.shape == (1, 2) and ((kept >= k) & (kept <= 4 * k)).all(), kept
    check_kernel(equal, k, True, block=block, filter_launch=launch)
    check_kernel(equal, k, False, block=block, filter_launch=launch)
    # a tie class above the bound larger than the capacity: the full select, still exact
    few_best = torch.randn(1, width)
    few_best[0, ::block] = 9.0  # one strided group of the bound holds them all: the bound stays below 9
    check_kernel(few_best, k, True, block=block, capacity=8, filter_launch=launch)
    assert select(few_best, 1, 8)[2].item() > 8
    # a capacity below k overflows on any row: the full select, still exact
    check_kernel(random, k, True, block=block, capacity=k - 1, filter_launch=launch)
    assert select(random, 1, k - 1)[2].item() > k - 1


def test_triton_filter_at_the_largest_k():
    """k = MAX_K = 2048 through the filter at the GPU's block (4096 group maxima; for distinct keys about 2800 pass),
    in its full-tile form (whole tiles, then masked steps; the masked form, the default, runs at k = 2048 on the GPU
    tier): a random row with ties at the k-th value and NaN among the best; split rows whose segments are shorter than
    k (the second select over padded candidates). The smallest first through the full-tile forms, and bf16 keys
    through the filter, are tested at small k (test_triton_filter_launches_give_the_same_result,
    test_triton_select_rows_shorter_than_the_block_strided_and_split)."""
    launch = FILTER_FORMS["tiles2"]
    x = filter_rows("tied_at_kth", rows=1, width=9000, k=MAX_K)
    x[0, torch.randperm(9000)[:5]] = math.nan
    check_kernel(x, MAX_K, True, capacity=4096, filter_launch=launch)
    check_kernel(x, MAX_K, True, segments=5, filter_launch=launch)


def check_rounds(x, k, largest, segments, rounds, **launch):
    """top_k through the select's rounds (as many as `rounds`): indices as the stable oracle, values as torch.topk."""
    rows, width = x.shape
    assert len(select_rounds(rows, width, k, x.device, segments)) == rounds
    values, indices = kernels.top_k_forward(x, k, largest, segments=segments, **launch)
    assert torch.equal(indices, oracle(x, k, largest)), f"{segments} k={k} largest={largest}"
    torch.testing.assert_close(values, torch.topk(x, k, largest=largest).values, rtol=0, atol=0)


def test_triton_select_merges_the_candidates_in_rounds_at_the_largest_k():
    """k = MAX_K over a row in 16 segments (each shorter than k: padded): its 16 * 2048 candidates in two segments of
    16384, then one (three rounds, as the plan gives any row at k = 2048); ties at the k-th value across segments
    and rounds go to the lower index (random and all-equal rows in three rounds at k = 2048 run on the GPU tier)."""
    x = scores("tied", (1, 9000))
    check_rounds(x, MAX_K, False, 16, 3)


@pytest.mark.slow
def test_triton_select_rounds_forced_per_round():
    """Four rounds forced (9, 4 and 2 segments, then one) at small blocks on tied rows: each round's segments cut its
    candidate list anywhere (not at the earlier segments' edges), with and without the filter, both directions;
    sample draws from the survivors of the same rounds (random rows in forced rounds, and all-equal ones in rounds,
    run on the GPU tier)."""
    x = scores("tied", (2, 1000))
    for largest, filter_ in ((True, True), (False, True), (True, False)):
        check_rounds(x, 20, largest, (9, 4, 2), 4, block=64, filter=filter_)
    logits = x.to(bf16)
    keep_k = torch.tensor([20, 7], dtype=torch.int32)
    temperature, top_p, uniforms = torch.rand(2) + 0.3, torch.rand(2) * 0.9 + 0.1, torch.rand(2)
    ids = kernels.sample_forward(logits, keep_k, 20, temperature, top_p, uniforms, segments=(9, 4, 2), block=64)
    assert torch.equal(ids, sample_reference(logits, keep_k, 20, temperature, top_p, uniforms))


@pytest.mark.parametrize("filter_", [True, False], ids=["filter", "full"])
def test_triton_sample_ids_with_and_without_the_filter_match_torch(filter_):
    logits = (torch.randn(8, 1500) * 2).to(bf16)
    logits[:4, 100:140] = logits[:4].amax(-1, keepdim=True)  # ties at the top of half the rows
    keep_k = torch.randint(1, 60, (8,), dtype=torch.int32)
    temperature, top_p, uniforms = torch.rand(8) + 0.3, torch.rand(8) * 0.9 + 0.1, torch.rand(8)
    ids = kernels.sample_forward(logits, keep_k, 60, temperature, top_p, uniforms, block=256, filter=filter_)
    expected = sample_reference(logits, keep_k, 60, temperature, top_p, uniforms)
    assert torch.equal(ids, expected)


def test_top_k_batch_dims_strided_and_empty():
    x = torch.randn(2, 3, 37)
    for backend in ("torch", "triton"):
        check_top_k(backend, x, 4)
        check_top_k(backend, torch.randn(37, 6).t(), 4)  # rows not contiguous
        values, indices = top_k(torch.randn(0, 37), 3, backend=backend)
        assert values.shape == indices.shape == (0, 3)
    x = torch.randn(37)
    values, indices = top_k(x, 3, backend="triton")
    assert values.shape == (3,) and torch.equal(indices, oracle(x, 3))


def test_top_k_accepts_any_integral_k_on_every_backend():
    x = torch.randn(3, 37)
    for backend in ("torch", "triton"):
        values, indices = top_k(x, np.int64(4), backend=backend)
        assert torch.equal(indices, oracle(x, 4))


def test_top_k_gradients_on_torch_and_a_reason_on_triton():
    x = torch.randn(3, 37, requires_grad=True)
    values, indices = top_k(x, 4, backend="torch")
    (grad,) = torch.autograd.grad(values.sum(), x)
    expected = torch.zeros(3, 37).scatter(-1, indices, 1.0)
    assert torch.equal(grad, expected)
    with pytest.warns(BackendFallbackWarning, match="forward-only"):
        values, _ = top_k(x, 4, backend="triton")
    assert values.requires_grad
    with torch.no_grad():  # nothing to differentiate: the kernel runs
        with use_accelerators(fallback="error"):
            check_top_k("triton", x.detach(), 4)


# --------------------------------------------------------------------------- sample


def restricted(logits: torch.Tensor, temperature: float, top_k_: int | None, top_p: float | None) -> torch.Tensor:
    """The restricted distribution of one row in float64 (textbook): probabilities over the vocabulary."""
    z = logits.double() / temperature
    order = oracle(z, z.shape[-1])
    kept = order if top_k_ is None else order[:top_k_]
    p = torch.softmax(z[kept], -1)
    if top_p is not None:
        before = torch.cumsum(p, -1) - p
        kept, p = kept[before < top_p], p[before < top_p]
    out = torch.zeros_like(z)
    out[kept] = p / p.sum()
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.slow
def test_sample_draws_only_allowed_ids(backend):
    logits = torch.randn(1, 300).expand(32, 300).contiguous()
    allowed = restricted(logits[0], 0.7, 20, 0.8) > 0
    ids = sample(
        logits, temperature=0.7, top_k=20, top_p=0.8, generator=torch.Generator().manual_seed(3), backend=backend
    )
    assert ids.shape == (32,) and ids.dtype == torch.int64
    assert allowed[ids].all(), ids


@pytest.mark.parametrize(
    "top_k_, top_p", [(None, None), (None, 0.9), (12, None), (12, 0.75)], ids=["plain", "top_p", "top_k", "both"]
)
def test_sample_frequencies_match_the_restricted_distribution(top_k_, top_p):
    """20000 draws of one row: each id's count within 5 standard deviations of its binomial mean (a correct sampler
    fails one of the ids with probability below 1e-4 overall), and no draw outside the support."""
    n = 20000
    logits = torch.randn(40, dtype=torch.float64) * 1.5
    q = restricted(logits, 1.3, top_k_, top_p)
    ids = sample(
        logits.expand(n, 40).contiguous(),
        temperature=1.3,
        top_k=top_k_,
        top_p=top_p,
        generator=torch.Generator().manual_seed(11),
        backend="torch",
    )
    counts = torch.bincount(ids, minlength=40).double()
    assert (counts[q == 0] == 0).all()
    sigma = torch.sqrt(n * q * (1 - q))
    deviation = (counts - n * q).abs()
    assert (deviation <= 5 * sigma + 1).all(), (deviation / sigma.clamp_min(1e-12)).max()


@pytest.mark.parametrize("dtype", [f32, bf16], ids=["f32", "bf16"])
@pytest.mark.slow
def test_sample_same_generator_state_gives_the_same_ids_on_torch_and_triton(dtype):
    logits = (torch.randn(8, 200) * 2).to(dtype)
    per_row = {
        "top_k": torch.randint(1, 40, (8,)),
        "top_p": torch.rand(8) * 0.9 + 0.1,
        "temperature": torch.rand(8) + 0.3,
    }
    settings = [{"top_k": 50, "top_p": 0.9}, per_row] if dtype == f32 else [{"top_k": 200, "temperature": 0.5}]
    for kwargs in settings:
        ids = {
            b: sample(logits, generator=torch.Generator().manual_seed(5), backend=b, **kwargs)
            for b in ("torch", "triton")
        }
        assert torch.equal(ids["torch"], ids["triton"]), kwargs
    greedy = sample(logits, top_k=1, backend="triton")
    assert torch.equal(greedy, oracle(logits, 1)[:, 0])


def test_sample_draws_one_uniform_per_row_from_the_generator():
    logits = torch.randn(10, 100)
    generator = torch.Generator().manual_seed(9)
    sample(logits, top_k=5, generator=generator, backend="triton")
    expected = torch.Generator().manual_seed(9)
    torch.rand(10, generator=expected)
    assert torch.equal(generator.get_state(), expected.get_state())


def test_sample_with_the_default_generator_follows_torch_manual_seed():
    logits = torch.randn(16, 100)
    torch.manual_seed(4)
    first = sample(logits, top_k=30, backend="torch")
    torch.manual_seed(4)
    assert torch.equal(sample(logits, top_k=30, backend="triton"), first)


def test_kernel_and_reference_give_minus_one_for_a_row_with_nan():
    logits = torch.randn(3, 64)
    logits[1, 7] = math.nan
    keep_k, temperature, top_p = torch.full((3,), 8, dtype=torch.int32), torch.ones(3), torch.ones(3)
    uniforms = torch.rand(3)
    ids = kernels.sample_forward(logits, keep_k, 8, temperature, top_p, uniforms)
    assert ids[1] == -1 and (ids[[0, 2]] >= 0).all()
    values, indices = torch.topk(torch.nan_to_num(logits, nan=math.inf), 8)
    values = logits.gather(-1, indices)
    assert torch.equal(restricted_draw(values, indices, keep_k, temperature, top_p, uniforms), ids)


def test_kernel_and_reference_give_minus_one_for_a_row_of_minus_infinity():
    """On CUDA no host sync checks the logits: a row whose survivors are all -inf (softmax 0 / 0) gets -1, as NaN."""
    logits = torch.randn(3, 64)
    logits[1] = -math.inf
    keep_k, temperature, top_p = torch.full((3,), 8, dtype=torch.int32), torch.ones(3), torch.ones(3)
    uniforms = torch.rand(3)
    ids = kernels.sample_forward(logits, keep_k, 8, temperature, top_p, uniforms)
    assert ids[1] == -1 and (ids[[0, 2]] >= 0).all()
    assert torch.equal(sample_reference(logits, keep_k, 8, temperature, top_p, uniforms), ids)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sample_at_a_temperature_below_float32_range_is_greedy(backend):
    """A temperature that rounds to 0 in float32 turns negative logits into -inf: the row is still defined."""
    logits = -1.0 - torch.rand(3, 20)
    ids = sample(logits, temperature=1e-50, top_k=4, backend=backend)
    assert torch.equal(ids, logits.argmax(-1))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("top_k_value", [None, 3])
def test_sample_rejects_a_row_of_minus_infinity_on_the_cpu(backend, top_k_value):
    logits = torch.randn(4, 9)
    logits[2] = -math.inf
    logits[3, :7] = -math.inf  # two finite logits left: a valid row
    with pytest.raises(ValueError, match=r"logits: every logit of row 2 is -inf"):
        sample(logits, top_k=top_k_value, backend=backend)
    logits[2, 4] = 0.0
    ids = sample(logits, top_k=top_k_value, backend="torch")
    assert ids[2] == 4 and ids[3] in (7, 8)


def test_sample_without_top_k_runs_torch_with_the_reason():
    logits = torch.randn(4, 50)
    with pytest.warns(BackendFallbackWarning, match="need top_k"):
        ids = sample(logits, top_p=0.5, backend="triton")
    assert ids.shape == (4,)
    with use_accelerators(fallback="error"), pytest.raises(BackendUnavailableError, match="at most 2048"):
        sample(torch.randn(2, 3000), top_k=2049, backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sample_takes_a_temperature_beyond_float32_range(backend):
    logits = torch.randn(3, 37)
    ids = sample(logits, temperature=1e39, top_k=5, generator=torch.Generator().manual_seed(0), backend=backend)
    top = torch.topk(logits, 5).indices
    assert (ids[:, None] == top).any(-1).all()
    widest = torch.finfo(torch.float32).max  # the same (uniform) draw as the widest float32 temperature
    same = sample(logits, temperature=widest, top_k=5, generator=torch.Generator().manual_seed(0), backend=backend)
    assert torch.equal(ids, same)


def test_sample_empty_batch():
    assert sample(torch.randn(0, 10), top_k=3, backend="triton").shape == (0,)


# --------------------------------------------------------------------------- dispatch and errors


def test_tilelang_on_cpu_falls_back_naming_cuda():
    with pytest.warns(BackendFallbackWarning, match="tilelang backend needs CUDA tensors"):
        check_top_k("tilelang", torch.randn(2, 37), 3)
    with use_accelerators(fallback="error"), pytest.raises(BackendUnavailableError, match="sampling: the tilelang"):
        sample(torch.randn(2, 37), top_k=3, backend="tilelang")
    assert "sampling: configured 'auto'" in explain("sampling")


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_kernel_backends_give_the_same_input_reasons(backend):
    """What the kernels cannot do, beyond the device: the same limits for both kernel backends, each naming itself."""
    x = torch.empty(2, 3000)
    assert SPEC.reasons(backend, scores=x, k=MAX_K) == []
    (too_many,) = SPEC.reasons(backend, scores=x, k=MAX_K + 1)
    assert f"the {backend} kernels select at most {MAX_K}" in too_many
    (no_top_k,) = SPEC.reasons(backend, scores=x, k=None)
    assert f"the {backend} kernels need top_k" in no_top_k
    (grad,) = SPEC.reasons(backend, scores=x, k=5, needs_grad=True)
    assert f"the {backend} kernels are forward-only" in grad
    (dtype,) = SPEC.reasons(backend, scores=x.double(), k=5)
    assert "float64" in dtype


def test_auto_tries_the_tilelang_kernels_first():
    """Faster than Triton at every benchmark case on an H200."""
    assert SPEC.priority == ("tilelang", "triton")


# --------------------------------------------------------------------------- host-side plan shared by the kernels


@pytest.mark.parametrize(
    "n, k, asked, multiple, expected",
    [
        (1000, 5, 7, 1, (7, 143)),
        (10, 3, 4, 1, (4, 3)),
        (9, 3, 4, 1, (3, 3)),
        (5, 5, 9, 1, (5, 1)),
        (37, 3, None, 1, (1, 37)),
        (1000, 5, 7, 16, (7, 144)),
        (40, 3, 7, 16, (3, 16)),  # lengths a multiple of 16: fewer segments where it must
    ],
)
def test_split_rows_gives_non_empty_segments(n, k, asked, multiple, expected):
    segments, length = split_rows(3, n, k, torch.device("cpu"), asked, multiple)
    assert (segments, length) == expected and length % multiple == 0
    assert (segments - 1) * length < n <= segments * length  # every segment holds an entry, together all of them


def test_segments_per_row_on_the_cpu_is_one_unless_asked():
    cpu = torch.device("cpu")
    assert segments_per_row(1, 2**24, 100, cpu, None) == 1
    assert segments_per_row(1, 10, 3, cpu, 64) == 10  # never more segments than entries
    assert segments_per_row(1, 10, 3, cpu, 0) == 1


def test_select_rounds_merge_until_one_segment_per_row(monkeypatch):
    """The plan on a GPU of 132 SMs: one 16M row at k = 2048 in 264 segments, then its candidates in rounds of
    segments of at least 16384 (33, 4, then one program); k = 100 keeps one merge of 26400 candidates; many rows one
    round. Every round covers the candidates of the one before; forced counts and the CPU's plan."""
    monkeypatch.setattr(select_plan, "sm_count", lambda device: 132)
    gpu = torch.device("cpu")  # the SM count is patched: the plan of a 132-SM GPU
    plan = select_rounds(1, 2**24, MAX_K, gpu, None)
    assert plan == [(264, 63551), (33, 16384), (4, 16896), (1, 8192)]
    assert [s for s, _ in select_rounds(1, 2**24, 100, gpu, None)] == [264, 1]
    assert [s for s, _ in select_rounds(1, 2**24, 512, gpu, None)] == [264, 8, 1]
    assert [s for s, _ in select_rounds(8, 2**24, MAX_K, gpu, None, 16)] == [33, 4, 1]
    assert select_rounds(1024, 2**20, 64, gpu, None) == [(1, 2**20)]
    for rows, n, k in ((1, 2**24, MAX_K), (1, 2**24 - 3, MAX_K), (8, 2**24, 700), (2, 10**6, 5)):
        for multiple in (1, 16):
            plan = select_rounds(rows, n, k, gpu, None, multiple)
            widths = [n] + [s * k for s, _ in plan[:-1]]
            for (s, length), width in zip(plan, widths):
                assert (s - 1) * length < width <= s * length and length % multiple == 0
            assert plan[-1][0] == 1
            for (before, _), (after, _) in zip(plan, plan[1:]):
                assert after == 1 or after <= before // 8  # a round cuts the programs by 8 at least
    monkeypatch.undo()
    cpu = torch.device("cpu")
    assert select_rounds(1, 2**24, MAX_K, cpu, None) == [(1, 2**24)]  # the interpreter: one program per row
    assert select_rounds(1, 9000, MAX_K, cpu, 16) == [(16, 563), (2, 16384), (1, 4096)]  # merged as on a GPU
    assert select_rounds(2, 1000, 20, cpu, (9, 4, 2)) == [(9, 112), (4, 45), (2, 40), (1, 40)]
    assert select_rounds(2, 1000, 20, cpu, (9,)) == [(9, 112), (1, 180)]


def test_as_rows_keeps_a_unit_stride_view_and_copies_otherwise():
    x = torch.randn(2, 3, 37)
    assert as_rows(x).shape == (6, 37) and as_rows(x).data_ptr() == x.data_ptr()
    sliced = torch.randn(4, 50)[:, :37]  # rows apart by 50: kept as a view
    assert as_rows(sliced).stride() == (50, 1) and as_rows(sliced).data_ptr() == sliced.data_ptr()
    columns = torch.randn(37, 6).t()
    rows = as_rows(columns)
    assert rows.stride(-1) == 1 and torch.equal(rows, columns)


def test_auto_takes_triton_under_the_interpreter():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_top_k("auto", torch.randn(2, 37), 3)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: top_k(torch.randn(3, 5), 6), ValueError, r"k: expected an int from 1 to 5"),
        (lambda: top_k(torch.randn(3, 5), 0), ValueError, r"k: expected an int from 1 to 5"),
        (lambda: top_k(torch.randn(3, 5), True), TypeError, r"k: expected an int"),
        (lambda: top_k(torch.randn(3, 5), 2.0), TypeError, r"k: expected an int"),
        (lambda: top_k(torch.arange(5), 2), TypeError, r"scores: expected a floating-point tensor"),
        (lambda: top_k(torch.randn(3, 0), 1), ValueError, r"k: expected an int from 1 to 0"),
        (lambda: top_k(torch.randn(3, 5), 2, largest="yes"), TypeError, r"largest: expected a bool"),
        (lambda: sample(torch.arange(10).view(2, 5)), TypeError, r"logits: expected a floating-point tensor"),
        (lambda: sample(torch.randn(5)), ValueError, r"logits: expected shape \[B, V\]"),
        (lambda: sample(torch.randn(2, 5), temperature=0.0), ValueError, r"temperature: expected a finite number > 0"),
        (lambda: sample(torch.randn(2, 5), temperature=-1.0), ValueError, r"temperature: expected a finite number > 0"),
        (
            lambda: sample(torch.randn(2, 5), temperature=torch.tensor([1.0, 0.0])),
            ValueError,
            r"temperature: .* in every row",
        ),
        (
            lambda: sample(torch.randn(2, 5), temperature=torch.ones(3)),
            ValueError,
            r"temperature: expected a number or a tensor of shape \(2,\)",
        ),
        (lambda: sample(torch.randn(2, 5), top_p=0.0), ValueError, r"top_p: expected a number in \(0, 1\]"),
        (lambda: sample(torch.randn(2, 5), top_p=1.5), ValueError, r"top_p: expected a number in \(0, 1\]"),
        (lambda: sample(torch.randn(2, 5), top_p=math.nan), ValueError, r"top_p: expected a number in \(0, 1\]"),
        (lambda: sample(torch.randn(2, 5), top_p="0.9"), TypeError, r"top_p: expected"),
        (lambda: sample(torch.randn(2, 5), top_k=6), ValueError, r"top_k: expected an int from 1 to 5"),
        (lambda: sample(torch.randn(2, 5), top_k=0), ValueError, r"top_k: expected an int from 1 to 5"),
        (lambda: sample(torch.randn(2, 5), top_k=2.5), TypeError, r"top_k: expected an int"),
        (
            lambda: sample(torch.randn(2, 5), top_k=torch.tensor([1.0, 2.0])),
            TypeError,
            r"top_k: expected an integer tensor",
        ),
        (lambda: sample(torch.randn(2, 5), top_k=torch.tensor([1, 9])), ValueError, r"top_k: .* in every row"),
        (lambda: sample(torch.tensor([[0.0, math.nan]])), ValueError, r"logits: contains NaN"),
        (
            lambda: sample(torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]])),
            ValueError,
            r"logits: every logit of row 1 is -inf",
        ),
        (lambda: sample(torch.randn(2, 5), generator=3), TypeError, r"generator: expected a torch.Generator"),
    ],
)
def test_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_sample_takes_per_row_tensors_that_require_gradients():
    """A temperature or top_p tensor that requires a gradient (a learned temperature) is read like any other: the ids
    take no gradient, so the forward-only kernel runs."""
    logits = torch.randn(2, 16)
    temperature = torch.tensor([1.0, 0.5], requires_grad=True)
    top_p = torch.tensor([0.9, 0.8], requires_grad=True)
    ids = {}
    for backend in ("torch", "triton"):
        with use_accelerators(fallback="error"):
            ids[backend] = sample(
                logits,
                temperature=temperature,
                top_k=4,
                top_p=top_p,
                generator=torch.Generator().manual_seed(3),
                backend=backend,
            )
    assert ids["torch"].dtype == torch.int64 and torch.equal(ids["torch"], ids["triton"])
