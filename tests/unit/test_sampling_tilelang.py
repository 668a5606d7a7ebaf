"""The sampling ops' TileLang kernels, compile-only: every specialisation (select over the row and over candidates,
sort, draw; each dtype, largest True and False) lowered and compiled for sm_90a with the local nvcc. Rows, widths and
k are runtime arguments. A small case runs the generated CUDA on the CPU (tools/tilelang_on_cpu.py, a fiber per CUDA
thread) against the reference; the GPU tier (tests/gpu/test_sampling.py) checks the results on the GPU."""

import math
import re

import pytest
import torch

from conftest import SM90A, requires_gxx, requires_nvcc, tilelang_on_cpu

kernels = pytest.importorskip(
    "runtime.accelerators.sampling.tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
ENTRIES = {
    **{
        f"select-{name}-{'largest' if largest else 'smallest'}-{'candidates' if indexed else 'row'}": (
            lambda dtype=dtype, largest=largest, indexed=indexed: kernels.select_entry(dtype, largest, indexed)
        )
        for name, dtype in DTYPES.items()
        for largest in (True, False)
        for indexed in (False, True)
    },
    **{
        f"sort-{name}-{'largest' if largest else 'smallest'}": (
            lambda dtype=dtype, largest=largest: kernels.sort_entry(dtype, largest)
        )
        for name, dtype in DTYPES.items()
        for largest in (True, False)
    },
    **{f"draw-{name}": (lambda dtype=dtype: kernels.draw_entry(dtype)) for name, dtype in DTYPES.items()},
}
# the runtime arguments of each kernel (one compiled kernel serves every shape and k)
RUNTIME = {
    "select": ("R", "W", "C", "KC", "P", "k", "seg_len", "use_filter"),
    "sort": ("R", "K", "W", "k_pad", "log_k_pad"),
    "draw": ("R", "K"),
}


def test_the_entries_cover_every_specialisation():
    keys = {kernels_entry()[0] for kernels_entry in ENTRIES.values()}
    assert keys == {key for key, _ in kernels.entries()}
    assert len(keys) == 21


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENTRIES))
def test_kernel_compiles_for_sm90a(name):
    import tilelang

    from runtime.accelerators.tilelang_common import device_info

    _, build = ENTRIES[name]()
    source = tilelang.compile(build(device_info(None)), target=SM90A).get_kernel_source()
    signature = re.search(r"__global__ void __launch_bounds__\(\d+, 1\) \w+\(([^)]*)\)", source)
    assert signature, source[:2000]
    for dynamic in RUNTIME[name.split("-")[0]]:
        assert re.search(rf"\bint {dynamic}\b", signature.group(1)), f"{name}: {dynamic} should be a runtime argument"
    # the barriers are all written out in the kernels (no automatic ones inside branches)
    assert "__syncthreads" in source
    if name.startswith("select"):
        assert "AtomicAddRet" in source and "AtomicAdd(" in source  # the slot counter and the histograms


@pytest.fixture(scope="module")
def cpu_launch():
    """One launcher for the module's CPU runs: each kernel is compiled once."""
    tool = tilelang_on_cpu()
    return tool.cpu_launcher(tool.SAMPLING_GRIDS)


@requires_nvcc
@requires_gxx
@pytest.mark.slow
def test_generated_kernels_run_on_the_cpu_and_match_the_reference(cpu_launch):
    """The generated CUDA of the select (over the row and over candidates), sort and draw kernels, run on the CPU by
    tools/tilelang_on_cpu.py (a fiber per CUDA thread): ties across segments and merging rounds, and one draw."""
    from runtime.accelerators.sampling.reference import restricted_draw, top_k_reference

    launch = cpu_launch
    x = torch.randint(-2, 3, (2, 300)).float()
    values, indices = kernels.top_k_forward(x, 40, False, segments=3, launch=launch)
    ref_values, ref_indices = top_k_reference(x, 40, largest=False)
    assert torch.equal(indices, ref_indices) and torch.equal(values, ref_values)
    # the select in three rounds (5 segments, their 200 candidates in 2, then 1): ties across segments and rounds
    values, indices = kernels.top_k_forward(x, 40, True, segments=(5, 2), launch=launch)
    ref_values, ref_indices = top_k_reference(x, 40)
    assert torch.equal(indices, ref_indices) and torch.equal(values, ref_values)
    logits = torch.randn(2, 300, dtype=torch.bfloat16)
    keep_k, temperature, top_p, uniforms = (
        torch.tensor([30, 7], dtype=torch.int32),
        torch.ones(2),
        torch.ones(2) * 0.8,
        torch.rand(2),
    )
    ids = kernels.sample_forward(logits, keep_k, 30, temperature, top_p, uniforms, launch=launch)
    values, indices = top_k_reference(logits, 30)
    assert torch.equal(ids, restricted_draw(values, indices, keep_k, temperature, top_p, uniforms))


@requires_nvcc
@requires_gxx
@pytest.mark.slow
def test_generated_select_with_and_without_the_filter_on_the_cpu(cpu_launch):
    """The select's threshold filter on the CPU (rows of two 4096-entry steps): how many entries pass its bound (about
    k on a random row, exactly k on an all-equal one: the bound is a (key, ~index) pair), the fallback where more
    pass than the scratch holds, and the same result as the reference on both paths (ties at the k-th value, sorted
    rows, signed zeros, NaN and infinities)."""
    from runtime.accelerators.sampling.reference import top_k_reference

    width, k = 6000, 40
    torch.manual_seed(0)
    random, equal = torch.randn(1, width), torch.full((1, width), 0.5)
    for x, low, high in ((random, k, 4 * k), (equal, k, k)):
        _, indices, kept = kernels._select_launch(x, None, width, 1, k, False, True, kernels.CAPACITY, cpu_launch)
        assert kept.shape == (1, 1) and low <= kept.item() <= high, kept
        assert torch.equal(indices.sort().values, top_k_reference(x, k, largest=False)[1].int().sort().values)
    _, _, kept = kernels._select_launch(random, None, width, 1, k, False, True, k - 1, cpu_launch)
    assert kept.item() > k - 1  # overflows: the block selected over its whole segment

    tied = torch.randn(2, width)
    tied[:, torch.randperm(width)[:30]] = torch.topk(tied, k, largest=False).values[:, -1:]
    specials = torch.randn(2, width)
    for value, where in zip((0.0, -0.0, math.nan, math.inf, -math.inf), torch.randperm(width)[:100].view(5, 20)):
        specials[:, where] = value
    cases = [
        (tied, {}),
        (tied, {"filter": False}),
        (torch.sort(torch.randn(1, width), descending=True).values, {}),
        (specials, {}),
        (specials, {"filter": False}),
        (random, {"capacity": k - 1}),
        (equal, {"capacity": k}),  # exactly k pass: they fit
    ]
    for x, select in cases:
        values, indices = kernels.top_k_forward(x, k, False, launch=cpu_launch, **select)
        ref_values, ref_indices = top_k_reference(x, k, largest=False)
        assert torch.equal(indices, ref_indices), select
        torch.testing.assert_close(values, ref_values, rtol=0, atol=0, equal_nan=True)
