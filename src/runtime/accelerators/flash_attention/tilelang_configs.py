"""Launch configurations of the TileLang flash-attention kernels (tilelang_kernels.py) per head dim, and why."""

from dataclasses import dataclass


@dataclass(frozen=True)
class FwdConfig:
    block_m: int  # queries per program
    block_n: int  # keys per step
    stages: int  # K/V tiles in flight
    threads: int  # compute threads; warp specialisation adds a producer warpgroup for TMA
    min_blocks: int = 1  # > 1: cap registers so that this many programs share an SM
    # each step issues block k's QK^T and block k-1's PV together, then block k's softmax while PV runs on the
    # tensor cores (FlashAttention-3's overlap within a warpgroup)
    overlap: bool = False


@dataclass(frozen=True)
class BwdConfig:
    block_n: int  # keys per program (dk/dv rows)
    block_m: int  # queries per step
    stages: int
    threads: int
    min_blocks: int = 1
    # each step issues S = K Q^T and dP = V dO^T together (the exponentials run while dP is on the tensor cores),
    # then dV, dQ and dK back to back, and adds dq while dK runs (FlashAttention-3's order)
    overlap: bool = False
    # how each step's dq block reaches the fp32 accumulator:
    #   "tma": through a shared tile and a TMA reduction whose shared reads are waited for at once
    #   "bulk": a double-buffered shared tile and a 1-D bulk reduction waited for one step later; the
    #           accumulator is then blocked (8 x 8 sub-tiles, see DQ_SUBTILE) and reordered on the host
    dq: str = "tma"

    def __post_init__(self):
        if self.dq not in ("tma", "bulk"):
            raise ValueError(f"BwdConfig.dq must be 'tma' or 'bulk', not {self.dq!r}")


# Register budgets checked with ptxas on sm_90a (no spills). Head dims up to 32 are bound by the exponentials and
# by latency, so they run several one-warpgroup programs per SM; D >= 48 runs two compute warpgroups per program
# with TileLang's default register split (one program per SM). (Two compute warpgroups with 2 programs per SM leave
# 80 registers: no room for a 64x128 fp32 score tile.) The overlap gained 3% at D = 128 on an H100 and lost 5-34% at
# D <= 48; at D = 64 (16x16x2048) it was level (1.013 against
# 1.018 ms) and 2% slower causal (0.758 against 0.740), so D = 64 keeps the plain loop. With Q loaded by
# TMA everywhere: at 64x4x2048x48 the two-warpgroup tiles took 0.657 / 0.405 ms against the
# one-warpgroup 0.801 / 0.456 (non-causal / causal; cuDNN 0.589 / 0.342); at 128x8x1024x32 the one-warpgroup tiles
# stay ahead (0.618 / 0.410 against 0.655 / 0.436).
FWD_CONFIGS = {
    16: FwdConfig(64, 128, 2, 128, 2),
    32: FwdConfig(64, 128, 2, 128, 2),
    48: FwdConfig(128, 128, 2, 256, 1),
    64: FwdConfig(128, 128, 2, 256, 1),
    128: FwdConfig(128, 128, 2, 256, 1, overlap=True),
}
# The backward's two-warpgroup programs (D >= 32) overlap their products and add dq with deferred bulk reductions.
# H100, forward+backward ms against the plain loop with TMA
# reductions (non-causal, causal; cuDNN in brackets): 4x16x4096x128 4.529 / 5.304, 2.963 / 3.463 (3.666, 2.111);
# 16x16x2048x64 3.648 / 4.071, 2.583 / 2.818 (2.365, 1.436); 64x4x2048x48 3.311 / 3.663, 2.185 / 2.368 (2.228,
# 1.374); 128x8x1024x32 3.064 / 3.284, 2.364 / 2.524 (2.287, 1.607). At 4x16x4096x128, vector atomics for dq
# (7.036 / 5.067) and programs that start at staggered query blocks (4.658 / 3.114) were slower and are gone.
BWD_CONFIGS = {
    16: BwdConfig(64, 64, 2, 128, 2),
    32: BwdConfig(128, 64, 2, 256, 1, overlap=True, dq="bulk"),
    48: BwdConfig(128, 64, 2, 256, 1, overlap=True, dq="bulk"),
    64: BwdConfig(128, 64, 2, 256, 1, overlap=True, dq="bulk"),
    128: BwdConfig(128, 64, 2, 256, 1, overlap=True, dq="bulk"),
}
PREP_ROWS = 128
DQ_SUBTILE = 8  # BwdConfig.dq "bulk": the blocked accumulator's sub-tiles (rows x columns)
HEAD_DIMS = tuple(FWD_CONFIGS)
