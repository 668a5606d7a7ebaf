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


# Register budgets checked with ptxas on sm_90a (no spills). Head dims up to 32 are bound by the exponentials and by
# latency: several one-warpgroup programs per SM; D >= 48 runs two compute warpgroups, one program per SM. Only
# D = 128 overlaps the softmax with PV (level at 64, slower below): docs/tuning/flash_attention.md.
FWD_CONFIGS = {
    16: FwdConfig(64, 128, 2, 128, 2),
    32: FwdConfig(64, 128, 2, 128, 2),
    48: FwdConfig(128, 128, 2, 256, 1),
    64: FwdConfig(128, 128, 2, 256, 1),
    128: FwdConfig(128, 128, 2, 256, 1, overlap=True),
}
# The backward's two-warpgroup programs (D >= 32) overlap their products and add dq with deferred bulk reductions
# (faster than the plain loop at every head dim measured: docs/tuning/flash_attention.md).
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
