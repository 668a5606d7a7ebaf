"""Launch configurations of the Triton flash-attention kernels (triton.py): one per kernel and padded head dim.

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

from typing import NamedTuple

import torch

from ..launch_math import next_power_of_2


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
