"""The TileLang row-norm kernels, compile-only: lowered and compiled for sm_90a with the local nvcc.

One representative specialisation per kernel (forward and backward, with and without
parameters, widths 200 and 4096); the GPU tier checks the numbers.
"""

import importlib
import importlib.metadata
import re

import pytest
import torch

from conftest import SM90A, requires_nvcc

tc = pytest.importorskip(
    "runtime.accelerators.tilelang_common", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16

# (op, kernel_entries arguments): 4096 with parameters (mixed precision), 200 without (padded rows)
CASES = {
    "rms_norm-4096-bf16-w_f32": ("rms_norm", (bf16, 4096, f32)),
    "rms_norm-200-f16": ("rms_norm", (f16, 200, None)),
    "layer_norm-4096-bf16-wb_bf16": ("layer_norm", (bf16, 4096, bf16, bf16)),
    "layer_norm-200-f32": ("layer_norm", (f32, 200, None, None)),
    "l2norm-4096-bf16": ("l2norm", (bf16, 4096)),
    "l2norm-200-f16": ("l2norm", (f16, 200)),
}
_compiled = {}


def compile_entries(op, args):
    """Compile forward, backward (and the parameter-gradient reduction) for sm_90a, once per key."""
    info = tc.device_info(None)
    assert info.target == SM90A
    kernels = {}
    for key, build in importlib.import_module(f"runtime.accelerators.{op}.tilelang").kernel_entries(*args):
        if key not in _compiled:
            import tilelang

            _compiled[key] = tilelang.compile(build(info), target=SM90A)
        kernels[key[0]] = _compiled[key]
    return kernels


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_norm_kernels_compile_for_sm90a(case):
    op, args = CASES[case]
    dtype, width = args[0], args[1]
    kernels = compile_entries(op, args)
    has_params = any(a is not None for a in args[2:])
    assert set(kernels) == {f"{op}_fwd", f"{op}_bwd"} | ({"column_sum"} if has_params else set())
    for name in (f"{op}_fwd", f"{op}_bwd"):
        kernel = kernels[name]
        source = kernel.get_kernel_source()
        assert "__global__" in source
        assert "atomic" not in source.lower(), f"{name}: parameter gradients must go through partial sums, not atomics"
        # the row count is a runtime argument (one kernel for every batch), the width is baked in
        rows_dim = kernel.params[0].shape[0]
        assert not isinstance(rows_dim, int) and not hasattr(rows_dim, "value"), (
            f"{name}: rows must be dynamic, got {rows_dim}"
        )
        assert int(kernel.params[0].shape[1]) == width
        if dtype.itemsize == 2 and width % 8 == 0:
            # rows are read and written with 16-byte vectors
            assert re.search(r"\*\(uint4\*\)\((X|DY) \+", source), f"{name}: expected 16-byte loads"
            assert re.search(r"\*\(uint4\*\)\((Y|DX) \+", source), f"{name}: expected 16-byte stores"


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("width", [16, 17, 48, 64, 128, 200, 1000, 4095, 4096, 8192, 16384])
def test_row_plan_pads_rows_to_a_whole_number_of_vectors_per_thread(width, elem_bytes):
    plan = tc.row_plan(width, elem_bytes)
    step = plan.row_threads * plan.vec  # columns the threads of one row cover per vector
    assert plan.vec * elem_bytes == 16
    assert plan.width == width and width <= plan.padded < width + step and plan.padded % step == 0
    assert plan.block_rows * plan.row_threads == plan.threads and 128 <= plan.threads <= 512
    assert plan.padded // step <= 8  # registers per thread stay bounded
    if width <= 128 and elem_bytes == 2:
        assert plan.block_rows >= 8  # narrow rows share a block


def test_version_check_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.14")
    with pytest.raises(ImportError, match=r"tilelang 0\.1\.14 is installed .*pip install tilelang==0\.1\.15"):
        tc._check_version()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ImportError, match=r"pip install tilelang==0\.1\.15"):
        tc._check_version()


def test_device_info_without_a_device_targets_h100():
    info = tc.device_info(None)
    assert info.target == {"kind": "cuda", "arch": "sm_90a"} and info.sm_count == 132
