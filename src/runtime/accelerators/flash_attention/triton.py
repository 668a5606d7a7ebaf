"""FlashAttention in Triton: forward (online softmax, saves the log-sum-exp), a dq kernel that also writes
delta = rowsum(o * do), then a dk/dv kernel that reads it; or, where every key fits one block (short
sequences, see use_fused), one fused backward kernel that also computes delta and stores dq.

Layout: q [B, H, Lq, D], k/v [B, Hkv, Lk, D], any strides (views are read in place); o, lse and the
gradients are written contiguous. One program handles one block of rows of one (batch, head):
queries for the forward and dq kernels, keys for the dk/dv kernel, which also loops over the
H // Hkv query heads of its kv head so GQA gradients are summed without atomics.

Masks: causal (query i sees keys j <= i, top-left as SDPA) and key_lengths (keys j >= length are
hidden) decide both which key blocks a program visits and, only on the blocks that straddle a
boundary, an element mask. A row that sees no key gets o = 0 and lse = +inf, so that every
probability the backward recomputes from it is exp(-inf) = 0.

Dropout keeps element (b, h, i, j) by the counter-based hash of dropout.py (the TileLang kernels' draw); forward
and backward regenerate the same bits, nothing of size L x L is stored. The kernels take the rate as drawn
(dropout.drop_rate, a multiple of 2^-16) and compare the bits with it exactly.

Dtypes: bf16 and fp16 run on tensor cores with fp32 accumulation; fp32 inputs run exact fp32 products
(input_precision="ieee": tf32 would miss the fp32 accuracy bound), correct but several times slower.

Sequence lengths, heads and strides are runtime arguments (lengths are not specialised), so one
compiled kernel per (head dim, dtype, causal, key_lengths, dropout) serves every shape.

Forward variants (FwdConfig, per head dim in CONFIGS_*["fwd"] / ["fwd_causal"]):
- tma: Q/K/V tiles through Hopper TMA tensor descriptors made in the kernel (one per program and tensor, rows
  ending at Lq / key_lengths[b] so the hardware zero-fills past them). Only on CUDA capability >= 9.0, compiled
  (never under the interpreter unless a test forces it), and where the strides allow (16-byte aligned base and
  row strides, contiguous head dim); anything else takes the pointer loads. Needs Triton's global scratch
  allocator: set to a torch one on first use if none is set.
- heavy_first (causal): programs that visit the most blocks are scheduled first, so the short ones fill the last
  wave. The value is a section size: the (batch, head) pairs are taken heavy_first at a time, and within a section
  the programs go block rank by block rank across its pairs (all heaviest blocks, then all next heaviest, ...;
  `_block_and_pair`). 1 orders each pair on its own; a section of several pairs also keeps a pair's last, heavy
  programs from starting at the very end of the launch, while its pairs' tiles stay few enough to share the L2.
- split_d: a head dim D that is no power of two but D_LO + D_HI, D_LO the largest power of two below it and D_HI a
  power of two >= 16 (48 = 32 + 16, 80 = 64 + 16, 96 = 64 + 32; split_head_dim), is not zero-padded to the next
  power of two (48 -> 64 wastes a quarter of the products) but held as two column parts (Triton's blocks are powers
  of two): every [rows, D] tile as [rows, D_LO] and [rows, D_HI] tiles, Q K^T as two dots into one accumulator, P V
  into two. It loads through pointers whatever tma says: with two descriptors per tensor (blocks of D_LO and D_HI
  columns) the split forward took 14-25% longer on an H100 (four loads, each with its barrier, per key
  block). The dk/dv and dq kernels split the same way (BwdConfig.split_d, pointer loads): Q K^T and dO V^T as two
  dots into one result, dV += P^T dO, dK += dS^T Q and dQ += dS K as two dots into two accumulators, and the dq
  kernel's delta = rowsum(o * do) over both parts. The fused backward (short sequences) stays
  padded. Other head dims, and configs without it, take the padded kernels.
The 16-bit tables take tma at padded head dims 64 and 128 (not causal 64) and heavy_first at padded head dims 64
(sections of 16) and 128 (4), forward and backward, and split_d at padded head dim 64 in the forward and dq entries
(so head dim 48 splits there, and the forward entry's tma serves head dim 64 only).

Backward variants (BwdConfig, per head dim in CONFIGS_*["dkdv"] / ["dq"] and, for causal attention, ["dkdv_causal"] /
["dq_causal"]):
- tma: the same descriptors, under the same conditions (backward_variant; dO's strides too). The dk/dv kernel reads
  its K/V block once and streams Q/dO blocks through them, the dq kernel reads its Q/dO block once and streams K/V.
  Descriptors end where the pointer loads' masks do (Q/dO at Lq, the dk/dv kernel's K/V at Lk, the dq kernel's at
  key_lengths[b]), so both paths read the same tiles.
- lse_delta_tma (dk/dv kernel, on its descriptor path): lse and delta through 1-D descriptors too, where both are
  contiguous with 16-byte aligned (b, h) rows (Lq % 4 == 0; lse_delta_variant); else, and in the dq kernel, which
  loads them once per program, pointer loads. Through pointers each thread cp.asyncs 16 + 16 of a query block's 64
  values (the slice-of-MMA layout) with 64-bit addresses: at head dim 128 (sm_90, Triton 3.6) the dk/dv loop takes
  593 SASS instructions per block pair, 428 with descriptors. A length with Lq % 4 != 0 compiles the pointer variant
  (a second dk/dv kernel at that head dim).
- split_d: the head dim in two column parts, as in the forward (above); no descriptors, so lse and delta take the
  pointer loads.
The 16-bit dk/dv tables take tma with lse_delta_tma at padded head dims 32, 64 and 128 (at 32 with a register cap,
maxnreg); the dq tables none.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4: the scratch allocator of in-kernel tensor descriptors
    from triton.runtime import _allocation
except ImportError:
    _allocation = None

from ..buffers import empty
from ..launch_math import cdiv, next_power_of_2
from ..triton_launch import direct_launch
from . import dropout

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# --------------------------------------------------------------------------- configurations


class FwdConfig(NamedTuple):
    """A forward launch: tiles, warps, pipeline stages and the variant (see the module docstring)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    heavy_first: int = 0  # causal: a section size (see the module docstring); 0 keeps the launch order
    split_d: bool = False  # a head dim that splits (split_head_dim) held as two column parts, not padded
    maxnreg: int = 0  # registers per thread at most (more programs per SM, maybe spills); 0: the compiler's choice


class BwdConfig(NamedTuple):
    """A launch of the dk/dv or the dq kernel: tiles, warps, pipeline stages, whether the query/key tiles come
    through TMA descriptors and, in the dk/dv kernel where they do, lse and delta too (see the module docstring;
    the dq and fused kernels ignore lse_delta_tma)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    lse_delta_tma: bool = False
    heavy_first: int = 0  # as FwdConfig's, for the dk/dv and dq kernels
    split_d: bool = False  # as FwdConfig's, for the dk/dv and dq kernels (the fused kernel stays padded)
    maxnreg: int = 0  # as FwdConfig's


# A launch config (FwdConfig, BwdConfig) per kernel and padded head dim, for 16-bit inputs.
# BLOCK_M runs over queries and BLOCK_N over keys in every kernel. Chosen per kernel from a sweep
# on an H100 (bf16) at (256,4,256,16), (128,8,1024,32), (64,4,2048,48) and (4,16,4096,128);
# head dim 64 shares the 48 column (both pad to 64). Each kernel but the fused one has a table for causal attention
# apart.
# The forward's TMA entries come from a sweep on an H100 (bf16, GPU time), same tiles
# as the pointer entries they replace: "fwd"[128] 1.136 -> 0.983 ms at (4,16,4096,128) (cuDNN 0.865),
# "fwd_causal"[128] with heavy_first 0.664 -> 0.596 ms (cuDNN 0.486), "fwd"[64] 0.669 -> 0.659 ms at
# (64,4,2048,48). Kept on pointers: head dim 32 (TMA 0.535 against 0.480 ms at (128,8,1024,32)) and causal 64
# (TMA heavy 0.426 against 0.416 ms). TMA runs only where forward_variant allows it (compiled, Hopper on).
# The backward's TMA variants (H100, forward+backward ms) won only for dk/dv at
# head dim 64: 2.978 -> 2.890 at (64,4,2048,48) (cuDNN 2.241). Elsewhere pointers stay: at (4,16,4096,128) dk/dv TMA
# 5.123 against 5.083, dq 5.118 against 5.097 (cuDNN 3.637); at D <= 32 TMA is 5-25% slower.
# H100, forward+backward ms at (4,16,4096,128): dk/dv at head dim 128
# with tma and lse_delta_tma (lse and delta through descriptors too) 4.861 against 4.984 for the pointer entry (same
# tiles; 0.74x cuDNN), causal 2.755 against 2.799.
# Causal heavy-first sections (H100, bf16; the same section in the forward,
# dk/dv and dq entries; forward / forward+backward ms, launch order -> chosen section): 4x16x4096x128 0.593 / 2.837 ->
# 0.564 / 2.717 at 4 (per-pair heavy-first, the old forward entry: 0.590 / 2.824; 8 and 16 in between);
# 64x4x2048x48 0.417 / 1.752 -> 0.409 / 1.700 at 16; 128x8x1024x32 and 256x4x256x16 fastest in launch order
# (1.331 against 1.370-1.377, 0.136 against 0.138), so head dims 16 and 32 keep it.
# split_d at head dim 64's entries: head dim 48 as 32 + 16 columns (64x4x2048x48,
# H100, two runs, forward ms): 0.654-0.660 against the padded TMA entry's 0.664-0.670, causal 0.398-0.399
# against 0.406-0.411 (cuDNN 0.585 / 0.341). Head dim 64 itself does not split and keeps its tma.
# The backward at head dim 64's entries (64x4x2048x48, H100, forward +
# backward ms, causal / non-causal, cuDNN 1.376 / 2.245): dq split 1.570 / 2.894 against padded 1.608 / 2.976, so
# the dq entry splits. The dk/dv kernel split did worse than padded with lse and delta through descriptors too:
# 1.582 / 2.895 against 1.542 / 2.608 (the padded TMA entry it had: 1.651 / 2.793; split tiles that do not spill,
# 8 warps or 64 keys: 1.783-3.601). On sm_90 (Triton 3.6, head dim 48) the dk/dv kernel at these tiles spills
# either way (255 registers; 34 bytes with lse/delta descriptors, 304-328 padded TMA, 328-464 split). The entry's
# heavy_first=16 sections: 1.503 ms causal against 1.537 without (a second sweep).
# The dk/dv and dq tables split by causality. Head dim 32 (128x8x1024x32, H100,
# forward + backward ms, non-causal / causal; cuDNN 2.285 / 1.611): the dk/dv kernel
# with lse and delta through descriptors takes 217 registers (two programs of 4 warps per SM); capped at 168
# (maxnreg: three programs, 6-12 spilled bytes) it took 1.877 / 1.301 against 1.939 uncapped / 1.331 for the pointer
# entry causal had (128 registers: 2.883, 60 bytes spilled). The causal dq entry 64x32 took 1.312 against 128x32's
# 1.343; not causal 128x32 stays (1.935 against 1.959-2.024).
CONFIGS_16BIT = {
    "fwd": {
        16: FwdConfig(64, 64, 4, 3),
        32: FwdConfig(64, 64, 4, 3),
        64: FwdConfig(128, 64, 8, 4, tma=True, split_d=True),
        128: FwdConfig(128, 128, 8, 3, tma=True),
    },
    "fwd_causal": {
        16: FwdConfig(64, 64, 4, 3),
        32: FwdConfig(64, 64, 4, 3),
        64: FwdConfig(128, 64, 8, 4, heavy_first=16, split_d=True),
        128: FwdConfig(128, 128, 8, 3, tma=True, heavy_first=4),
    },
    "dkdv": {
        16: BwdConfig(32, 128, 4, 3),
        32: BwdConfig(32, 128, 4, 3, tma=True, lse_delta_tma=True, maxnreg=168),
        64: BwdConfig(32, 128, 4, 3, tma=True, lse_delta_tma=True),
        128: BwdConfig(64, 128, 8, 2, tma=True, lse_delta_tma=True),
    },
    "dkdv_causal": {
        16: BwdConfig(32, 128, 4, 3),
        32: BwdConfig(32, 128, 4, 3, tma=True, lse_delta_tma=True, maxnreg=168),
        64: BwdConfig(32, 128, 4, 3, tma=True, lse_delta_tma=True, heavy_first=16),
        128: BwdConfig(64, 128, 8, 2, tma=True, lse_delta_tma=True, heavy_first=4),
    },
    # one kernel for dq, dk and dv (_bwd_fused_kernel): used where every key fits one block (see use_fused)
    "fused": {
        16: BwdConfig(32, 256, 4, 1),
        32: BwdConfig(32, 128, 4, 2),  # not chosen by use_fused (see FUSED_HEAD_DIMS)
        64: BwdConfig(32, 128, 4, 2),
        128: BwdConfig(32, 128, 8, 2),
    },
    "dq": {
        16: BwdConfig(64, 64, 4, 3),
        32: BwdConfig(128, 32, 4, 4),
        64: BwdConfig(64, 64, 4, 3, split_d=True),
        128: BwdConfig(128, 64, 8, 3),
    },
    "dq_causal": {
        16: BwdConfig(64, 64, 4, 3),
        32: BwdConfig(64, 32, 4, 4),
        64: BwdConfig(64, 64, 4, 3, heavy_first=16, split_d=True),
        128: BwdConfig(128, 64, 8, 3, heavy_first=4),
    },
}
# fp32 runs exact fp32 products (tf32 would miss the fp32 accuracy bound) with fewer registers per tile
CONFIGS_FP32 = {
    "fwd": {d: FwdConfig(64, 32, 4, 2) for d in (16, 32, 64, 128)},
    "fwd_causal": {d: FwdConfig(64, 32, 4, 2) for d in (16, 32, 64, 128)},
    "dkdv": {d: BwdConfig(32, 64, 4, 2) for d in (16, 32, 64, 128)},
    "dkdv_causal": {d: BwdConfig(32, 64, 4, 2) for d in (16, 32, 64, 128)},
    "dq": {d: BwdConfig(64, 32, 4, 2) for d in (16, 32, 64, 128)},
    "dq_causal": {d: BwdConfig(64, 32, 4, 2) for d in (16, 32, 64, 128)},
    "fused": {d: BwdConfig(32, 64, 4, 2) for d in (16, 32, 64, 128)},
}
FUSED_MIN_PROGRAMS = 264  # (batch, kv head) pairs for the fused backward: two programs per SM of an H100
# Padded head dims where use_fused may pick the fused backward. Sweep (H100,
# forward+backward ms, fused against split): 256x4x256x16 0.131 / 0.159, causal 0.136 / 0.152; 256x4x128x64 causal
# 0.124 / 0.169; 128x4x128x128 causal 0.132 / 0.170. Not 32: 256x4x256x32 0.228 / 0.202 (dq added with atomics
# over two key blocks: 0.217 / 0.202, causal 0.193 / 0.192). Longer keys (atomics): 128x8x1024x32 causal 1.407 /
# 1.370, 64x4x2048x48 causal 2.015 / 1.79: the split kernels stay. (The dq kernel's programs in heavy-first order
# were tried too at 128x8x1024x32 causal: 1.386 against 1.369 ms, not kept.)
FUSED_HEAD_DIMS = frozenset({16, 64, 128})
BACKWARDS = ("fused", "split")  # backward's `kind`; None lets use_fused choose


def block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """(D_LO, D_HI) of a head dim the kernels can hold as two column parts (split_d): one that is no power
    of two, D_LO the largest power of two below it and D_HI = head_dim - D_LO a power of two >= 16 (48 = 32 + 16,
    80 = 64 + 16, 96 = 64 + 32); any other: (block_d(head_dim), 0), one zero-padded part."""
    lo = next_power_of_2(head_dim) // 2
    hi = head_dim - lo
    if head_dim & (head_dim - 1) and hi >= 16 and hi & (hi - 1) == 0:
        return lo, hi
    return block_d(head_dim), 0


def config(kind: str, head_dim: int, dtype: torch.dtype) -> tuple:
    table = CONFIGS_FP32 if dtype == torch.float32 else CONFIGS_16BIT
    return table[kind][block_d(head_dim)]


def launch_options(cfg) -> dict:
    """Triton's launch options of a FwdConfig or BwdConfig: warps, stages and, where the config caps it, maxnreg."""
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return options | {"maxnreg": cfg.maxnreg} if cfg.maxnreg else options


def backward_kind(kind: str, causal: bool) -> str:
    """The table of the "dkdv" or "dq" kernel: causal attention has its own."""
    return kind + "_causal" if causal else kind


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """TMA hardware (Hopper on) and a Triton with device-side tensor descriptors (3.4 on)."""
    descriptors = _allocation is not None and hasattr(tl, "make_tensor_descriptor")
    return descriptors and torch.cuda.get_device_capability(device) >= (9, 0)


def _tma_layout(x: torch.Tensor) -> bool:
    """Whether a [B, H, L, D] view can be read through per-(batch, head) [L, D] descriptors: a 16-byte aligned
    base for every (b, h) and row stride, rows apart (not expanded: an upstream gradient can be), and a contiguous
    head dim."""
    step = 16 // x.element_size()
    b, h, _, _ = x.shape
    sb, sh, sl, sd = x.stride()
    return (
        x.data_ptr() % 16 == 0 and sd == 1 and sl % step == 0 and sl > 0
        and (b == 1 or sb % step == 0) and (h == 1 or sh % step == 0)
    )  # fmt: skip


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # on the current device and stream, as the launch; torch's blocks are 512-byte aligned
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """Compiled kernels that make tensor descriptors need Triton's global scratch allocator (a context variable: per
    thread); set a torch one where none is set, never replacing one the user set (nothing under the interpreter)."""
    if _fwd_kernel.direct and isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


# --------------------------------------------------------------------------- shared pieces


_MIX_A, _MIX_B = tl.constexpr(dropout.MIX_A), tl.constexpr(dropout.MIX_B)
_PAIR_MUL = tl.constexpr(dropout.PAIR_MUL)
_QUERY_BLOCK_MUL, _KEY_BLOCK_MUL = tl.constexpr(dropout.QUERY_BLOCK_MUL), tl.constexpr(dropout.KEY_BLOCK_MUL)
_QUERY_BLOCK_SHIFT, _KEY_BLOCK_SHIFT = tl.constexpr(dropout.QUERY_BLOCK_SHIFT), tl.constexpr(dropout.KEY_BLOCK_SHIFT)
_DROP_SCALE = tl.constexpr(float(1 << dropout.BITS))


@triton.jit
def _mix32(x):
    """lowbias32 of uint32 values"""
    x ^= x >> 16
    x *= _MIX_A
    x ^= x >> 15
    x *= _MIX_B
    return x ^ (x >> 16)


# dropout.py's hash. A kernel folds the block of its program's fixed tile (queries in the forward and dq kernels,
# keys in the dk/dv ones) into the pair's key once (drop_seed = _pair_key ^ that block's term); each tile's key is
# then _mix32(drop_seed ^ the other block's term).
@triton.jit
def _pair_key(seed, bh):
    return _mix32(seed.to(tl.uint32) ^ (bh.to(tl.uint32) * _PAIR_MUL))


@triton.jit
def _query_block(start_m):
    """The key's term for the block of 2^16 queries holding query start_m"""
    return (tl.cast(start_m, tl.uint32) >> _QUERY_BLOCK_SHIFT) * _QUERY_BLOCK_MUL


@triton.jit
def _key_block(start_n):
    """The key's term for the block of 2^17 keys holding key start_n"""
    return (tl.cast(start_n, tl.uint32) >> _KEY_BLOCK_SHIFT) * _KEY_BLOCK_MUL


@triton.jit
def _keep(tile_key, offs_i, offs_j, dropout_p):
    """Dropout keep mask for queries offs_i x keys offs_j (broadcast shapes) of one tile. Keys j and j ^ 8 share
    one round (the compiler computes it once: both are in one thread). dropout_p: dropout.drop_rate's
    (dropout_p * 2^16 is the exact threshold)."""
    pair_index = (((offs_j >> 4) << 3) | (offs_j & 7)) & 0xFFFF
    h = _mix32(tile_key ^ (offs_i.to(tl.uint32) << 16) ^ pair_index.to(tl.uint32))
    bits = tl.where((offs_j & 8) != 0, h >> 16, h & 0xFFFF)
    return bits >= tl.cast(dropout_p * _DROP_SCALE, tl.uint32)


@triton.jit
def _load(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a [rows, BLOCK_D] tile, zero outside the rows < n_rows and the head dim."""
    if CHECK_ROWS:
        if PAD_D:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if PAD_D:
            return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _store(ptrs, value, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr):
    if PAD_D:
        tl.store(ptrs, value, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(ptrs, value, mask=rows[:, None] < n_rows)


@triton.jit
def _rows_src(
    X,
    b,
    h,
    sb,
    sh,
    s_row,
    s_d,
    n_rows,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TMA: tl.constexpr,
):
    """Where _tile reads the [n_rows, HEAD_DIM] matrix of (b, h) of a [B, H, L, D] input from: a TMA descriptor of
    [BLOCK_R, BLOCK_D] tiles ending at n_rows rows and HEAD_DIM columns (the hardware zero-fills past them; the head
    dim must be contiguous), or the pointers of rows offs_r (for _tile: the tile at row 0, arange(0, BLOCK_R))."""
    base = X + b.to(tl.int64) * sb + h.to(tl.int64) * sh
    if TMA:
        return tl.make_tensor_descriptor(base, [n_rows, HEAD_DIM], [s_row, 1], [BLOCK_R, BLOCK_D])
    else:
        return base + offs_r[:, None] * s_row + offs_d[None, :] * s_d


@triton.jit
def _tile(
    src,
    start,
    s_row,
    n_rows,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Rows start + offs_r of a _rows_src source, zero past the head dim and at rows >= n_rows (pointers: where
    CHECK_ROWS; a descriptor: past the rows it was made with)."""
    if TMA:
        return src.load([start, 0])
    else:
        return _load(src + start * s_row, start + offs_r, n_rows, offs_d, HEAD_DIM, PAD_D, CHECK_ROWS)


@triton.jit
def _tile_once(
    X,
    b,
    h,
    sb,
    sh,
    s_row,
    s_d,
    start,
    n_rows,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAD_D: tl.constexpr,
    TMA: tl.constexpr,
):
    """The tile at rows start + offs_r of a matrix a program reads one tile of: through a descriptor of its own, or
    pointers made at those rows (the pointer path's code as it was before descriptors: the same registers)."""
    if TMA:
        src = _rows_src(X, b, h, sb, sh, s_row, s_d, n_rows, offs_r, offs_d, HEAD_DIM, BLOCK_R, BLOCK_D, TMA)
        return src.load([start, 0])
    else:
        rows = start + offs_r
        src = _rows_src(X, b, h, sb, sh, s_row, s_d, n_rows, rows, offs_d, HEAD_DIM, BLOCK_R, BLOCK_D, TMA)
        return _load(src, rows, n_rows, offs_d, HEAD_DIM, PAD_D, True)


@triton.jit
def _block_and_pair(SECTION: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """(block, pair) of this program on a (blocks, pairs) grid. SECTION 0: the launch order. Else heavy-first (see the
    module docstring): the launch order runs through sections of SECTION pairs, and within a section through the
    block ranks, heaviest first, each across the section's pairs. HEAVY_LAST: block n_blocks - 1 is the heaviest (the
    forward's and the dq kernel's query blocks), else block 0 (the dk/dv kernel's key blocks)."""
    if SECTION == 0:
        block, pair = tl.program_id(0), tl.program_id(1)
    else:
        n_blocks = tl.num_programs(0)
        launched = tl.program_id(1) * n_blocks + tl.program_id(0)  # the hardware starts programs in this order
        first_pair = launched // (SECTION * n_blocks) * SECTION
        pairs = tl.minimum(SECTION, tl.num_programs(1) - first_pair)  # the last section may hold fewer
        within = launched - first_pair * n_blocks
        rank = within // pairs
        block = n_blocks - 1 - rank if HEAVY_LAST else rank
        pair = first_pair + within % pairs
    return block, pair


@triton.jit
def _sequence(CU_Q, CU_K, KL, b, LQ, LK, HAS_KL: tl.constexpr, VARLEN: tl.constexpr):
    """(query rows, visible keys, first query row, first key row) of batch row or sequence b.

    Padded batches: LQ rows, LK keys or key_lengths[b]. VARLEN (packed sequences): b is a sequence of
    cu_seqlens_q/_k, rows CU[b]:CU[b + 1] of the packed [total, heads, D] inputs (passed with a batch stride of 0,
    LQ = total_q, LK = total_k); the kernels move their row pointers to the sequence's first rows (int64 offsets)."""
    if VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        k_start = tl.load(CU_K + b).to(tl.int64)
        lq = (tl.load(CU_Q + b + 1) - q_start).to(tl.int32)
        kv_len = (tl.load(CU_K + b + 1) - k_start).to(tl.int32)
    else:
        q_start = tl.full([], 0, tl.int64)
        k_start = q_start
        lq = LQ
        kv_len = LK
        if HAS_KL:
            kv_len = tl.load(KL + b)
    return lq, kv_len, q_start, k_start


@triton.jit
def _lse_row(b, h, H, LQ, q_start, VARLEN: tl.constexpr):
    """Where the lse (and delta) values of (b, h) start: [B, H, LQ] for padded batches, [H, total_q] packed."""
    if VARLEN:
        return h.to(tl.int64) * LQ + q_start
    else:
        return (b * H + h).to(tl.int64) * LQ


# --------------------------------------------------------------------------- forward


@triton.jit
def _fwd_block(
    acc,
    acc_hi,
    l_i,
    m_i,
    q,
    q_hi,
    k_src,
    k_hi_src,
    v_src,
    v_hi_src,
    start_n,
    offs_m,
    offs_n,
    offs_d,
    offs_hi,
    kv_len,
    skn,
    svn,
    qk_scale,
    dropout_p,
    drop_seed,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    D_HI: tl.constexpr,
):
    """One key block into the online softmax; k_src/v_src: _rows_src sources of kv_len rows. D_HI > 0: the head
    dim's second column part too (the *_hi tiles, sources and offs_hi: see _fwd_kernel); else those are not read."""
    cols = start_n + offs_n
    k = _tile(k_src, start_n, skn, kv_len, offs_n, offs_d, HEAD_DIM, PAD_D, MASK, TMA)
    v = _tile(v_src, start_n, svn, kv_len, offs_n, offs_d, HEAD_DIM, PAD_D, MASK, TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if D_HI > 0:
        k_hi = _tile(k_hi_src, start_n, skn, kv_len, offs_n, offs_hi, HEAD_DIM, PAD_D, MASK, False)
        qk = tl.dot(q_hi, tl.trans(k_hi), qk, input_precision=DOT_PRECISION)
    if MASK:
        visible = cols[None, :] < kv_len
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        qk = tl.where(visible, qk, float("-inf"))
    # m_i starts finite (-1e30), so a row masked so far gets p = exp2(-inf) = 0, never NaN
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if D_HI > 0:
        acc_hi = acc_hi * alpha[:, None]
    if DROPOUT:
        keep = _keep(_mix32(drop_seed ^ _key_block(start_n)), offs_m[:, None], cols[None, :], dropout_p)
        p = tl.where(keep, p, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    if D_HI > 0:
        v_hi = _tile(v_hi_src, start_n, svn, kv_len, offs_n, offs_hi, HEAD_DIM, PAD_D, MASK, False)
        acc_hi = tl.dot(p.to(v.dtype), v_hi, acc_hi, input_precision=DOT_PRECISION)
    return acc, acc_hi, l_i, m_new


@direct_launch
@triton.jit(do_not_specialize=["H", "GROUP", "LQ", "LK"])
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    KL,
    CU_Q,
    CU_K,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sob,
    soh,
    som,
    H,
    GROUP,
    LQ,
    LK,
    qk_scale,
    dropout_p,
    SEED,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    D_HI: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """One query block. D_HI > 0 (split_d): every [rows, HEAD_DIM] tile is held as two column parts, [0, BLOCK_D)
    and [BLOCK_D, HEAD_DIM) of D_HI columns (powers of two both, HEAD_DIM = BLOCK_D + D_HI), read through pointers;
    D_HI = 0: one part of BLOCK_D columns, zero past HEAD_DIM. VARLEN: see _sequence."""
    tl.static_assert(D_HI == 0 or not TMA, "the split head dim loads through pointers")
    tl.static_assert(not (VARLEN and TMA), "packed sequences load through pointers")
    PAD_D: tl.constexpr = BLOCK_D + D_HI != HEAD_DIM
    block, bh = _block_and_pair(HEAVY_FIRST, True)
    start_m = block * BLOCK_M
    b = bh // H
    h = bh % H
    hk = h // GROUP
    lq, kv_len, q_start, k_start = _sequence(CU_Q, CU_K, KL, b, LQ, LK, HAS_KL, VARLEN)
    lse_row = _lse_row(b, h, H, LQ, q_start, VARLEN)
    if VARLEN:
        Q += q_start * sqm
        O += q_start * som
        K += k_start * skn
        V += k_start * svn
        kv_len = tl.where(start_m < lq, kv_len, 0)  # a block past its sequence's queries visits no key
    drop_seed = _pair_key(tl.load(SEED), bh) ^ _query_block(start_m) if DROPOUT else 0
    offs_i = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_i
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q = _tile_once(Q, b, h, sqb, sqh, sqm, sqd, start_m, lq, offs_i, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, PAD_D, TMA)
    # K/V of kv_len rows (descriptors: at least one, a program with kv_len = 0 loads nothing through them)
    kv_rows = tl.maximum(kv_len, 1)
    k_src = _rows_src(K, b, hk, skb, skh, skn, skd, kv_rows, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_src = _rows_src(V, b, hk, svb, svh, svn, svd, kv_rows, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    # blocks below n_full are visible to every row of this program; blocks up to n_end need the mask
    if CAUSAL:
        n_end = tl.minimum(kv_len, start_m + BLOCK_M)
        n_full = (tl.minimum(kv_len, start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        n_end = kv_len
        n_full = (kv_len // BLOCK_N) * BLOCK_N

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if D_HI > 0:  # the second part: columns BLOCK_D + offs_hi
        offs_hi = BLOCK_D + tl.arange(0, D_HI)
        q_hi = _tile_once(
            Q, b, h, sqb, sqh, sqm, sqd, start_m, lq, offs_i, offs_hi, HEAD_DIM, BLOCK_M, D_HI, PAD_D, False
        )
        k_hi_src = _rows_src(K, b, hk, skb, skh, skn, skd, kv_rows, offs_n, offs_hi, HEAD_DIM, BLOCK_N, D_HI, False)
        v_hi_src = _rows_src(V, b, hk, svb, svh, svn, svd, kv_rows, offs_n, offs_hi, HEAD_DIM, BLOCK_N, D_HI, False)
        acc_hi = tl.zeros([BLOCK_M, D_HI], dtype=tl.float32)
    else:  # one part: stand-ins, never read (the loops carry acc_hi unchanged, which the compiler drops)
        offs_hi, q_hi, k_hi_src, v_hi_src, acc_hi = offs_d, q, k_src, v_src, acc
    for start_n in range(0, n_full, BLOCK_N):
        acc, acc_hi, l_i, m_i = _fwd_block(
            acc,
            acc_hi,
            l_i,
            m_i,
            q,
            q_hi,
            k_src,
            k_hi_src,
            v_src,
            v_hi_src,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            offs_hi,
            kv_len,
            skn,
            svn,
            qk_scale,
            dropout_p,
            drop_seed,
            HEAD_DIM,
            PAD_D,
            False,
            CAUSAL,
            DROPOUT,
            DOT_PRECISION,
            TMA,
            D_HI,
        )
    for start_n in range(n_full, n_end, BLOCK_N):
        acc, acc_hi, l_i, m_i = _fwd_block(
            acc,
            acc_hi,
            l_i,
            m_i,
            q,
            q_hi,
            k_src,
            k_hi_src,
            v_src,
            v_hi_src,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            offs_hi,
            kv_len,
            skn,
            svn,
            qk_scale,
            dropout_p,
            drop_seed,
            HEAD_DIM,
            PAD_D,
            True,
            CAUSAL,
            DROPOUT,
            DOT_PRECISION,
            TMA,
            D_HI,
        )

    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    inv_l = 1.0 / l_safe
    if DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty_row, float("inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_rows = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * som
    _store(o_rows + offs_d[None, :], out.to(O.dtype.element_ty), offs_m, lq, offs_d, HEAD_DIM, PAD_D)
    if D_HI > 0:
        out_hi = acc_hi * inv_l[:, None]
        _store(o_rows + offs_hi[None, :], out_hi.to(O.dtype.element_ty), offs_m, lq, offs_hi, HEAD_DIM, PAD_D)
    tl.store(LSE + lse_row + offs_m, lse, mask=offs_m < lq)


# --------------------------------------------------------------------------- backward


@triton.jit
def _store_delta(
    O,
    DELTA,
    do,
    do_hi,
    b,
    h,
    delta_row,
    sob,
    soh,
    som,
    offs_m,
    LQ,
    offs_d,
    offs_hi,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    D_HI: tl.constexpr,
):
    """Stores and returns delta = rowsum(o * do) (fp32) of the query rows offs_m, for the do tile of those rows (and,
    where D_HI > 0, its second column part do_hi at columns offs_hi)."""
    o_rows = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * som
    o = _load(o_rows + offs_d[None, :], offs_m, LQ, offs_d, HEAD_DIM, PAD_D, True).to(tl.float32)
    delta = tl.sum(o * do.to(tl.float32), 1)
    if D_HI > 0:
        o_hi = _load(o_rows + offs_hi[None, :], offs_m, LQ, offs_hi, HEAD_DIM, PAD_D, True).to(tl.float32)
        delta += tl.sum(o_hi * do_hi.to(tl.float32), 1)
    tl.store(DELTA + delta_row + offs_m, delta, mask=offs_m < LQ)
    return delta


@triton.jit
def _query_blocks(start_n, kv_len, LQ, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(m_lo, m_full) for the key block at start_n: its query blocks start at m_lo; those below m_full straddle the
    causal diagonal and need the mask, and all of them do when the key block straddles kv_len."""
    if CAUSAL:
        m_lo = (start_n // BLOCK_M) * BLOCK_M
        m_full = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
    else:
        m_lo = 0
        m_full = LQ * 0
    if start_n + BLOCK_N > kv_len:
        m_full = LQ
    return m_lo, m_full


@triton.jit
def _store_dkdv(
    DK,
    DV,
    dk,
    dv,
    b,
    hk,
    sdkb,
    sdkh,
    sdkn,
    sdvb,
    sdvh,
    sdvn,
    offs_n,
    offs_d,
    LK,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
):
    dk_ptrs = DK + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + offs_n[:, None] * sdkn + offs_d[None, :]
    dv_ptrs = DV + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh + offs_n[:, None] * sdvn + offs_d[None, :]
    _store(dk_ptrs, dk.to(DK.dtype.element_ty), offs_n, LK, offs_d, HEAD_DIM, PAD_D)
    _store(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, LK, offs_d, HEAD_DIM, PAD_D)


@triton.jit
def _dkdv_block(
    dk,
    dk_hi,
    dv,
    dv_hi,
    k,
    k_hi,
    v,
    v_hi,
    q_src,
    q_hi_src,
    do_src,
    do_hi_src,
    lse_src,
    delta_src,
    start_m,
    offs_m,
    offs_n,
    offs_d,
    offs_hi,
    kv_len,
    LQ,
    sqm,
    sdom,
    qk_scale,
    dropout_p,
    drop_seed,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    LSE_DELTA_TMA: tl.constexpr,
    D_HI: tl.constexpr,
):
    """Accumulate one query block into dk, dv of this key block, in transposed form ([keys, queries]);
    q_src/do_src: _rows_src sources of LQ rows; lse_src/delta_src: 1-D descriptors of LQ values where
    LSE_DELTA_TMA, else the (b, h) base pointers. D_HI > 0: the head dim's second column part too (the *_hi tiles,
    sources and accumulators, offs_hi: see _bwd_dkdv_kernel); else those are not read."""
    rows = start_m + offs_m
    q = _tile(q_src, start_m, sqm, LQ, offs_m, offs_d, HEAD_DIM, PAD_D, True, TMA)
    do = _tile(do_src, start_m, sdom, LQ, offs_m, offs_d, HEAD_DIM, PAD_D, True, TMA)
    if D_HI > 0:
        q_hi = _tile(q_hi_src, start_m, sqm, LQ, offs_m, offs_hi, HEAD_DIM, PAD_D, True, False)
        do_hi = _tile(do_hi_src, start_m, sdom, LQ, offs_m, offs_hi, HEAD_DIM, PAD_D, True, False)
    else:  # stand-ins, never read
        q_hi, do_hi = q, do
    if LSE_DELTA_TMA:
        delta = delta_src.load([start_m])
    else:
        delta = tl.load(delta_src + rows, mask=rows < LQ, other=0.0)
    dv, dv_hi, ds_t = _dv_and_ds_t(
        dv,
        dv_hi,
        k,
        k_hi,
        v,
        v_hi,
        q,
        q_hi,
        do,
        do_hi,
        lse_src,
        delta,
        rows,
        offs_n,
        kv_len,
        LQ,
        start_m,
        qk_scale,
        dropout_p,
        drop_seed,
        MASK,
        CAUSAL,
        DROPOUT,
        DOT_PRECISION,
        LSE_DELTA_TMA,
        D_HI,
    )
    ds_t = ds_t.to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    if D_HI > 0:
        dk_hi = tl.dot(ds_t, q_hi, dk_hi, input_precision=DOT_PRECISION)
    return dk, dk_hi, dv, dv_hi


@triton.jit
def _dv_and_ds_t(
    dv,
    dv_hi,
    k,
    k_hi,
    v,
    v_hi,
    q,
    q_hi,
    do,
    do_hi,
    lse_src,
    delta,
    rows,
    offs_n,
    kv_len,
    LQ,
    start_m,
    qk_scale,
    dropout_p,
    drop_seed,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LSE_DELTA_TMA: tl.constexpr,
    D_HI: tl.constexpr,
):
    """For a key block and the query rows `rows` (from start_m), in transposed form ([keys, queries]): dv plus P^T dO
    (P after dropout), and dS^T = P^T * (dP^T - delta) in fp32. lse_src: the (b, h) row of lse, a descriptor where
    LSE_DELTA_TMA (q and do then come through descriptors too), else a pointer. D_HI > 0: the products over the head
    dim take the second column parts (k_hi, v_hi, q_hi, do_hi) too and dv_hi gets P^T dO_hi; else dv_hi is returned
    as given."""
    if LSE_DELTA_TMA:
        # zeros past LQ (not lse = +inf): such a row's q and do are zeros too (descriptor loads), so its column of
        # P^T (exp2(0) = 1) meets zeros in every product and adds nothing
        lse = lse_src.load([start_m]) * 1.4426950408889634
    else:
        # rows past LQ load lse = +inf, so their probabilities are 0
        lse = tl.load(lse_src + rows, mask=rows < LQ, other=float("inf")) * 1.4426950408889634
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    if D_HI > 0:
        qk_t = tl.dot(k_hi, tl.trans(q_hi), qk_t, input_precision=DOT_PRECISION)
    p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
    if MASK:
        visible = offs_n[:, None] < kv_len
        if CAUSAL:
            visible = visible & (rows[None, :] >= offs_n[:, None])
        p_t = tl.where(visible, p_t, 0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if D_HI > 0:
        dp_t = tl.dot(v_hi, tl.trans(do_hi), dp_t, input_precision=DOT_PRECISION)
    if DROPOUT:
        keep = _keep(_mix32(drop_seed ^ _query_block(start_m)), rows[None, :], offs_n[:, None], dropout_p)
        inv_keep = 1.0 / (1.0 - dropout_p)
        p_kept_t = tl.where(keep, p_t * inv_keep, 0.0).to(do.dtype)
        dv = tl.dot(p_kept_t, do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.where(keep, dp_t * inv_keep, 0.0)
    else:
        p_kept_t = p_t.to(do.dtype)
        dv = tl.dot(p_kept_t, do, dv, input_precision=DOT_PRECISION)
    if D_HI > 0:
        dv_hi = tl.dot(p_kept_t, do_hi, dv_hi, input_precision=DOT_PRECISION)
    return dv, dv_hi, p_t * (dp_t - delta[None, :])


@direct_launch
@triton.jit(do_not_specialize=["H", "HKV", "GROUP", "LQ", "LK"])
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    KL,
    CU_Q,
    CU_K,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdob,
    sdoh,
    sdom,
    sdod,
    sdkb,
    sdkh,
    sdkn,
    sdvb,
    sdvh,
    sdvn,
    H,
    HKV,
    GROUP,
    LQ,
    LK,
    qk_scale,
    sm_scale,
    dropout_p,
    SEED,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    LSE_DELTA_TMA: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    D_HI: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """dk, dv of one key block. LSE_DELTA_TMA (only with TMA): lse and delta through 1-D descriptors too. D_HI > 0
    (split_d): every [rows, HEAD_DIM] tile in two column parts, as in _fwd_kernel, read through pointers. VARLEN: see
    _sequence; a key block past its sequence's keys writes nothing."""
    tl.static_assert(D_HI == 0 or not TMA, "the split head dim loads through pointers")
    tl.static_assert(not (VARLEN and TMA), "packed sequences load through pointers")
    PAD_D: tl.constexpr = BLOCK_D + D_HI != HEAD_DIM
    block, bhk = _block_and_pair(HEAVY_FIRST, False)
    start_n = block * BLOCK_N
    b = bhk // HKV
    hk = bhk % HKV
    lq, kv_len, q_start, k_start = _sequence(CU_Q, CU_K, KL, b, LQ, LK, HAS_KL, VARLEN)
    n_keys = LK  # the rows of K/V/dK/dV this program may read and write
    if VARLEN:
        Q += q_start * sqm
        DO += q_start * sdom
        K += k_start * skn
        V += k_start * svn
        DK += k_start * sdkn
        DV += k_start * sdvn
        n_keys = kv_len
    offs_j = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_j
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    if TMA:  # both descriptors, then both loads: fewer spills on sm_90 (280 bytes at head dim 128, against 312)
        k_src = _rows_src(K, b, hk, skb, skh, skn, skd, n_keys, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
        v_src = _rows_src(V, b, hk, svb, svh, svn, svd, n_keys, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
        k = _tile(k_src, start_n, skn, n_keys, offs_j, offs_d, HEAD_DIM, PAD_D, True, TMA)
        v = _tile(v_src, start_n, svn, n_keys, offs_j, offs_d, HEAD_DIM, PAD_D, True, TMA)
    else:
        k = _tile_once(
            K, b, hk, skb, skh, skn, skd, start_n, n_keys, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, PAD_D, TMA
        )
        v = _tile_once(
            V, b, hk, svb, svh, svn, svd, start_n, n_keys, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, PAD_D, TMA
        )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if D_HI > 0:  # the second part: columns BLOCK_D + offs_hi
        offs_hi = BLOCK_D + tl.arange(0, D_HI)
        k_hi = _tile_once(
            K, b, hk, skb, skh, skn, skd, start_n, n_keys, offs_j, offs_hi, HEAD_DIM, BLOCK_N, D_HI, PAD_D, False
        )
        v_hi = _tile_once(
            V, b, hk, svb, svh, svn, svd, start_n, n_keys, offs_j, offs_hi, HEAD_DIM, BLOCK_N, D_HI, PAD_D, False
        )
        dk_hi = tl.zeros([BLOCK_N, D_HI], dtype=tl.float32)
        dv_hi = tl.zeros([BLOCK_N, D_HI], dtype=tl.float32)
    else:  # one part: stand-ins, never read (the loops carry dk_hi and dv_hi unchanged, which the compiler drops)
        offs_hi, k_hi, v_hi, dk_hi, dv_hi = offs_d, k, v, dk, dv

    m_lo, m_full = _query_blocks(start_n, kv_len, lq, BLOCK_M, BLOCK_N, CAUSAL)
    if start_n < kv_len:  # a block wholly past kv_len gets dk = dv = 0
        for g in range(0, GROUP):
            h = hk * GROUP + g
            bh = b * H + h
            drop_seed = _pair_key(tl.load(SEED), bh) ^ _key_block(start_n) if DROPOUT else 0
            q_src = _rows_src(Q, b, h, sqb, sqh, sqm, sqd, lq, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
            do_src = _rows_src(DO, b, h, sdob, sdoh, sdom, sdod, lq, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
            if D_HI > 0:
                q_hi_src = _rows_src(Q, b, h, sqb, sqh, sqm, sqd, lq, offs_m, offs_hi, HEAD_DIM, BLOCK_M, D_HI, False)
                do_hi_src = _rows_src(
                    DO, b, h, sdob, sdoh, sdom, sdod, lq, offs_m, offs_hi, HEAD_DIM, BLOCK_M, D_HI, False
                )
            else:  # stand-ins, never read
                q_hi_src, do_hi_src = q_src, do_src
            lse_row = _lse_row(b, h, H, LQ, q_start, VARLEN)
            lse_src = LSE + lse_row
            delta_src = DELTA + lse_row
            if LSE_DELTA_TMA:
                lse_src = tl.make_tensor_descriptor(lse_src, [lq], [1], [BLOCK_M])
                delta_src = tl.make_tensor_descriptor(delta_src, [lq], [1], [BLOCK_M])
            for start_m in range(m_lo, tl.minimum(m_full, lq), BLOCK_M):
                dk, dk_hi, dv, dv_hi = _dkdv_block(
                    dk,
                    dk_hi,
                    dv,
                    dv_hi,
                    k,
                    k_hi,
                    v,
                    v_hi,
                    q_src,
                    q_hi_src,
                    do_src,
                    do_hi_src,
                    lse_src,
                    delta_src,
                    start_m,
                    offs_m,
                    offs_n,
                    offs_d,
                    offs_hi,
                    kv_len,
                    lq,
                    sqm,
                    sdom,
                    qk_scale,
                    dropout_p,
                    drop_seed,
                    HEAD_DIM,
                    PAD_D,
                    True,
                    CAUSAL,
                    DROPOUT,
                    DOT_PRECISION,
                    TMA,
                    LSE_DELTA_TMA,
                    D_HI,
                )
            for start_m in range(tl.maximum(m_full, m_lo), lq, BLOCK_M):
                dk, dk_hi, dv, dv_hi = _dkdv_block(
                    dk,
                    dk_hi,
                    dv,
                    dv_hi,
                    k,
                    k_hi,
                    v,
                    v_hi,
                    q_src,
                    q_hi_src,
                    do_src,
                    do_hi_src,
                    lse_src,
                    delta_src,
                    start_m,
                    offs_m,
                    offs_n,
                    offs_d,
                    offs_hi,
                    kv_len,
                    lq,
                    sqm,
                    sdom,
                    qk_scale,
                    dropout_p,
                    drop_seed,
                    HEAD_DIM,
                    PAD_D,
                    False,
                    CAUSAL,
                    DROPOUT,
                    DOT_PRECISION,
                    TMA,
                    LSE_DELTA_TMA,
                    D_HI,
                )
    _store_dkdv(
        DK, DV, dk * sm_scale, dv, b, hk, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, offs_n, offs_d, n_keys, HEAD_DIM, PAD_D
    )
    if D_HI > 0:
        _store_dkdv(
            DK,
            DV,
            dk_hi * sm_scale,
            dv_hi,
            b,
            hk,
            sdkb,
            sdkh,
            sdkn,
            sdvb,
            sdvh,
            sdvn,
            offs_n,
            offs_hi,
            n_keys,
            HEAD_DIM,
            PAD_D,
        )


@triton.jit
def _dq_block(
    dq,
    dq_hi,
    q,
    q_hi,
    do,
    do_hi,
    lse,
    delta,
    k_src,
    k_hi_src,
    v_src,
    v_hi_src,
    start_n,
    offs_m,
    offs_n,
    offs_d,
    offs_hi,
    kv_len,
    skn,
    svn,
    qk_scale,
    dropout_p,
    drop_seed,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    D_HI: tl.constexpr,
):
    """One key block into dq; k_src/v_src: _rows_src sources of kv_len rows. D_HI > 0: the head dim's second column
    part too (the *_hi tiles, sources and accumulator, offs_hi: see _bwd_dq_kernel); else those are not read."""
    cols = start_n + offs_n
    k = _tile(k_src, start_n, skn, kv_len, offs_n, offs_d, HEAD_DIM, PAD_D, MASK, TMA)
    v = _tile(v_src, start_n, svn, kv_len, offs_n, offs_d, HEAD_DIM, PAD_D, MASK, TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if D_HI > 0:
        k_hi = _tile(k_hi_src, start_n, skn, kv_len, offs_n, offs_hi, HEAD_DIM, PAD_D, MASK, False)
        qk = tl.dot(q_hi, tl.trans(k_hi), qk, input_precision=DOT_PRECISION)
    p = tl.math.exp2(qk * qk_scale - lse[:, None])
    if MASK:
        visible = cols[None, :] < kv_len
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if D_HI > 0:
        v_hi = _tile(v_hi_src, start_n, svn, kv_len, offs_n, offs_hi, HEAD_DIM, PAD_D, MASK, False)
        dp = tl.dot(do_hi, tl.trans(v_hi), dp, input_precision=DOT_PRECISION)
    if DROPOUT:
        keep = _keep(_mix32(drop_seed ^ _key_block(start_n)), offs_m[:, None], cols[None, :], dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = (p * (dp - delta[:, None])).to(k.dtype)
    dq = tl.dot(ds, k, dq, input_precision=DOT_PRECISION)
    if D_HI > 0:
        dq_hi = tl.dot(ds, k_hi, dq_hi, input_precision=DOT_PRECISION)
    return dq, dq_hi


@direct_launch
@triton.jit(do_not_specialize=["H", "GROUP", "LQ", "LK"])
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    KL,
    O,
    CU_Q,
    CU_K,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdob,
    sdoh,
    sdom,
    sdod,
    sdqb,
    sdqh,
    sdqm,
    sob,
    soh,
    som,
    H,
    GROUP,
    LQ,
    LK,
    qk_scale,
    sm_scale,
    dropout_p,
    SEED,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    WRITE_DELTA: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    D_HI: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """dq of one query block. WRITE_DELTA: the block's delta = rowsum(o * do) is computed here (o read once, do
    already loaded) and stored for the dk/dv kernel, which then runs after this one: no launch of its own. D_HI > 0
    (split_d): every [rows, HEAD_DIM] tile in two column parts, as in _fwd_kernel, read through pointers. VARLEN: see
    _sequence."""
    tl.static_assert(D_HI == 0 or not TMA, "the split head dim loads through pointers")
    tl.static_assert(not (VARLEN and TMA), "packed sequences load through pointers")
    PAD_D: tl.constexpr = BLOCK_D + D_HI != HEAD_DIM
    block, bh = _block_and_pair(HEAVY_FIRST, True)
    start_m = block * BLOCK_M
    b = bh // H
    h = bh % H
    hk = h // GROUP
    lq, kv_len, q_start, k_start = _sequence(CU_Q, CU_K, KL, b, LQ, LK, HAS_KL, VARLEN)
    lse_row = _lse_row(b, h, H, LQ, q_start, VARLEN)
    if VARLEN:
        Q += q_start * sqm
        DO += q_start * sdom
        O += q_start * som
        DQ += q_start * sdqm
        K += k_start * skn
        V += k_start * svn
        kv_len = tl.where(start_m < lq, kv_len, 0)  # a block past its sequence's queries visits no key
    drop_seed = _pair_key(tl.load(SEED), bh) ^ _query_block(start_m) if DROPOUT else 0
    offs_i = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_i
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q = _tile_once(Q, b, h, sqb, sqh, sqm, sqd, start_m, lq, offs_i, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, PAD_D, TMA)
    do = _tile_once(
        DO, b, h, sdob, sdoh, sdom, sdod, start_m, lq, offs_i, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, PAD_D, TMA
    )
    if D_HI > 0:  # the second part: columns BLOCK_D + offs_hi
        offs_hi = BLOCK_D + tl.arange(0, D_HI)
        q_hi = _tile_once(
            Q, b, h, sqb, sqh, sqm, sqd, start_m, lq, offs_i, offs_hi, HEAD_DIM, BLOCK_M, D_HI, PAD_D, False
        )
        do_hi = _tile_once(
            DO, b, h, sdob, sdoh, sdom, sdod, start_m, lq, offs_i, offs_hi, HEAD_DIM, BLOCK_M, D_HI, PAD_D, False
        )
    else:  # one part: stand-ins, never read
        offs_hi, q_hi, do_hi = offs_d, q, do
    lse = tl.load(LSE + lse_row + offs_m, mask=offs_m < lq, other=float("inf")) * 1.4426950408889634
    if WRITE_DELTA:
        delta = _store_delta(
            O, DELTA, do, do_hi, b, h, lse_row, sob, soh, som, offs_m, lq, offs_d, offs_hi, HEAD_DIM, PAD_D, D_HI
        )
    else:
        delta = tl.load(DELTA + lse_row + offs_m, mask=offs_m < lq, other=0.0)

    # K/V of kv_len rows (descriptors: at least one, a program with kv_len = 0 loads nothing through them)
    kv_rows = tl.maximum(kv_len, 1)
    k_src = _rows_src(K, b, hk, skb, skh, skn, skd, kv_rows, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_src = _rows_src(V, b, hk, svb, svh, svn, svd, kv_rows, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    if CAUSAL:
        n_end = tl.minimum(kv_len, start_m + BLOCK_M)
        n_full = (tl.minimum(kv_len, start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        n_end = kv_len
        n_full = (kv_len // BLOCK_N) * BLOCK_N

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if D_HI > 0:
        k_hi_src = _rows_src(K, b, hk, skb, skh, skn, skd, kv_rows, offs_n, offs_hi, HEAD_DIM, BLOCK_N, D_HI, False)
        v_hi_src = _rows_src(V, b, hk, svb, svh, svn, svd, kv_rows, offs_n, offs_hi, HEAD_DIM, BLOCK_N, D_HI, False)
        dq_hi = tl.zeros([BLOCK_M, D_HI], dtype=tl.float32)
    else:  # stand-ins, never read (the loops carry dq_hi unchanged, which the compiler drops)
        k_hi_src, v_hi_src, dq_hi = k_src, v_src, dq
    for start_n in range(0, n_full, BLOCK_N):
        dq, dq_hi = _dq_block(
            dq,
            dq_hi,
            q,
            q_hi,
            do,
            do_hi,
            lse,
            delta,
            k_src,
            k_hi_src,
            v_src,
            v_hi_src,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            offs_hi,
            kv_len,
            skn,
            svn,
            qk_scale,
            dropout_p,
            drop_seed,
            HEAD_DIM,
            PAD_D,
            False,
            CAUSAL,
            DROPOUT,
            DOT_PRECISION,
            TMA,
            D_HI,
        )
    for start_n in range(n_full, n_end, BLOCK_N):
        dq, dq_hi = _dq_block(
            dq,
            dq_hi,
            q,
            q_hi,
            do,
            do_hi,
            lse,
            delta,
            k_src,
            k_hi_src,
            v_src,
            v_hi_src,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            offs_hi,
            kv_len,
            skn,
            svn,
            qk_scale,
            dropout_p,
            drop_seed,
            HEAD_DIM,
            PAD_D,
            True,
            CAUSAL,
            DROPOUT,
            DOT_PRECISION,
            TMA,
            D_HI,
        )
    dq = dq * sm_scale
    dq_rows = DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + offs_m[:, None] * sdqm
    _store(dq_rows + offs_d[None, :], dq.to(DQ.dtype.element_ty), offs_m, lq, offs_d, HEAD_DIM, PAD_D)
    if D_HI > 0:
        dq_hi = dq_hi * sm_scale
        _store(dq_rows + offs_hi[None, :], dq_hi.to(DQ.dtype.element_ty), offs_m, lq, offs_hi, HEAD_DIM, PAD_D)


@triton.jit
def _fused_block(
    dk,
    dv,
    k,
    v,
    q_src,
    do_src,
    o_src,
    lse_ptr,
    DQ,
    dq_base,
    start_m,
    offs_m,
    offs_n,
    offs_d,
    kv_len,
    LQ,
    sqm,
    sdom,
    som,
    sdqm,
    qk_scale,
    sm_scale,
    dropout_p,
    drop_seed,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
):
    """One query block against this program's key block: dk, dv accumulate (transposed form, [keys, queries]) and
    the block's dq part is stored (the key block holds every key) or added to the fp32 dq (DQ_ATOMIC)."""
    rows = start_m + offs_m
    q = _tile(q_src, start_m, sqm, LQ, offs_m, offs_d, HEAD_DIM, PAD_D, True, False)
    do = _tile(do_src, start_m, sdom, LQ, offs_m, offs_d, HEAD_DIM, PAD_D, True, False)
    o = _tile(o_src, start_m, som, LQ, offs_m, offs_d, HEAD_DIM, PAD_D, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # delta = rowsum(o * do), here
    dv, _, ds_t = _dv_and_ds_t(
        dv,
        dv,
        k,
        k,
        v,
        v,
        q,
        q,
        do,
        do,
        lse_ptr,
        delta,
        rows,
        offs_n,
        kv_len,
        LQ,
        start_m,
        qk_scale,
        dropout_p,
        drop_seed,
        MASK,
        CAUSAL,
        DROPOUT,
        DOT_PRECISION,
        False,
        0,
    )
    ds_t = ds_t.to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    # the transpose of a tile computed in registers as a dot operand: Triton 3.4-3.7 can miscompile that on Hopper
    # (see gated_delta_rule/triton_backward.py); tests/gpu checks this dq at padded head dims 16, 32, 64 and 128
    dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * sm_scale
    dq_ptrs = dq_base + rows[:, None] * sdqm + offs_d[None, :]
    if DQ_ATOMIC:
        tl.atomic_add(dq_ptrs, dq, mask=(rows[:, None] < LQ) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
    else:
        _store(dq_ptrs, dq.to(DQ.dtype.element_ty), rows, LQ, offs_d, HEAD_DIM, PAD_D)
    return dk, dv


@direct_launch
@triton.jit(do_not_specialize=["H", "HKV", "GROUP", "LQ", "LK"])
def _bwd_fused_kernel(
    Q,
    K,
    V,
    O,
    DO,
    LSE,
    DK,
    DV,
    DQ,
    KL,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sob,
    soh,
    som,
    sdob,
    sdoh,
    sdom,
    sdod,
    sdkb,
    sdkh,
    sdkn,
    sdvb,
    sdvh,
    sdvn,
    sdqb,
    sdqh,
    sdqm,
    H,
    HKV,
    GROUP,
    LQ,
    LK,
    qk_scale,
    sm_scale,
    dropout_p,
    SEED,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
):
    """dq, dk and dv in one kernel, no launch for delta: the dk/dv kernel's loop, which also computes each query block's
    delta and its dq part (5 products and one exp per score, against the two kernels' 7 and two)."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b = bhk // HKV
    hk = bhk % HKV
    offs_j = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_j
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    k = _tile_once(K, b, hk, skb, skh, skn, skd, start_n, LK, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, PAD_D, False)
    v = _tile_once(V, b, hk, svb, svh, svn, svd, start_n, LK, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, PAD_D, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    kv_len = LK
    if HAS_KL:
        kv_len = tl.load(KL + b)
    m_lo, m_full = _query_blocks(start_n, kv_len, LQ, BLOCK_M, BLOCK_N, CAUSAL)
    # a key block wholly past kv_len adds nothing; the one key block of a stored dq (start_n = 0, so m_lo = 0: it
    # visits every query block) runs anyway, its dq rows are written only here (zeros where no key is visible)
    if DQ_ATOMIC:
        active = start_n < kv_len
    else:
        active = start_n <= kv_len
    if active:
        for g in range(0, GROUP):
            h = hk * GROUP + g
            bh = b * H + h
            drop_seed = _pair_key(tl.load(SEED), bh) ^ _key_block(start_n) if DROPOUT else 0
            q_src = _rows_src(Q, b, h, sqb, sqh, sqm, sqd, LQ, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, False)
            do_src = _rows_src(DO, b, h, sdob, sdoh, sdom, sdod, LQ, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, False)
            o_src = _rows_src(O, b, h, sob, soh, som, 1, LQ, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, False)
            lse_ptr = LSE + bh.to(tl.int64) * LQ
            dq_base = DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh
            for start_m in range(m_lo, tl.minimum(m_full, LQ), BLOCK_M):
                dk, dv = _fused_block(
                    dk,
                    dv,
                    k,
                    v,
                    q_src,
                    do_src,
                    o_src,
                    lse_ptr,
                    DQ,
                    dq_base,
                    start_m,
                    offs_m,
                    offs_n,
                    offs_d,
                    kv_len,
                    LQ,
                    sqm,
                    sdom,
                    som,
                    sdqm,
                    qk_scale,
                    sm_scale,
                    dropout_p,
                    drop_seed,
                    HEAD_DIM,
                    PAD_D,
                    True,
                    CAUSAL,
                    DROPOUT,
                    DOT_PRECISION,
                    DQ_ATOMIC,
                )
            for start_m in range(tl.maximum(m_full, m_lo), LQ, BLOCK_M):
                dk, dv = _fused_block(
                    dk,
                    dv,
                    k,
                    v,
                    q_src,
                    do_src,
                    o_src,
                    lse_ptr,
                    DQ,
                    dq_base,
                    start_m,
                    offs_m,
                    offs_n,
                    offs_d,
                    kv_len,
                    LQ,
                    sqm,
                    sdom,
                    som,
                    sdqm,
                    qk_scale,
                    sm_scale,
                    dropout_p,
                    drop_seed,
                    HEAD_DIM,
                    PAD_D,
                    False,
                    CAUSAL,
                    DROPOUT,
                    DOT_PRECISION,
                    DQ_ATOMIC,
                )
    _store_dkdv(
        DK, DV, dk * sm_scale, dv, b, hk, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, offs_n, offs_d, LK, HEAD_DIM, PAD_D
    )


# --------------------------------------------------------------------------- launchers


class Packing(NamedTuple):
    """Packed sequences (flash_attention's cu_seqlens): q [total_q, H, D], k/v [total_k, Hkv, D], sequence s at rows
    cu_q[s]:cu_q[s + 1] and cu_k[s]:cu_k[s + 1] (int32 [N + 1] on the inputs' device). max_q/max_k bound the
    sequences' lengths: the grid's extent, so one compiled kernel serves every packing."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _sizes(q, k, packing: Packing | None) -> tuple[int, int, int, int, int, int, int]:
    """(B, H, Hkv, LQ, LK, query rows, key rows): the kernels' size arguments and the rows per (batch, head) the grid
    covers. Packed: B is the number of sequences, LQ/LK the packed lengths, the rows max_q/max_k."""
    if packing is None:
        b, h, lq, _ = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        return b, h, hkv, lq, lk, lq, lk
    lq, h, _ = q.shape
    lk, hkv, _ = k.shape
    return packing.cu_q.numel() - 1, h, hkv, lq, lk, packing.max_q, packing.max_k


def _strides(x: torch.Tensor, packing: Packing | None) -> tuple[int, ...]:
    """The kernels' (batch, head, row, column) strides: a packed [total, H, D] tensor has a batch stride of 0 (the
    kernels add each sequence's first row)."""
    return x.stride() if packing is None else (0, x.stride(1), x.stride(0), x.stride(2))


def _row_shape(q: torch.Tensor, packing: Packing | None) -> tuple[int, ...]:
    """lse's and delta's shape: [B, H, Lq], packed [H, total_q]."""
    return tuple(q.shape[:3]) if packing is None else (q.shape[1], q.shape[0])


def _packing_args(packing: Packing | None, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' CU_Q and CU_K (stand-ins, never read, without packing)."""
    return (q, q) if packing is None else (packing.cu_q, packing.cu_k)


def _seed_arg(seed: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The kernels' SEED: the dropout seed tensor, or any tensor where there is no dropout (never read then)."""
    return q if seed is None else seed


def _flags(q: torch.Tensor, key_lengths, causal: bool, dropout_p: float, d_hi: int = 0) -> dict:
    """The constexprs every kernel takes; d_hi: the variant's D_HI (BLOCK_D is then the first column part)."""
    d = q.shape[-1]
    return dict(
        HEAD_DIM=d,
        BLOCK_D=d - d_hi if d_hi else block_d(d),
        CAUSAL=bool(causal),
        HAS_KL=key_lengths is not None,
        DROPOUT=dropout_p > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # the latter is ignored for 16-bit inputs
    )


def _use_tma(cfg, tensors, tma) -> bool:
    """Whether a launch reads `tensors` through descriptors. tma: None lets the config decide, on a compiled CUDA
    device of capability >= 9.0 only; True/False force the descriptor path on or off (tests: the interpreter runs it
    too). Either way the strides of every tensor must suit descriptors, else the pointer path runs."""
    x = tensors[0]
    if tma is None:
        tma = cfg.tma and _fwd_kernel.direct and x.is_cuda and _has_tma(x.device)
    return bool(tma) and all(_tma_layout(t) for t in tensors)


def _split_or_tma(cfg, tensors, tma) -> dict:
    """D_HI (the second column part's width where the config asks for split_d and the head dim splits, see
    split_head_dim; else 0) and TMA (_use_tma; never for a split launch, whose parts load through pointers)."""
    d_hi = split_head_dim(tensors[0].shape[-1])[1] if cfg.split_d else 0
    return dict(TMA=d_hi == 0 and _use_tma(cfg, tensors, tma), D_HI=d_hi)


def forward_variant(q, k, v, causal: bool, cfg=None, tma=None) -> tuple[FwdConfig, dict]:
    """The forward's config and variant constexprs for these inputs.

    cfg: a FwdConfig (or its leading 4-tuple) instead of the table's. tma: see _use_tma. TMA and D_HI: see
    _split_or_tma (a split forward loads through pointers)."""
    cfg = config("fwd_causal" if causal else "fwd", q.shape[-1], q.dtype) if cfg is None else cfg
    if not isinstance(cfg, FwdConfig):
        cfg = FwdConfig(*cfg)
    return cfg, dict(HEAVY_FIRST=int(cfg.heavy_first) if causal else 0) | _split_or_tma(cfg, (q, k, v), tma)


def backward_variant(kind: str, q, k, v, do, cfg=None, tma=None, *, causal=False) -> tuple[BwdConfig, dict]:
    """The config and variant constexprs of the "dkdv" or "dq" kernel for these inputs (both read q, k, v, do); the
    dk/dv kernel's LSE_DELTA_TMA depends on lse and delta too: see lse_delta_variant.

    cfg: a BwdConfig (or a plain 4-tuple) instead of the table's. tma: see _use_tma. TMA and D_HI: see _split_or_tma
    (a split launch loads through pointers)."""
    cfg = config(backward_kind(kind, causal), q.shape[-1], q.dtype) if cfg is None else cfg
    if not isinstance(cfg, BwdConfig):
        cfg = BwdConfig(*cfg)
    return cfg, dict(HEAVY_FIRST=int(cfg.heavy_first) if causal else 0) | _split_or_tma(cfg, (q, k, v, do), tma)


def forward(q, k, v, key_lengths, causal, scale, dropout_p, seed, *, cfg=None, tma=None, packing=None):
    """(o [B, H, Lq, D] in q's dtype, lse [B, H, Lq] fp32; +inf for rows that see no key). cfg, tma: see
    forward_variant. packing: packed sequences (Packing; key_lengths is then None): o [total_q, H, D], lse [H, total_q],
    pointer loads only."""
    b, h, hkv, lq, lk, rows_q, _ = _sizes(q, k, packing)
    o = empty(q.shape, dtype=q.dtype, device=q.device)
    lse = empty(_row_shape(q, packing), dtype=torch.float32, device=q.device)
    cfg, variant = forward_variant(q, k, v, causal, cfg, False if packing is not None else tma)
    if variant["TMA"]:
        _ensure_scratch_allocator()
    _fwd_kernel[(cdiv(rows_q, cfg.block_m), b * h)](
        q,
        k,
        v,
        o,
        lse,
        key_lengths if key_lengths is not None else q,
        *_packing_args(packing, q),
        *_strides(q, packing),
        *_strides(k, packing),
        *_strides(v, packing),
        *_strides(o, packing)[:3],
        h,
        h // hkv,
        lq,
        lk,
        scale * LOG2E,
        dropout.drop_rate(dropout_p),
        _seed_arg(seed, q),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        **launch_options(cfg),
        VARLEN=packing is not None,
        **variant,
        **_flags(q, key_lengths, causal, dropout_p, variant["D_HI"]),
    )
    return o, lse


def backward(do, q, k, v, key_lengths, causal, scale, dropout_p, seed, o, lse, *, kind=None, packing=None):
    """(dq, dk, dv, None x 5): gradients in the inputs' dtypes, dk/dv summed over each kv head's query heads.

    kind: "fused" (one kernel, backward_fused) or "split" (the dq kernel, which also writes delta = rowsum(o * do),
    then the dk/dv kernel); None: use_fused decides. packing: packed sequences (see forward; the split kernels)."""
    if kind not in (None, *BACKWARDS):
        raise ValueError(f"kind: expected None or one of {BACKWARDS}, got {kind!r}")
    if packing is not None and kind == "fused":
        raise ValueError("kind: the fused backward takes no packed sequences; use 'split' or None")
    if kind == "fused" or (kind is None and packing is None and use_fused(q, k)):
        dq, dk, dv = backward_fused(do, q, k, v, key_lengths, causal, scale, dropout_p, seed, o, lse)
    else:
        delta = empty(_row_shape(q, packing), dtype=torch.float32, device=q.device)
        dq = backward_dq(do, q, k, v, key_lengths, causal, scale, dropout_p, seed, lse, delta, o=o, packing=packing)
        dk, dv = backward_dkdv(do, q, k, v, key_lengths, causal, scale, dropout_p, seed, lse, delta, packing=packing)
    return dq, dk, dv, None, None, None, None, None


def use_fused(q, k) -> bool:
    """The fused kernel for 16-bit inputs at the head dims where it won, where every key fits its block (it then
    stores dq: no atomics) and there are enough (batch, kv head) pairs to fill the GPU, one program each; else the
    dq and dk/dv kernels."""
    b, hkv, lk = k.shape[0], k.shape[1], k.shape[2]
    d = block_d(q.shape[-1])
    return (
        q.dtype != torch.float32 and d in FUSED_HEAD_DIMS and b * hkv >= FUSED_MIN_PROGRAMS
        and lk <= config("fused", d, q.dtype).block_n
    )  # fmt: skip


def backward_fused(do, q, k, v, key_lengths, causal, scale, dropout_p, seed, o, lse, *, cfg=None):
    """(dq, dk, dv) of _bwd_fused_kernel. dq is stored where Lk fits the config's key block, else summed over the
    key blocks with fp32 atomics (not deterministic in its last bits) and cast. cfg: a BwdConfig instead of the
    table's "fused" entry (tma is ignored: pointer loads only)."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    cfg = config("fused", d, q.dtype) if cfg is None else BwdConfig(*cfg)
    atomic = lk > cfg.block_n
    dq = (
        torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if atomic
        else empty(q.shape, dtype=q.dtype, device=q.device)
    )
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    dv = empty(v.shape, dtype=v.dtype, device=v.device)
    _bwd_fused_kernel[(cdiv(lk, cfg.block_n), b * hkv)](
        q,
        k,
        v,
        o,
        do,
        lse,
        dk,
        dv,
        dq,
        key_lengths if key_lengths is not None else q,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *o.stride()[:3],
        *do.stride(),
        *dk.stride()[:3],
        *dv.stride()[:3],
        *dq.stride()[:3],
        h,
        hkv,
        h // hkv,
        lq,
        lk,
        scale * LOG2E,
        scale,
        dropout.drop_rate(dropout_p),
        _seed_arg(seed, q),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        **launch_options(cfg),
        DQ_ATOMIC=atomic,
        **_flags(q, key_lengths, causal, dropout_p),
    )
    return (dq.to(q.dtype) if atomic else dq), dk, dv


def backward_dkdv(
    do, q, k, v, key_lengths, causal, scale, dropout_p, seed, lse, delta, *, cfg=None, tma=None, packing=None
):
    """(dk, dv) in k's and v's dtypes. cfg, tma: see backward_variant (and lse_delta_variant). packing: see forward."""
    b, h, hkv, lq, lk, _, rows_k = _sizes(q, k, packing)
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    dv = empty(v.shape, dtype=v.dtype, device=v.device)
    cfg, variant = backward_variant("dkdv", q, k, v, do, cfg, False if packing is not None else tma, causal=causal)
    variant["LSE_DELTA_TMA"] = lse_delta_variant(cfg, lse, delta, variant["TMA"])
    if variant["TMA"]:
        _ensure_scratch_allocator()
    _bwd_dkdv_kernel[(cdiv(rows_k, cfg.block_n), b * hkv)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        key_lengths if key_lengths is not None else q,
        *_packing_args(packing, q),
        *_strides(q, packing),
        *_strides(k, packing),
        *_strides(v, packing),
        *_strides(do, packing),
        *_strides(dk, packing)[:3],
        *_strides(dv, packing)[:3],
        h,
        hkv,
        h // hkv,
        lq,
        lk,
        scale * LOG2E,
        scale,
        dropout.drop_rate(dropout_p),
        _seed_arg(seed, q),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        **launch_options(cfg),
        VARLEN=packing is not None,
        **variant,
        **_flags(q, key_lengths, causal, dropout_p, variant["D_HI"]),
    )
    return dk, dv


def lse_delta_variant(cfg: BwdConfig, lse: torch.Tensor, delta: torch.Tensor, tma: bool) -> bool:
    """Whether the dk/dv kernel on its descriptor path (tma: backward_variant's TMA) reads lse and delta (contiguous
    [B, H, Lq] fp32, as both paths take them) through 1-D descriptors too: the config asks for it (lse_delta_tma) and
    every (b, h) row is 16-byte aligned (Lq % 4 == 0); else pointer loads. Query blocks of fewer than 32 rows take
    pointers too: with 16 (64-byte boxes) the kernel faulted on a misaligned address on an H100 (Triton 3.6,
    head dim 32)."""
    if not (cfg.lse_delta_tma and tma) or cfg.block_m < 32:
        return False
    return lse.shape[-1] % 4 == 0 and all(x.data_ptr() % 16 == 0 for x in (lse, delta))


def backward_dq(
    do, q, k, v, key_lengths, causal, scale, dropout_p, seed, lse, delta, *, o=None, cfg=None, tma=None, packing=None
):
    """dq in q's dtype; with o, it also writes delta = rowsum(o * do) into `delta` (for the dk/dv kernel run after
    it: no separate launch for delta). cfg, tma: see backward_variant. packing: see forward."""
    b, h, hkv, lq, lk, rows_q, _ = _sizes(q, k, packing)
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    cfg, variant = backward_variant("dq", q, k, v, do, cfg, False if packing is not None else tma, causal=causal)
    if variant["TMA"]:
        _ensure_scratch_allocator()
    o_arg = q if o is None else o  # a stand-in, not read, without o
    _bwd_dq_kernel[(cdiv(rows_q, cfg.block_m), b * h)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        key_lengths if key_lengths is not None else q,
        o_arg,
        *_packing_args(packing, q),
        *_strides(q, packing),
        *_strides(k, packing),
        *_strides(v, packing),
        *_strides(do, packing),
        *_strides(dq, packing)[:3],
        *_strides(o_arg, packing)[:3],
        h,
        h // hkv,
        lq,
        lk,
        scale * LOG2E,
        scale,
        dropout.drop_rate(dropout_p),
        _seed_arg(seed, q),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        **launch_options(cfg),
        VARLEN=packing is not None,
        WRITE_DELTA=o is not None,
        **variant,
        **_flags(q, key_lengths, causal, dropout_p, variant["D_HI"]),
    )
    return dq


# --------------------------------------------------------------------------- packed sequences (cu_seqlens)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p, seed):
    """(o [total_q, H, D], lse [H, total_q]) of packed sequences; cu_seqlens int32 on q's device, max_seqlen_* at
    least the longest sequence's length."""
    if q.shape[0] == 0 or k.shape[0] == 0:  # no query, or no key at all: every row sees none
        o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return o, torch.full((q.shape[1], q.shape[0]), float("inf"), device=q.device)
    packing = Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return forward(q, k, v, None, causal, scale, dropout_p, seed, packing=packing)


def varlen_backward(
    do, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p, seed, o, lse
):
    """(dq, dk, dv, None x 8) of varlen_forward."""
    rest = (None,) * 8
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), *rest
    packing = Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = backward(do, q, k, v, None, causal, scale, dropout_p, seed, o, lse, packing=packing)[:3]
    return dq, dk, dv, *rest
