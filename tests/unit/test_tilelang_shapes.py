"""The TileLang kernels build for the shapes their ops claim: a sweep of embedding widths, mHC stream
counts and row-norm widths, each compiled for sm_90a with the local nvcc, and the claims themselves (each
swept shape passes the op's not-supported check; the first shape past the limit gets a reason). The
swiglu, dropout_add and bce kernels bake in no width (flat element ranges, T.dynamic): one build per
dtype, which their own compile tests make.

A shape a kernel cannot build must be either padded to a buildable tile or refused by the op's
`_reasons` before compiling, so that `auto` and the fallback rule take over; an internal TileLang error
at compile time is neither. TileLang's disk cache is keyed by the program's full TIR text, the target
and the TileLang version, and only successful builds are stored: a cache hit is a build of this very
program that succeeded, a failing build fails on every run.

Each build takes 10-50 s on two cores, so the default run compiles the shapes that once failed to build (embedding
width 96, three mHC streams; the norms compile at one width in test_norms_tilelang.py); TAAC_TILELANG_SWEEP=1 compiles
the whole sweep (about 30 minutes with a cold cache).
"""

import os

import pytest
import torch

from conftest import SM90A, requires_nvcc

tilelang = pytest.importorskip("tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError)
tc = pytest.importorskip(
    "runtime.accelerators.tilelang_common", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)

from runtime.accelerators import mhc  # noqa: E402
from runtime.accelerators.embedding_bag_mean import spec as embedding_bag_spec  # noqa: E402
from runtime.accelerators.embedding_bag_mean import tilelang as eb_kernels  # noqa: E402
from runtime.accelerators.mhc import tilelang as mhc_kernels  # noqa: E402

bf16 = torch.bfloat16

# every class of tile width: exact powers of two, widths padded to one (24, 200, 1000), multiples of 32
# that are no power of two below, between and at multiples of the 128 threads (96, 160, 384), the widest
EMBEDDING_DIMS = [8, 24, 96, 160, 200, 384, 1000, embedding_bag_spec.TILELANG_MAX_DIM]
STREAMS = list(range(1, mhc.MAX_KERNEL_STREAMS + 1))
MHC_WIDTH = 96  # C: below and past one 64-column block, a masked tail
FULL_SWEEP = os.environ.get("TAAC_TILELANG_SWEEP") == "1"


def compiled_sweep(values: list, default: list) -> list:
    """The values whose kernels a run compiles: all of them with TAAC_TILELANG_SWEEP=1, else `default`."""
    return values if FULL_SWEEP else default


def build(program):
    kernel = tilelang.compile(program, target=SM90A)
    assert "__global__" in kernel.get_kernel_source()
    return kernel


# --------------------------------------------------------------------------- embedding_bag_mean


def test_embedding_bag_claims_the_swept_widths():
    for dim in EMBEDDING_DIMS:
        assert embedding_bag_spec._reasons("tilelang", torch.empty(4, dim, dtype=bf16)) == [], dim
    too_wide = embedding_bag_spec.TILELANG_MAX_DIM + 1
    (reason,) = embedding_bag_spec._reasons("tilelang", torch.empty(4, too_wide, dtype=bf16))
    assert f"embedding dim {too_wide} exceeds" in reason


def test_embedding_bag_tile_widths_fall_in_the_swept_classes():
    """Every claimed width maps to tiles of a kind the compile sweep builds."""
    for dim in range(1, embedding_bag_spec.TILELANG_MAX_DIM + 1):
        width, combine = eb_kernels.padded_width(dim), eb_kernels.combine_width(dim)
        assert dim <= width <= combine, dim
        assert combine & (combine - 1) == 0, (
            f"{dim}: the second gradient pass finds a layout only at power-of-two widths"
        )
        assert width % 32 == 0 or width & (width - 1) == 0, dim


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("dim", compiled_sweep(EMBEDDING_DIMS, [96]))
def test_embedding_bag_kernels_compile_for_sm90a(dim):
    entries = [
        eb_kernels.forward_entry(dim, bf16, torch.int64, torch.int64),
        eb_kernels.chunk_entry(dim, bf16, torch.int32),
        eb_kernels.combine_entry(dim, bf16, torch.int32),
    ]
    info = tc.device_info(None)
    for _, make in entries:
        build(make(info))


# --------------------------------------------------------------------------- mhc


def test_mhc_claims_every_swept_stream_count():
    for n in STREAMS:
        assert mhc._reasons("tilelang", torch.empty(2, n, MHC_WIDTH, dtype=bf16)) == [], n
    n = mhc.MAX_KERNEL_STREAMS + 1
    (reason,) = mhc._reasons("tilelang", torch.empty(2, n, MHC_WIDTH, dtype=bf16))
    assert f"x has {n} streams" in reason


@pytest.mark.parametrize("n", STREAMS)
def test_mhc_pre_blocks_give_warp_uniform_row_loops(n):
    """The pre kernels' one-thread-per-(token, row) loops end on a warp boundary (see pre_block_tokens)."""
    assert mhc_kernels.pre_block_tokens(n) * n % 32 == 0
    if n % 2 == 0:
        assert mhc_kernels.pre_block_tokens(n) == mhc_kernels.BLOCK_TOKENS  # the tiling of the even n is kept


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("n", compiled_sweep(STREAMS, [3]))
def test_mhc_kernels_compile_for_sm90a(n):
    k = mhc_kernels
    splits = 3
    for program in (
        k.pre_forward_kernel("bfloat16", "float32", n, MHC_WIDTH),
        k.pre_backward_kernel("bfloat16", "float32", n, MHC_WIDTH),
        k.dphi_kernel("bfloat16", "float32", n, MHC_WIDTH, splits),
        k.post_forward_kernel("bfloat16", n, MHC_WIDTH),
        k.post_backward_kernel("bfloat16", n, MHC_WIDTH),
    ):
        build(program)


# --------------------------------------------------------------------------- row norms

# widths the row plan pads (8 and 24 share a block between rows; 4104 is just past 4096), bf16 rows
NORM_WIDTHS = [8, 24, 40, 96, 136, 200, 1000, 4104]
NORM_ENTRIES = {  # op -> kernel_entries arguments after (dtype, width): with parameters where the op has them
    "rms_norm": (bf16,),
    "layer_norm": (bf16, bf16),
    "l2norm": (),
}


def test_norms_claim_the_swept_widths():
    from runtime.accelerators.norms import MAX_KERNEL_WIDTH, norm_reasons

    for width in NORM_WIDTHS:
        assert norm_reasons("tilelang", torch.empty(3, width, dtype=bf16)) == [], width
    (reason,) = norm_reasons("tilelang", torch.empty(3, MAX_KERNEL_WIDTH + 1, dtype=bf16))
    assert f"row width {MAX_KERNEL_WIDTH + 1} exceeds" in reason


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("width", compiled_sweep(NORM_WIDTHS, []))
@pytest.mark.parametrize("op", list(NORM_ENTRIES))
def test_norm_kernels_compile_for_sm90a(op, width):
    import importlib

    kernels = importlib.import_module(f"runtime.accelerators.{op}.tilelang")
    info = tc.device_info(None)
    for key, make in kernels.kernel_entries(bf16, width, *NORM_ENTRIES[op]):
        if key[0] != "column_sum":  # its width is dynamic: test_norms_tilelang.py builds it
            build(make(info))
