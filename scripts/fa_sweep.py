"""Forward variants of the Triton flash attention on the GPU, beside SDPA's cuDNN backend.

    bash .device/gpu python scripts/fa_sweep.py        (GPU machine, repo root; about 2 minutes with compiles)

Each row puts one FwdConfig (tiles, warps, stages and the variant flags tma / heavy_first, see
runtime/accelerators/flash_attention/triton.py) in CONFIGS_16BIT["fwd"] or ["fwd_causal"] at the shape's padded head
dim and runs the public flash_attention(backend="triton"), as a model would. It is checked first against SDPA's
math backend in float32 (relative RMS error within the bf16 bound of runtime.accelerators.testing, outputs poisoned
with NaN beforehand), then timed as `python -m runtime.benchmark` times GPU time (CUDA-graph replays, L2 flushed
before each, median ms). "path" is what the launcher really ran: tma (descriptor loads, CUDA capability >= 9.0
only) or ptr, plus heavy (causal, last query blocks first). "x cuDNN" is cuDNN's time over the row's (>= 1: faster
than cuDNN). regs/spill: registers per thread and spilled bytes of the compiled kernel. A row that fails to compile
or misses the bound is reported and left out; one that runs past ROW_LIMIT_S (a hung kernel) ends the script. The
script ends with the fastest config per table entry.

"default" is the table's entry as imported: since session 14 (H100) the TMA winners of this sweep, at (4,16,4096,128)
tma 0.983 ms (pointer 1.136, cuDNN 0.865), causal tma+heavy 0.596 ms (pointer 0.664, cuDNN 0.486); the other rows
are the alternatives, pointer loads with the same tiles among them, to check the defaults still win.
"""

from __future__ import annotations

import faulthandler
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.flash_attention import flash_attention
from runtime.accelerators.flash_attention import triton as kernels
from runtime.accelerators.testing import RTOL, relative_rms_error
from runtime.benchmark.timing import gpu_time_ms

Fwd = kernels.FwdConfig
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
    }),
    ((64, 4, 2048, 48), True, {
        "heavy": Fwd(128, 64, 8, 4, heavy_first=True),
        "tma heavy": Fwd(128, 64, 8, 4, tma=True, heavy_first=True),
    }),
    ((128, 8, 1024, 32), False, {
        "tma": Fwd(64, 64, 4, 3, tma=True),
        "tma m128": Fwd(128, 64, 8, 3, tma=True),
    }),
]  # fmt: skip


def table(causal: bool) -> dict:
    return kernels.CONFIGS_16BIT["fwd_causal" if causal else "fwd"]


def describe(cfg: Fwd) -> str:
    return f"{cfg.block_m}x{cfg.block_n} {cfg.num_warps}w {cfg.num_stages}st"


def code(cfg: Fwd) -> str:
    """FwdConfig(128, 128, 8, 3, tma=True): the flags that are set, as one would write it in the table."""
    flags = "".join(f", {name}=True" for name in ("tma", "heavy_first") if getattr(cfg, name))
    return f"FwdConfig({cfg.block_m}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}{flags})"


def path(flags: dict) -> str:
    return ("tma" if flags["TMA"] else "ptr") + (" heavy" if flags["HEAVY_FIRST"] else "")


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


def compiled_resources(before: set) -> str:
    """Registers and spilled bytes of the kernel the last call compiled (new in the direct-launch cache)."""
    new = [compiled for key, (compiled, _) in kernels._fwd_kernel._compiled.items() if key not in before]
    if not new or getattr(new[0], "n_regs", None) is None:
        return "-"
    return f"{new[0].n_regs}/{new[0].n_spills}"


class Sweep:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = time.perf_counter()
        self.best: dict[tuple[bool, int], tuple[float, Fwd]] = {}  # (causal, padded D) -> (ms, config)
        self.default_ms: dict[tuple[bool, int], float] = {}
        self.cases: dict[tuple, tuple] = {}
        print(f"{torch.cuda.get_device_name(device)}, {DTYPE}, forward only")
        print(f"{'shape':<20}{'causal':<7}{'variant':<15}{'config':<17}{'path':<14}{'ms':>8}{'TFLOP/s':>9}{'x cuDNN':>8}"
              f"{'error':>10}{'regs/spill':>11}{'at s':>6}")  # fmt: skip

    def row(self, shape, causal, label, config, route, ms, flops, cudnn_ms, error, resources) -> None:
        name = "x".join(map(str, shape))
        print(f"{name:<20}{str(causal):<7}{label:<15}{config:<17}{route:<14}{ms:8.3f}{flops / ms / 1e9:9.0f}"
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
                entries[bd] = cfg
                faulthandler.dump_traceback_later(ROW_LIMIT_S, exit=True)
                try:
                    ms = self.variant(shape, causal, label, cfg, q, k, v, expected, cudnn_ms)
                finally:
                    faulthandler.cancel_dump_traceback_later()
                    entries[bd] = default
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


def main(device: torch.device) -> None:
    sweep = Sweep(device)
    for shape, causal, variants in SWEEP:
        sweep.shape(shape, causal, {"default": table(causal)[kernels.block_d(shape[3])]} | variants)
    sweep.summary()
    print(f"done in {time.perf_counter() - sweep.start:.0f} s")


if __name__ == "__main__":
    main(torch.device("cuda", torch.cuda.current_device()))
