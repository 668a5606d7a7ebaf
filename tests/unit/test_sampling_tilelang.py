"""The sampling ops' TileLang kernels, compile-only: every specialisation (select over the row and over candidates,
sort, draw; each dtype, largest True and False) lowered and compiled for sm_90a with the local nvcc. Rows, widths and
k are runtime arguments. The GPU tier (tests/gpu/test_sampling.py) checks the results."""

import re

import pytest
import torch

from conftest import SM90A, requires_nvcc

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
    "select": ("R", "W", "C", "k", "seg_len"),
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
