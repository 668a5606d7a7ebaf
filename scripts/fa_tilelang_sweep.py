"""Forward configs of the TileLang flash attention on the GPU, beside SDPA's cuDNN backend.

    bash .device/gpu python scripts/fa_tilelang_sweep.py [--only BxHxLxD,...]   (GPU machine, repo root)

Each row puts one FwdConfig (tiles, stages, threads, programs per SM, overlap: see
runtime/accelerators/flash_attention/tilelang.py) in FWD_CONFIGS at the shape's head dim and runs the public
flash_attention(backend="tilelang"). It is checked first against SDPA's math backend in float32 (relative RMS error
within the bf16 bound of runtime.accelerators.testing, outputs poisoned with NaN beforehand), then timed as
`python -m runtime.benchmark` times GPU time (CUDA-graph replays, L2 flushed before each, median ms). "x cuDNN" is
cuDNN's time over the row's (>= 1: faster than cuDNN).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from fa_sweep import flops, reference
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.flash_attention import flash_attention
from runtime.accelerators.flash_attention import tilelang as kernels
from runtime.accelerators.testing import RTOL, relative_rms_error
from runtime.benchmark.timing import gpu_time_ms

Fwd = kernels.FwdConfig
DTYPE = torch.bfloat16
NARROW = Fwd(64, 128, 2, 128, 2)  # one compute warpgroup, two programs per SM
WIDE = Fwd(128, 128, 2, 256)  # two compute warpgroups, one program per SM
NARROW_OVERLAP, WIDE_OVERLAP = replace(NARROW, overlap=True), replace(WIDE, overlap=True)
SMALL = {"narrow": NARROW, "narrow ovl": NARROW_OVERLAP, "wide": WIDE, "wide ovl": WIDE_OVERLAP}

# (B, H, L, D), causal, {label: config}
SWEEP = [
    ((4, 16, 4096, 128), False, {"wide": WIDE, "wide ovl": WIDE_OVERLAP}),
    ((4, 16, 4096, 128), True, {"wide": WIDE, "wide ovl": WIDE_OVERLAP}),
    ((16, 16, 2048, 64), False, {"wide": WIDE, "wide ovl": WIDE_OVERLAP}),
    ((16, 16, 2048, 64), True, {"wide": WIDE, "wide ovl": WIDE_OVERLAP}),
    ((64, 4, 2048, 48), False, SMALL),
    ((64, 4, 2048, 48), True, SMALL),
    ((128, 8, 1024, 32), False, SMALL),
    ((128, 8, 1024, 32), True, SMALL),
    ((256, 4, 256, 16), False, {"narrow": NARROW, "narrow ovl": NARROW_OVERLAP}),
]  # fmt: skip


def describe(cfg: Fwd) -> str:
    return f"{cfg.block_m}x{cfg.block_n} {cfg.threads}t {cfg.stages}st {cfg.min_blocks}/SM" + (" ovl" if cfg.overlap else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated BxHxLxD shapes")
    only = set(filter(None, parser.parse_args().only.split(",")))
    device = torch.device("cuda")
    start = time.perf_counter()
    print(f"{torch.cuda.get_device_name(device)}, {DTYPE}, TileLang forward")
    print(f"{'shape':<20}{'causal':<7}{'variant':<14}{'config':<28}{'ms':>8}{'TFLOP/s':>9}{'x cuDNN':>8}{'error':>10}{'at s':>6}")
    for shape, causal, variants in SWEEP:
        name = "x".join(map(str, shape))
        if only and name not in only:
            continue
        b, h, length, d = shape
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, length, d, device=device, dtype=DTYPE) for _ in range(3))
        expected = reference(q, k, v, causal)
        work = flops(shape, causal)

        def row(label, config, ms, cudnn_ms, error):
            print(f"{name:<20}{str(causal):<7}{label:<14}{config:<28}{ms:8.3f}{work / ms / 1e9:9.0f}{cudnn_ms / ms:8.2f}"
                  f"{error:10.1e}{time.perf_counter() - start:6.0f}")  # fmt: skip

        with torch.no_grad():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                cudnn_ms = gpu_time_ms(cudnn, device)[0]["median"]
                row("sdpa cudnn", "", cudnn_ms, cudnn_ms, relative_rms_error(cudnn(), expected))
            default = kernels.FWD_CONFIGS[d]
            for label, cfg in variants.items():
                kernels.FWD_CONFIGS[d] = cfg
                try:
                    run = lambda: flash_attention(q, k, v, causal=causal, backend="tilelang")  # noqa: E731
                    try:
                        with poison_outputs():
                            out = run()
                    except Exception as exc:  # a compile failure: report it, go on with the other rows
                        print(f"  {label} {describe(cfg)}: FAILED {type(exc).__name__}: {str(exc).strip().splitlines()[0][:150]}")
                        continue
                    error = relative_rms_error(out, expected)
                    if not error <= RTOL[DTYPE]:  # also NaN
                        print(f"  {label} {describe(cfg)}: WRONG, relative RMS error {error:.1e}, bound {RTOL[DTYPE]:.0e}")
                        continue
                    row(label, describe(cfg), gpu_time_ms(run, device)[0]["median"], cudnn_ms, error)
                finally:
                    kernels.FWD_CONFIGS[d] = default
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
