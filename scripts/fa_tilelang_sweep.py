"""Forward (or, with --bwd, backward) configs of the TileLang flash attention on the GPU, beside SDPA's cuDNN backend.

    bash .device/gpu python scripts/fa_tilelang_sweep.py [--bwd] [--only BxHxLxD,...]   (GPU machine, repo root)

Each row puts one FwdConfig (tiles, stages, threads, programs per SM, overlap: see
runtime/accelerators/flash_attention/tilelang.py) in FWD_CONFIGS at the shape's head dim and runs the public
flash_attention(backend="tilelang"). It is checked first against SDPA's math backend in float32 (relative RMS error
within the bf16 bound of runtime.accelerators.testing, outputs poisoned with NaN beforehand), then timed as
`python -m runtime.benchmark` times GPU time (CUDA-graph replays, L2 flushed before each, median ms). "x cuDNN" is
cuDNN's time over the row's (>= 1: faster than cuDNN).

--bwd: each row puts one BwdConfig (BWD_SWEEP: asynchronous products, how dq is accumulated, stages) in BWD_CONFIGS and times forward + backward (torch.autograd.grad of q, k, v; the forward at its FWD_CONFIGS
entry) beside cuDNN's forward + backward. dq, dk and dv are checked first against SDPA's math backend in float32
(gradients poisoned with NaN beforehand; "error" is the largest relative RMS error of the three, bound: the bf16
gradient tolerance of runtime.accelerators.testing). "bwd ms" is the row's time less its forward's (each forward timed
alone once per case). A row that runs past ROW_LIMIT_S (a hung kernel) ends the script with a traceback. Only
4x16x4096x128 unless --only names shapes (16x16x2048x64 has rows too). The kernels are compiled in parallel first
(41 s on the GPU machine); the D = 128 sweep took 106 s on an H100 (session 25).
"""

from __future__ import annotations

import argparse
import faulthandler
import time
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from fa_sweep import flops, grads_error, reference, reference_grads
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.flash_attention import flash_attention
from runtime.accelerators.flash_attention import tilelang as kernels
from runtime.accelerators.testing import RTOL, gradient_tolerance, relative_rms_error
from runtime.accelerators.tilelang_common import precompile
from runtime.benchmark.timing import gpu_time_ms

Fwd = kernels.FwdConfig
DTYPE = torch.bfloat16
NARROW = Fwd(64, 128, 2, 128, 2)  # one compute warpgroup, two programs per SM
WIDE = Fwd(128, 128, 2, 256)  # two compute warpgroups, one program per SM
NARROW_OVERLAP, WIDE_OVERLAP = replace(NARROW, overlap=True), replace(WIDE, overlap=True)
NARROW_64 = Fwd(64, 64, 2, 128, 2)  # 64 keys per step: 90 registers at D = 48 (98 with the overlap), no spills
SMALL = {
    "narrow": NARROW, "narrow ovl": NARROW_OVERLAP, "narrow 3st": replace(NARROW, stages=3),
    "n64": NARROW_64, "n64 ovl": replace(NARROW_64, overlap=True), "wide": WIDE, "wide ovl": WIDE_OVERLAP,
}  # fmt: skip

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


Bwd = kernels.BwdConfig
BWD_128 = kernels.BWD_CONFIGS[128]  # as imported: the default row (overlap, bulk)
BWD_VARIANTS_128 = {
    "default": BWD_128,
    "plain tma": replace(BWD_128, overlap=False, dq="tma"),
    "ovl tma": replace(BWD_128, dq="tma"),
    "bulk": replace(BWD_128, overlap=False),
    "ovl bulk 1st": replace(BWD_128, stages=1),
}


def bwd_variants(dim: int) -> dict:
    """The head dim's default beside both loops with either dq reduction (rows of the D <= 64 shapes)."""
    default = kernels.BWD_CONFIGS[dim]
    return {
        "default": default,
        "plain tma": replace(default, overlap=False, dq="tma"),
        "ovl tma": replace(default, overlap=True, dq="tma"),
        "ovl bulk": replace(default, overlap=True, dq="bulk"),
    }


# (B, H, L, D), causal, {label: config}; the D <= 64 rows only with --only
BWD_SWEEP = [
    ((4, 16, 4096, 128), False, BWD_VARIANTS_128),
    ((4, 16, 4096, 128), True, BWD_VARIANTS_128),
    ((16, 16, 2048, 64), False, bwd_variants(64)),
    ((16, 16, 2048, 64), True, bwd_variants(64)),
    ((64, 4, 2048, 48), False, bwd_variants(48)),
    ((64, 4, 2048, 48), True, bwd_variants(48)),
    ((128, 8, 1024, 32), False, bwd_variants(32)),
    ((128, 8, 1024, 32), True, bwd_variants(32)),
]
BWD_DEFAULT_SHAPES = {"4x16x4096x128"}
ROW_LIMIT_S = 120  # a row's check and timing take seconds (kernels compiled before): past this a kernel hangs


def describe(cfg: Fwd | Bwd) -> str:
    text = f"{cfg.block_m}x{cfg.block_n} {cfg.threads}t {cfg.stages}st {cfg.min_blocks}/SM"
    text += " ovl" if cfg.overlap else ""
    if isinstance(cfg, Bwd):
        text += f" dq={cfg.dq}"
    return text


def first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:150]


def backward_sweep(only: set[str], device: torch.device) -> None:
    start = time.perf_counter()
    cases = [case for case in BWD_SWEEP if "x".join(map(str, case[0])) in (only or BWD_DEFAULT_SHAPES)]
    entries = []
    for (_, _, _, d), causal, variants in cases:
        entries += [kernels.forward_entry(d, DTYPE, causal, False, False), kernels.preprocess_entry(d, DTYPE)]
        entries += [kernels.backward_entry(d, DTYPE, causal, False, False, cfg) for cfg in variants.values()]
    try:
        precompile(list(dict(entries).items()), device)
    except RuntimeError as exc:  # a variant that fails to compile: compiled (and reported) on its own row instead
        print(f"parallel compile failed ({type(exc).__name__}: {first_line(exc)}); compiling per row")
    compile_s = time.perf_counter() - start
    print(f"{torch.cuda.get_device_name(device)}, {DTYPE}, TileLang forward + backward; compiled in {compile_s:.0f} s")
    print(f"{'shape':<20}{'causal':<7}{'variant':<14}{'config':<41}{'ms':>8}{'bwd ms':>8}{'x cuDNN':>8}{'error':>10}"
          f"{'at s':>6}")  # fmt: skip
    for shape, causal, variants in cases:
        backward_case(shape, causal, variants, device, start)
    print(f"done in {time.perf_counter() - start:.0f} s")


def backward_case(shape, causal: bool, variants: dict[str, Bwd], device: torch.device, start: float) -> None:
    """The rows of one shape: cuDNN's, then each config's (BWD_CONFIGS restored after)."""
    name = "x".join(map(str, shape))
    b, h, length, d = shape
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, length, d, device=device, dtype=DTYPE) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    expected = reference_grads(q, k, v, do, causal)
    bound = gradient_tolerance(DTYPE)

    def row(label, config, ms, cudnn_ms, error, fwd_ms=None):
        bwd = f"{ms - fwd_ms:8.3f}" if fwd_ms is not None else f"{'':8}"
        print(f"{name:<20}{causal!s:<7}{label:<14}{config:<41}{ms:8.3f}{bwd}{cudnn_ms / ms:8.2f}{error:10.1e}"
              f"{time.perf_counter() - start:6.0f}")  # fmt: skip

    def cudnn_forward():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def cudnn():
        return torch.autograd.grad(cudnn_forward(), (q, k, v), do)

    def forward():
        with torch.no_grad():
            return flash_attention(q, k, v, causal=causal, backend="tilelang")

    def run():
        out = flash_attention(q, k, v, causal=causal, backend="tilelang")
        return torch.autograd.grad(out, (q, k, v), do)

    cudnn_ms = gpu_time_ms(cudnn, device)[0]["median"]
    with torch.no_grad():
        cudnn_fwd_ms = gpu_time_ms(cudnn_forward, device)[0]["median"]
    row("sdpa cudnn", "", cudnn_ms, cudnn_ms, grads_error(cudnn(), expected), cudnn_fwd_ms)
    fwd_ms = gpu_time_ms(forward, device)[0]["median"]
    print(f"  forward alone: tilelang {fwd_ms:.3f} ms, cudnn {cudnn_fwd_ms:.3f} ms")
    for label, cfg in variants.items():
        measured = try_config(kernels.BWD_CONFIGS, d, label, cfg, run, partial(grads_error, expected=expected), bound)
        if measured:
            ms, error = measured
            row(label, describe(cfg), ms, cudnn_ms, error, fwd_ms)


def try_config(configs: dict, d: int, label: str, cfg, run, error_of, bound: float) -> tuple[float, float] | None:
    """(GPU ms, error) of run() with cfg in configs[d] (restored after): run once with its outputs poisoned, its
    error_of(result) checked against bound, then timed. None, after a line saying why, for a compile failure or a
    wrong result; a row past ROW_LIMIT_S (a hung kernel) ends the script with a traceback."""
    default = configs[d]
    configs[d] = cfg
    faulthandler.dump_traceback_later(ROW_LIMIT_S, exit=True)
    try:
        try:
            with poison_outputs():
                result = run()
        except RuntimeError as exc:  # a compile failure: report it, go on with the other rows
            print(f"  {label} {describe(cfg)}: FAILED {type(exc).__name__}: {first_line(exc)}")
            return None
        error = error_of(result)
        if not error <= bound:  # also NaN
            print(f"  {label} {describe(cfg)}: WRONG, relative RMS error {error:.1e}, bound {bound:.0e}")
            return None
        return gpu_time_ms(run, torch.device("cuda"))[0]["median"], error
    finally:
        faulthandler.cancel_dump_traceback_later()
        configs[d] = default


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated BxHxLxD shapes")
    parser.add_argument("--bwd", action="store_true", help="backward configs (forward + backward timed)")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    if args.bwd:
        backward_sweep(only, torch.device("cuda"))
        return
    device = torch.device("cuda")
    start = time.perf_counter()
    cases = [case for case in SWEEP if not only or "x".join(map(str, case[0])) in only]
    entries = [kernels.forward_entry(d, DTYPE, causal, False, False, cfg) for (*_, d), causal, v in cases for cfg in v.values()]
    try:
        precompile(list(dict(entries).items()), device)
    except RuntimeError as exc:  # a variant that fails to compile: compiled (and reported) on its own row instead
        print(f"parallel compile failed ({type(exc).__name__}: {first_line(exc)}); compiling per row")
    print(f"{torch.cuda.get_device_name(device)}, {DTYPE}, TileLang forward; compiled in {time.perf_counter() - start:.0f} s")
    print(f"{'shape':<20}{'causal':<7}{'variant':<14}{'config':<28}{'ms':>8}{'TFLOP/s':>9}{'x cuDNN':>8}{'error':>10}{'at s':>6}")
    for shape, causal, variants in cases:
        name = "x".join(map(str, shape))
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
            run = lambda: flash_attention(q, k, v, causal=causal, backend="tilelang")  # noqa: E731
            error_of = partial(relative_rms_error, ref=expected)
            for label, cfg in variants.items():
                measured = try_config(kernels.FWD_CONFIGS, d, label, cfg, run, error_of, RTOL[DTYPE])
                if measured:
                    ms, error = measured
                    row(label, describe(cfg), ms, cudnn_ms, error)
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
