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


# A launch config (FwdConfig, BwdConfig) per kernel and padded head dim, for 16-bit inputs; BLOCK_M runs over queries
# and BLOCK_N over keys in every kernel, and head dim 48 takes the 64 column. Swept per kernel and causality on an H100
# (bf16) at 256x4x256x16, 128x8x1024x32, 64x4x2048x48 and 4x16x4096x128: docs/tuning/flash_attention.md.
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
# Padded head dims where use_fused may pick the fused backward: not 32, where dq by atomics lost to the split kernels
# (docs/tuning/flash_attention.md)
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
