"""Forward and backward variants of the Triton flash attention on the GPU, beside SDPA's cuDNN backend.

    bash .device/gpu python scripts/fa_sweep.py [fwd|bwd|both] [--only BxHxLxD,...] [--kernel dkdv|dq|fused]
        [--no-delta-in-dq]   (GPU machine, repo root; default both)

--no-delta-in-dq: the split backward's rows with the preprocess launch (triton.DELTA_IN_DQ off; on by default since
session 19, as in the module). Before session 23 the flag was --delta-in-dq and off unless given, so bwd sweeps from
session 19 to 22 timed the split backward with the preprocess unless it was given.

fwd takes about 2 minutes with compiles, bwd (45 rows) about 3-4 (estimated from sm_90 compile times, not yet run).

Forward (fwd): each row puts one FwdConfig (tiles, warps, stages and the variant flags tma / heavy_first, see
runtime/accelerators/flash_attention/triton.py) in CONFIGS_16BIT["fwd"] or ["fwd_causal"] at the shape's padded head
dim and runs the public flash_attention(backend="triton"), as a model would. It is checked first against SDPA's
math backend in float32 (relative RMS error within the bf16 bound of runtime.accelerators.testing, outputs poisoned
with NaN beforehand), then timed as `python -m runtime.benchmark` times GPU time (CUDA-graph replays, L2 flushed
before each, median ms). "path" is what the launcher really ran: tma (descriptor loads, CUDA capability >= 9.0
only) or ptr, plus heavy (causal, last query blocks first) and split (split_d: the head dim as two column parts, not
padded; the default at 64x4x2048x48 since session 27, beside "padded" rows of the same tiles). "x cuDNN" is cuDNN's time over the
row's (>= 1: faster than cuDNN). regs/spill: registers per thread and spilled bytes of the compiled kernel. A row
that fails to compile or misses the bound is reported and left out; one that runs past ROW_LIMIT_S (a hung kernel)
ends the script. The script ends with the fastest config per table entry.

"default" is the table's entry as imported: since session 14 (H100) the TMA winners of this sweep, at (4,16,4096,128)
tma 0.983 ms (pointer 1.136, cuDNN 0.865), causal tma+heavy 0.596 ms (pointer 0.664, cuDNN 0.486); the other rows
are the alternatives, pointer loads with the same tiles among them, to check the defaults still win.

Backward (bwd): each row puts one BwdConfig (tiles, warps, stages, tma, lse_delta_tma) in CONFIGS_16BIT["dkdv"] or
["dq"] at the shape's padded head dim, the other backward kernel and the forward at their table entries, and times
forward + backward of flash_attention(backend="triton") (torch.autograd.grad of q, k, v) beside cuDNN's forward +
backward. dq, dk and dv are checked first against SDPA's math backend in float32 (each within the bf16 gradient
bound, gradient_tolerance: twice the forward's, as the benchmark checks gradients; "error" is the largest of the
three). TFLOP/s counts the backward as 2.5 forwards. The dkdv and dq tables split by causality since session 29
(["dkdv_causal"], ["dq_causal"]; the fused kernel's does not): the summary ranks a config by its total time over the
shapes swept at its entry. Candidates
were picked from sm_90 builds (scripts/triton_resources.py): the tiles that spill least, each with TMA, beside the
pointer default. Rows of the "fused" kernel (one kernel for dq, dk and dv; session 16) run it forced
(triton.BACKWARD = "fused"); "path" says whether dq was stored (every key in one block) or added with atomics.
The dkdv and dq rows force the split kernels. A dk/dv row whose path reads "tma lse" read lse and delta through
descriptors too (lse_delta_tma, the default at head dim 128 since session 23, at 64 since session 28); "split": the
kernel held the head dim as two column parts (split_d, pointer loads; the dq default at 64x4x2048x48 since session
28, beside a "padded" row of the same tiles).
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.flash_attention import flash_attention
from runtime.accelerators.flash_attention import triton as kernels
from runtime.accelerators.testing import RTOL, gradient_tolerance, relative_rms_error
from runtime.benchmark.timing import gpu_time_ms

Fwd = kernels.FwdConfig
Bwd = kernels.BwdConfig
DTYPE = torch.bfloat16
REFERENCE_BYTES = 2 * 2**30  # float32 scores of the math reference per batch chunk
ROW_LIMIT_S = 90  # compile, check and timing of one row take seconds; past this a kernel hangs

# ((B, H, L, D), causal, {label: config}); "default" (the table's entry as imported) is added to each
SWEEP = [
    ((4, 16, 4096, 128), False, {
        "ptr": Fwd(128, 128, 8, 3),
        "tma 2st": Fwd(128, 128, 8, 2, tma=True),
        "tma n64": Fwd(128, 64, 8, 3, tma=True),
    }),
    ((4, 16, 4096, 128), True, {
        "ptr": Fwd(128, 128, 8, 3),
        "heavy": Fwd(128, 128, 8, 3, heavy_first=True),
        "tma heavy n64": Fwd(128, 64, 8, 3, tma=True, heavy_first=True),
    }),
    ((64, 4, 2048, 48), False, {
        "ptr": Fwd(128, 64, 8, 4),
        "tma 3st": Fwd(128, 64, 8, 3, tma=True),
        "tma n128": Fwd(128, 128, 8, 3, tma=True),
        # the default splits the head dim (32 + 16 columns, split_d); the padded entry it replaced (session 27)
        "padded tma": Fwd(128, 64, 8, 4, tma=True),
        "split 3st": Fwd(128, 64, 8, 3, split_d=True),
        # 128 registers: two programs of 8 warps per SM; 80 lets three in (session 29)
        "split r80": Fwd(128, 64, 8, 4, split_d=True, maxnreg=80),
    }),
    ((64, 4, 2048, 48), True, {
        "heavy": Fwd(128, 64, 8, 4, heavy_first=True),
        "tma heavy": Fwd(128, 64, 8, 4, tma=True, heavy_first=True),
        "tma heavy16": Fwd(128, 64, 8, 4, tma=True, heavy_first=16),
        "padded h16": Fwd(128, 64, 8, 4, heavy_first=16),
        "split h16 3st": Fwd(128, 64, 8, 3, heavy_first=16, split_d=True),
        "split h16 r80": Fwd(128, 64, 8, 4, heavy_first=16, split_d=True, maxnreg=80),
    }),
    ((128, 8, 1024, 32), False, {
        "tma": Fwd(64, 64, 4, 3, tma=True),
        "tma m128": Fwd(128, 64, 8, 3, tma=True),
        "m128 8w": Fwd(128, 64, 8, 3),
        "n128": Fwd(64, 128, 4, 3),
        "4st": Fwd(64, 64, 4, 4),
        # 92 registers: five programs of 4 warps per SM; 80 lets six in, 64 eight (session 29)
        "r80": Fwd(64, 64, 4, 3, maxnreg=80),
        "r64": Fwd(64, 64, 4, 3, maxnreg=64),
    }),
    ((128, 8, 1024, 32), True, {
        "heavy": Fwd(64, 64, 4, 3, heavy_first=True),
        "m128 heavy": Fwd(128, 64, 8, 3, heavy_first=True),
        "n32 heavy": Fwd(64, 32, 4, 3, heavy_first=True),
        "n128 heavy": Fwd(64, 128, 4, 3, heavy_first=True),
        "tma heavy": Fwd(64, 64, 4, 3, tma=True, heavy_first=True),
    }),
    ((256, 4, 256, 16), False, {
        "m128": Fwd(128, 64, 4, 3),
        "n128": Fwd(64, 128, 4, 3),
        "m32": Fwd(32, 64, 4, 3),
        "2st": Fwd(64, 64, 4, 2),
    }),
    ((256, 4, 256, 16), True, {
        "m128": Fwd(128, 64, 4, 3),
        "m32": Fwd(32, 64, 4, 3),
    }),
]  # fmt: skip

BWD_128 = {
    "dkdv": {  # default (64, 128, 8, 2, tma, lse_delta_tma): 255 registers and 208 stack bytes on sm_90 (pointers: 304)
        "ptr": Bwd(64, 128, 8, 2),
        "tma": Bwd(64, 128, 8, 2, tma=True),
        "tma m32": Bwd(32, 128, 8, 2, tma=True),
        "tma m32 3st": Bwd(32, 128, 8, 3, tma=True),
        "tma m16": Bwd(16, 128, 8, 2, tma=True),
        "ptr m16": Bwd(16, 128, 8, 2),
        "tma n64": Bwd(32, 64, 8, 2, tma=True),
    },
    "dq": {  # default (128, 64, 8, 3): 203 registers; with TMA 158
        "tma": Bwd(128, 64, 8, 3, tma=True),
        "tma 2st": Bwd(128, 64, 8, 2, tma=True),
        "tma 4st": Bwd(128, 64, 8, 4, tma=True),
        "tma n128": Bwd(128, 128, 8, 2, tma=True),
        "tma m64": Bwd(64, 64, 4, 3, tma=True),
        "tma n32": Bwd(128, 32, 8, 4, tma=True),
    },
}
# the fused kernel (dq stored where L <= block_n, else added with atomics) against the split kernels' default rows
FUSED_16 = {  # session 16 (H100): 8 warps 0.189 / 0.195 ms (causal), m16 0.307, m64 0.160, 1 stage 0.207
    "1st": Bwd(32, 256, 4, 1),
    "3st": Bwd(32, 256, 4, 3),
    "m16": Bwd(16, 256, 4, 2),
    "m64": Bwd(64, 256, 4, 2),
    "atom n128": Bwd(32, 128, 4, 2),
    "atom n128 m64": Bwd(64, 128, 4, 2),
}
FUSED_ATOMIC = {  # session 16 (H100), 128x8x1024x32 causal: 32x128 4w 1.419 ms, 64x128 8w 1.751, 64x64 4w 1.590
    "atom n128": Bwd(32, 128, 4, 2),
    "atom n128 3st": Bwd(32, 128, 4, 3),
    "atom m16": Bwd(16, 128, 4, 2),
    "atom n64": Bwd(32, 64, 4, 2),
    "atom m64 n64 3st": Bwd(64, 64, 4, 3),
}
FUSED_SHORT = {"atom n128": Bwd(32, 128, 4, 2), "8w": Bwd(32, 256, 8, 2), "n128 m64": Bwd(64, 128, 4, 2)}
# head dim 32 (session 15, 128x8x1024x32: dkdv tma 2.247 against 2.091, tma 8w 3.600; dq tma 2.131 against 2.104, tma
# m64 2.214); the default dkdv tiles spill (255 registers, 22 bytes) there
D32_DKDV = {"m16": Bwd(16, 128, 4, 3), "n64": Bwd(32, 64, 4, 3), "m64 n64": Bwd(64, 64, 4, 3), "2st": Bwd(32, 128, 4, 2),
            # lse and delta through descriptors, which took the head-dim-48 entry from 1.651 to 1.503 ms (session 28)
            "tma lse": Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True),
            "tma lse r168": Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True, maxnreg=168)}  # fmt: skip
D32_DQ = {"m64 n64": Bwd(64, 64, 4, 3), "n64 8w": Bwd(128, 64, 8, 3), "m64 n32": Bwd(64, 32, 4, 4)}
# non-causal since the tables split by causality (session 29): the descriptor entry beside the pointer one it replaced,
# and caps on its registers (217 on sm_90: two programs of 4 warps per SM; 168 lets three in, 128 four)
D32_DKDV_NONCAUSAL = {
    "ptr": Bwd(32, 128, 4, 3),
    "tma lse 2st": Bwd(32, 128, 4, 2, tma=True, lse_delta_tma=True),
    "tma lse 4st": Bwd(32, 128, 4, 4, tma=True, lse_delta_tma=True),
    "tma lse m16": Bwd(16, 128, 4, 3, tma=True, lse_delta_tma=True),
    "tma lse r168": Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True, maxnreg=168),
    "tma lse r128": Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True, maxnreg=128),
}
D32_DQ_NONCAUSAL = D32_DQ | {"tma": Bwd(128, 32, 4, 4, tma=True), "3st": Bwd(128, 32, 4, 3),
                             # 124 registers: four programs of 4 warps per SM; 96 lets five in, 80 six
                             "r96": Bwd(128, 32, 4, 4, maxnreg=96), "r80": Bwd(128, 32, 4, 4, maxnreg=80)}
# ((B, H, L, D), causal, {kernel: {label: config}}); each kernel's "default" (the table's entry as imported) is added
BWD_SWEEP = [
    ((4, 16, 4096, 128), False, BWD_128),
    ((4, 16, 4096, 128), True, BWD_128 | {"fused": FUSED_ATOMIC}),
    ((64, 4, 2048, 48), True, {
        # the dq default splits the head dim (32 + 16 columns, split_d), the dk/dv default reads lse and delta through
        # descriptors (session 28); the entries they replaced, and dk/dv split (its tiles spill 330-460 bytes on sm_90,
        # Triton 3.6; split tiles that do not, 8 warps or 64 keys, took 1.78-3.60 ms in session 28)
        "dkdv": {
            "tma lse h0": Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True),
            "padded tma": Bwd(32, 128, 4, 3, tma=True, heavy_first=16),
            "split": Bwd(32, 128, 4, 3, heavy_first=16, split_d=True),
            "tma lse r168": Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True, heavy_first=16, maxnreg=168),
            # 16-row query blocks: a smaller score tile, fewer registers than the spilling 32-row entry (lse and
            # delta through pointers: lse_delta_variant needs 32 rows)
            "tma m16": Bwd(16, 128, 4, 3, tma=True, heavy_first=16),
            "tma m16 4st": Bwd(16, 128, 4, 4, tma=True, heavy_first=16),
            # 64 x 64 tiles (session 32): accumulators of 64 keys, a 64 x 64 score tile, so no spills
            "split m64 n64": Bwd(64, 64, 4, 3, heavy_first=16, split_d=True),
            "split m64 n64 2st": Bwd(64, 64, 4, 2, heavy_first=16, split_d=True),
            "tma lse m64 n64": Bwd(64, 64, 4, 3, tma=True, lse_delta_tma=True, heavy_first=16),
        },
        "dq": {
            "split r96": Bwd(64, 64, 4, 3, heavy_first=16, split_d=True, maxnreg=96),
            "padded": Bwd(64, 64, 4, 3, heavy_first=16),
            "split m128": Bwd(128, 64, 8, 3, heavy_first=16, split_d=True),
        },
        "fused": FUSED_ATOMIC,
    }),
    ((128, 8, 1024, 32), True, {"fused": FUSED_ATOMIC, "dkdv": D32_DKDV, "dq": D32_DQ}),
    # keys in one block at the wider head dims: the fused kernel against the split kernels (the dkdv default row)
    ((256, 4, 256, 32), False, {"fused": FUSED_SHORT, "dkdv": {}}),
    ((256, 4, 256, 32), True, {"fused": FUSED_SHORT, "dkdv": {}}),
    ((256, 4, 128, 64), True, {"fused": {"8w": Bwd(32, 128, 8, 2)}, "dkdv": {}}),
    ((128, 4, 128, 128), True, {"fused": {"4w": Bwd(32, 128, 4, 2), "m16": Bwd(16, 128, 8, 2)}, "dkdv": {}}),
    ((64, 4, 2048, 48), False, {
        "dkdv": {  # "tma" is the entry before session 28
            "tma": Bwd(32, 128, 4, 3, tma=True),
            "tma 8w": Bwd(32, 128, 8, 2, tma=True),
            "tma m64 8w": Bwd(64, 128, 8, 2, tma=True),
            "split": Bwd(32, 128, 4, 3, split_d=True),
            "tma lse r168": Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True, maxnreg=168),
            "tma m16": Bwd(16, 128, 4, 3, tma=True),
            "tma m16 4st": Bwd(16, 128, 4, 4, tma=True),
            "split m64 n64": Bwd(64, 64, 4, 3, split_d=True),
            "split m64 n64 2st": Bwd(64, 64, 4, 2, split_d=True),
            "tma lse m64 n64": Bwd(64, 64, 4, 3, tma=True, lse_delta_tma=True),
        },
        "dq": {
            # 126 registers: four programs of 4 warps per SM; 96 lets five in, 80 six (session 29)
            "split r96": Bwd(64, 64, 4, 3, split_d=True, maxnreg=96),
            "split r80": Bwd(64, 64, 4, 3, split_d=True, maxnreg=80),
            "padded": Bwd(64, 64, 4, 3),
            "tma": Bwd(64, 64, 4, 3, tma=True),
            "tma m128": Bwd(128, 64, 8, 3, tma=True),
            "split m128": Bwd(128, 64, 8, 3, split_d=True),
        },
    }),
    ((128, 8, 1024, 32), False, {"dkdv": D32_DKDV_NONCAUSAL, "dq": D32_DQ_NONCAUSAL}),
    ((256, 4, 256, 16), True, {"fused": FUSED_16, "dkdv": {}}),
    ((256, 4, 256, 16), False, {
        "fused": FUSED_16,
        "dkdv": {
            "tma": Bwd(32, 128, 4, 3, tma=True),
            "m64": Bwd(64, 128, 4, 3),
            "n64": Bwd(32, 64, 4, 3),
            "m16": Bwd(16, 128, 4, 3),
            "2st": Bwd(32, 128, 4, 2),
        },
        "dq": {
            "tma": Bwd(64, 64, 4, 3, tma=True),
            "m128": Bwd(128, 64, 4, 3),
            "n128": Bwd(64, 128, 4, 3),
            "m32": Bwd(32, 64, 4, 3),
            "2st": Bwd(64, 64, 4, 2),
        },
    }),
]  # fmt: skip


def table(causal: bool) -> dict:
    return kernels.CONFIGS_16BIT["fwd_causal" if causal else "fwd"]


def describe(cfg: Fwd) -> str:
    return f"{cfg.block_m}x{cfg.block_n} {cfg.num_warps}w {cfg.num_stages}st"


def code(cfg: Fwd | Bwd) -> str:
    """FwdConfig(128, 128, 8, 3, tma=True): the flags that are set, as one would write it in the table."""
    flags = "".join(
        f", {name}={getattr(cfg, name)!r}"
        for name in ("tma", "heavy_first", "lse_delta_tma", "split_d", "maxnreg")
        if getattr(cfg, name, False)
    )
    return f"{type(cfg).__name__}({cfg.block_m}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}{flags})"


def path(flags: dict) -> str:
    route = ("tma" if flags["TMA"] else "ptr") + (" heavy" if flags["HEAVY_FIRST"] else "")
    return route + (" split" if flags["D_HI"] else "")


def flops(shape, causal: bool) -> float:
    b, h, length, d = shape
    return 4.0 * b * h * length * length * d / (2 if causal else 1)


def reference(q, k, v, causal: bool) -> torch.Tensor:
    """SDPA's math backend in float32, a few batch rows at a time (its scores are B x H x L x L)."""
    b, h, length, _ = q.shape
    chunk = max(1, REFERENCE_BYTES // (h * length * length * 4))
    parts = []
    with sdpa_kernel(SDPBackend.MATH):
        for i in range(0, b, chunk):
            rows = slice(i, i + chunk)
            parts.append(F.scaled_dot_product_attention(q[rows].float(), k[rows].float(), v[rows].float(), is_causal=causal))
    return torch.cat(parts)


def compiled_resources(before: set, kernel=kernels._fwd_kernel) -> str:
    """Registers and spilled bytes of the kernel the last call compiled (new in the direct-launch cache)."""
    new = [entry[0] for key, entry in kernel._compiled.items() if key not in before]
    if not new or getattr(new[0], "n_regs", None) is None:
        return "-"
    return f"{new[0].n_regs}/{new[0].n_spills}"


def with_config(entries: dict, bd: int, cfg, run):
    """run() with entries[bd] = cfg (the table entry restored after); a kernel that hangs past ROW_LIMIT_S ends the
    script with a traceback."""
    default = entries[bd]
    entries[bd] = cfg
    faulthandler.dump_traceback_later(ROW_LIMIT_S, exit=True)
    try:
        return run()
    finally:
        faulthandler.cancel_dump_traceback_later()
        entries[bd] = default


class Sweep:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = time.perf_counter()
        self.best: dict[tuple[bool, int], tuple[float, Fwd]] = {}  # (causal, padded D) -> (ms, config)
        self.default_ms: dict[tuple[bool, int], float] = {}
        self.cases: dict[tuple, tuple] = {}
        print(f"{torch.cuda.get_device_name(device)}, {DTYPE}, forward only")
        print(f"{'shape':<20}{'causal':<7}{'variant':<15}{'config':<17}{'path':<16}{'ms':>8}{'TFLOP/s':>9}{'x cuDNN':>8}"
              f"{'error':>10}{'regs/spill':>11}{'at s':>6}")  # fmt: skip

    def row(self, shape, causal, label, config, route, ms, flops, cudnn_ms, error, resources) -> None:
        name = "x".join(map(str, shape))
        print(f"{name:<20}{str(causal):<7}{label:<15}{config:<17}{route:<16}{ms:8.3f}{flops / ms / 1e9:9.0f}"
              f"{cudnn_ms / ms:8.2f}{error:10.1e}{resources:>11}{time.perf_counter() - self.start:6.0f}")  # fmt: skip

    def inputs(self, shape, causal: bool):
        """(q, k, v, the float32 reference, cuDNN's ms) of a shape, made and timed once (the cuDNN row printed then)."""
        key = (shape, causal)
        if key not in self.cases:
            b, h, length, d = shape
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, length, d, device=self.device, dtype=DTYPE) for _ in range(3))
            expected = reference(q, k, v, causal)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            with torch.no_grad():
                cudnn_ms = gpu_time_ms(cudnn, self.device)[0]["median"]
                error = relative_rms_error(cudnn(), expected)
            self.row(shape, causal, "sdpa cudnn", "", "", cudnn_ms, flops(shape, causal), cudnn_ms, error, "-")
            self.cases[key] = (q, k, v, expected, cudnn_ms)
        return self.cases[key]

    def shape(self, shape, causal: bool, variants: dict[str, Fwd]) -> None:
        q, k, v, expected, cudnn_ms = self.inputs(shape, causal)
        with torch.no_grad():
            bd = kernels.block_d(shape[3])
            entries = table(causal)
            default = entries[bd]
            best_ms, best_cfg = float("inf"), default
            for label, cfg in variants.items():
                run = lambda: self.variant(shape, causal, label, cfg, q, k, v, expected, cudnn_ms)  # noqa: E731
                ms = with_config(entries, bd, cfg, run)
                if label == "default":
                    self.default_ms[causal, bd] = ms
                if ms < best_ms:
                    best_ms, best_cfg = ms, cfg
        if best_ms < float("inf"):
            print(f"-- fastest: {code(best_cfg)} ({best_ms:.3f} ms, {cudnn_ms / best_ms:.2f}x cuDNN)")
            if (causal, bd) not in self.best or best_ms < self.best[causal, bd][0]:
                self.best[causal, bd] = (best_ms, best_cfg)

    def variant(self, shape, causal, label, cfg, q, k, v, expected, cudnn_ms) -> float:
        """The row of one config (already in the table): its time, or inf when it fails or is wrong."""
        run = lambda: flash_attention(q, k, v, causal=causal, backend="triton")  # noqa: E731
        before = set(kernels._fwd_kernel._compiled)
        try:
            with poison_outputs():
                out = run()
        except Exception as exc:  # a compile failure: report it, go on with the other rows
            print(f"  {label} {describe(cfg)}: FAILED {type(exc).__name__}: {str(exc).strip().splitlines()[0][:150]}")
            return float("inf")
        error = relative_rms_error(out, expected)
        route = path(kernels.forward_variant(q, k, v, causal)[1])
        if not error <= RTOL[DTYPE]:  # also NaN
            print(f"  {label} {describe(cfg)} ({route}): WRONG, relative RMS error {error:.1e}, bound {RTOL[DTYPE]:.0e}")
            return float("inf")
        ms = gpu_time_ms(run, self.device)[0]["median"]
        resources = compiled_resources(before)
        self.row(shape, causal, label, describe(cfg), route, ms, flops(shape, causal), cudnn_ms, error, resources)
        return ms

    def summary(self) -> None:
        print("fastest per table entry (at the swept shape, against the default's time there):")
        for (causal, bd), (ms, cfg) in sorted(self.best.items()):
            kind = "fwd_causal" if causal else "fwd"
            default_ms = self.default_ms.get((causal, bd), float("nan"))
            print(f'  CONFIGS_16BIT["{kind}"][{bd}] = {code(cfg)}  # {ms:.3f} ms, default {default_ms:.3f} ms')


# --------------------------------------------------------------------------- backward


def table_name(kernel: str, causal: bool) -> str:
    """The CONFIGS_16BIT table a backward row sets: the fused kernel's is one for both causalities."""
    return kernel if kernel == "fused" else kernels.backward_kind(kernel, causal)


def bwd_flops(shape, causal: bool) -> float:
    return 3.5 * flops(shape, causal)  # forward + backward (5 products against the forward's 2)


def reference_grads(q, k, v, do, causal: bool) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of SDPA's math backend in float32, a few batch rows at a time."""
    b, h, length, _ = q.shape
    chunk = max(1, REFERENCE_BYTES // (h * length * length * 4))
    parts = []
    with sdpa_kernel(SDPBackend.MATH):
        for i in range(0, b, chunk):
            rows = slice(i, i + chunk)
            inputs = [x[rows].detach().float().requires_grad_() for x in (q, k, v)]
            out = F.scaled_dot_product_attention(*inputs, is_causal=causal)
            parts.append(torch.autograd.grad(out, inputs, do[rows].float()))
    return tuple(torch.cat(grads) for grads in zip(*parts))


def grads_error(grads, expected) -> float:
    """The largest relative RMS error of dq, dk, dv (NaN if any is)."""
    errors = [relative_rms_error(g, e) for g, e in zip(grads, expected)]
    return float("nan") if any(math.isnan(e) for e in errors) else max(errors)


class BackwardSweep:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = time.perf_counter()
        self.ms: dict[tuple[str, int], dict[Bwd, dict[tuple, float]]] = {}  # (kernel, padded D) -> config -> case -> ms
        self.defaults: dict[tuple[str, int], Bwd] = {}
        self.cases: dict[tuple, tuple] = {}
        print(f"{torch.cuda.get_device_name(device)}, {DTYPE}, forward + backward")
        print(f"{'shape':<20}{'causal':<7}{'kernel':<7}{'variant':<13}{'config':<17}{'path':<10}{'ms':>8}{'TFLOP/s':>9}"
              f"{'x cuDNN':>8}{'error':>10}{'regs/spill':>11}{'at s':>6}")  # fmt: skip

    def row(self, shape, causal, kernel, label, config, route, ms, cudnn_ms, error, resources) -> None:
        name = "x".join(map(str, shape))
        print(f"{name:<20}{str(causal):<7}{kernel:<7}{label:<13}{config:<17}{route:<10}{ms:8.3f}"
              f"{bwd_flops(shape, causal) / ms / 1e9:9.0f}{cudnn_ms / ms:8.2f}{error:10.1e}{resources:>11}"
              f"{time.perf_counter() - self.start:6.0f}")  # fmt: skip

    def inputs(self, shape, causal: bool):
        """(q, k, v, do, the float32 reference gradients, cuDNN's ms), made and timed once per case."""
        key = (shape, causal)
        if key not in self.cases:
            b, h, length, d = shape
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, h, length, d, device=self.device, dtype=DTYPE) for _ in range(4))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            expected = reference_grads(q, k, v, do, causal)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                return torch.autograd.grad(out, (q, k, v), do)

            cudnn_ms = gpu_time_ms(cudnn, self.device)[0]["median"]
            self.row(shape, causal, "", "sdpa cudnn", "", "", cudnn_ms, cudnn_ms, grads_error(cudnn(), expected), "-")
            self.cases[key] = (q, k, v, do, expected, cudnn_ms)
        return self.cases[key]

    def shape(self, shape, causal: bool, kernel: str, variants: dict[str, Bwd]) -> None:
        q, k, v, do, expected, cudnn_ms = self.inputs(shape, causal)
        bd = kernels.block_d(shape[3])
        name = table_name(kernel, causal)
        entries = kernels.CONFIGS_16BIT[name]
        default = entries[bd]
        self.defaults[name, bd] = default
        times = self.ms.setdefault((name, bd), {})
        best_ms, best_cfg = float("inf"), default
        for label, cfg in variants.items():
            run = lambda: self.variant(shape, causal, kernel, label, cfg, q, k, v, do, expected, cudnn_ms)  # noqa: E731
            ms = with_config(entries, bd, cfg, run)
            times.setdefault(cfg, {})[shape, causal] = ms
            if ms < best_ms:
                best_ms, best_cfg = ms, cfg
        if best_ms < float("inf"):
            print(f"-- fastest {kernel}: {code(best_cfg)} ({best_ms:.3f} ms, {cudnn_ms / best_ms:.2f}x cuDNN)")

    def variant(self, shape, causal, kernel, label, cfg, q, k, v, do, expected, cudnn_ms) -> float:
        """The row of one config (already in the table): forward + backward ms, or inf when it fails or is wrong."""

        def run():
            out = flash_attention(q, k, v, causal=causal, backend="triton")
            return torch.autograd.grad(out, (q, k, v), do)

        jit = {"dkdv": kernels._bwd_dkdv_kernel, "dq": kernels._bwd_dq_kernel, "fused": kernels._bwd_fused_kernel}[kernel]
        kernels.BACKWARD = "fused" if kernel == "fused" else "split"
        try:
            return self.timed_row(shape, causal, kernel, label, cfg, run, jit, q, k, v, do, expected, cudnn_ms)
        finally:
            kernels.BACKWARD = None

    def timed_row(self, shape, causal, kernel, label, cfg, run, jit, q, k, v, do, expected, cudnn_ms) -> float:
        before = set(jit._compiled)
        try:
            with poison_outputs():
                grads = run()
        except Exception as exc:  # a compile failure: report it, go on with the other rows
            reason = str(exc).strip().splitlines()[0][:150]
            print(f"  {kernel} {label} {describe(cfg)}: FAILED {type(exc).__name__}: {reason}")
            return float("inf")
        error = grads_error(grads, expected)
        if kernel == "fused":
            route = "store" if shape[2] <= cfg.block_n else "atom"
        else:
            variant = kernels.backward_variant(kernel, q, k, v, do, causal=causal)[1]
            route = ("tma" if variant["TMA"] else "ptr") + (" split" if variant["D_HI"] else "")
            lse = torch.empty(shape[:3], device=q.device)  # as the forward's lse and the dq kernel's delta
            if kernel == "dkdv" and kernels.lse_delta_variant(cfg, lse, lse, variant["TMA"]):
                route += " lse"
        bound = gradient_tolerance(DTYPE)
        if not error <= bound:  # also NaN
            wrong = f"WRONG, relative RMS error {error:.1e}, bound {bound:.0e}"
            print(f"  {kernel} {label} {describe(cfg)} ({route}): {wrong}")
            return float("inf")
        ms = gpu_time_ms(run, self.device)[0]["median"]
        resources = compiled_resources(before, jit)
        self.row(shape, causal, kernel, label, describe(cfg), route, ms, cudnn_ms, error, resources)
        return ms

    def summary(self) -> None:
        print("fastest per table entry (total forward + backward ms over the shapes swept at it, against the default):")
        for (kernel, bd), times in sorted(self.ms.items()):
            cases = set().union(*(set(t) for t in times.values()))
            total = {cfg: sum(t.get(case, float("inf")) for case in cases) for cfg, t in times.items()}
            best = min(total, key=total.get)
            if total[best] == float("inf"):
                continue
            default_ms = total.get(self.defaults[kernel, bd], float("nan"))
            per_case = ", ".join(
                f"{'x'.join(map(str, shape))}{' causal' if causal else ''} {times[best][shape, causal]:.3f}"
                for shape, causal in sorted(cases)
            )
            print(f'  CONFIGS_16BIT["{kernel}"][{bd}] = {code(best)}  # {total[best]:.3f} ms ({per_case}), '
                  f"default {default_ms:.3f} ms")  # fmt: skip


def main(device: torch.device, parts: str, only: str | None = None, kernel_only: str | None = None) -> None:
    start = time.perf_counter()

    def wanted(shape) -> bool:
        return only is None or "x".join(map(str, shape)) in only.split(",")

    if parts in ("fwd", "both"):
        sweep = Sweep(device)
        for shape, causal, variants in filter(lambda entry: wanted(entry[0]), SWEEP):
            sweep.shape(shape, causal, {"default": table(causal)[kernels.block_d(shape[3])]} | variants)
        sweep.summary()
    if parts in ("bwd", "both"):
        backward = BackwardSweep(device)
        for shape, causal, per_kernel in filter(lambda entry: wanted(entry[0]), BWD_SWEEP):
            for kernel, variants in per_kernel.items():
                if kernel_only not in (None, kernel):
                    continue
                default = kernels.CONFIGS_16BIT[table_name(kernel, causal)][kernels.block_d(shape[3])]
                backward.shape(shape, causal, kernel, {"default": default} | variants)
        backward.summary()
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="?", choices=("fwd", "bwd", "both"), default="both", help="which sweep to run")
    parser.add_argument("--only", help="shapes, as BxHxLxD[,BxHxLxD...] (e.g. 256x4x256x16)")
    parser.add_argument("--kernel", choices=("dkdv", "dq", "fused"), help="backward: sweep only this kernel's table")
    parser.add_argument(
        "--delta-in-dq", action=argparse.BooleanOptionalAction, default=kernels.DELTA_IN_DQ,
        help="split backward rows with triton.DELTA_IN_DQ on (the module's default) or off",
    )  # fmt: skip
    args = parser.parse_args()
    kernels.DELTA_IN_DQ = args.delta_in_dq
    main(torch.device("cuda", torch.cuda.current_device()), args.parts, args.only, args.kernel)
