"""Causal Triton flash attention with its programs in heavy-first sections of several sizes, on the GPU.

    bash .device/gpu python scripts/fa_order_sweep.py [--only BxHxLxD,...]

A causal program's work grows with its block's distance from the diagonal. Each row sets a section size
(`heavy_first`, see runtime/accelerators/flash_attention/triton.py) in the "fwd_causal", "dkdv" and "dq" entries at
the shape's head dim (one for all three, or one each with --sections), 0 being the launch order, and times the public flash_attention forward alone and forward +
backward (torch.autograd.grad of q, k, v), GPU time as `python -m runtime.benchmark` takes it (CUDA-graph replays, L2
flushed first, median ms), beside cuDNN. Each row is checked first against SDPA's math backend in float32 (outputs
and gradients poisoned with NaN before; bound: the bf16 gradient tolerance). A row that runs past ROW_LIMIT_S ends
the script with a traceback.

Session 26 also ran the same order in the TileLang kernels (the block and (batch, head) indices computed from the
launch index in the kernel): at 4x16x4096x128 causal, forward / forward+backward 1.555 / 5.595 ms with sections of 4
and 1.592 / 6.028 with 8, against 0.820 / 2.961 in launch order. It was taken out again.
"""

from __future__ import annotations

import argparse
import faulthandler
import time

import torch
import torch.nn.functional as F
from fa_sweep import grads_error, reference_grads
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.flash_attention import flash_attention
from runtime.accelerators.flash_attention import triton as triton_fa
from runtime.accelerators.testing import gradient_tolerance
from runtime.benchmark.timing import gpu_time_ms

DTYPE = torch.bfloat16
SHAPES = ["4x16x4096x128", "64x4x2048x48", "128x8x1024x32", "256x4x256x16"]
SECTIONS = (0, 1, 4, 8, 16)
ROW_LIMIT_S = 150


def triton_tables(d: int):
    """(table, key) of each causal Triton entry at head dim d (16-bit tables)."""
    bd = triton_fa.block_d(d)
    return [(triton_fa.CONFIGS_16BIT[kind], bd) for kind in ("fwd_causal", "dkdv", "dq")]


def with_section(tables, sections: tuple[int, ...], run):
    """run() with heavy_first = sections[i] in the entry tables[i] (restored after)."""
    saved = [table[key] for table, key in tables]
    for (table, key), section in zip(tables, sections):
        table[key] = table[key]._replace(heavy_first=section)
    faulthandler.dump_traceback_later(ROW_LIMIT_S, exit=True)
    try:
        return run()
    finally:
        faulthandler.cancel_dump_traceback_later()
        for (table, key), entry in zip(tables, saved):
            table[key] = entry


def shape_rows(shape, rows: list[tuple[int, int, int]], device, start) -> None:
    b, h, length, d = shape
    name = "x".join(map(str, shape))
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, length, d, device=device, dtype=DTYPE) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    expected = reference_grads(q, k, v, do, True)
    bound = gradient_tolerance(DTYPE)

    def cudnn_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        cudnn_fwd_ms = gpu_time_ms(cudnn_fwd, device)[0]["median"]
    cudnn_ms = gpu_time_ms(lambda: torch.autograd.grad(cudnn_fwd(), (q, k, v), do), device)[0]["median"]
    print(f"{name:<16}{'cudnn':<10}{'':>8}{cudnn_fwd_ms:9.3f}{cudnn_ms:9.3f}{1:8.2f}{1:8.2f}")

    def forward():
        with torch.no_grad():
            return flash_attention(q, k, v, causal=True, backend="triton")

    def run():
        return torch.autograd.grad(flash_attention(q, k, v, causal=True, backend="triton"), (q, k, v), do)

    def measure():
        with poison_outputs():
            error = grads_error(run(), expected)
        if not error <= bound:
            return None, None, error
        return gpu_time_ms(forward, device)[0]["median"], gpu_time_ms(run, device)[0]["median"], error

    for sections in rows:
        fwd_ms, ms, error = with_section(triton_tables(d), sections, measure)
        label = "/".join(map(str, sections))
        if fwd_ms is None:
            print(f"{name:<16}{'triton':<10}{label:>8}  WRONG: relative RMS error {error:.1e}")
            continue
        print(
            f"{name:<16}{'triton':<10}{label:>8}{fwd_ms:9.3f}{ms:9.3f}{cudnn_fwd_ms / fwd_ms:8.2f}"
            f"{cudnn_ms / ms:8.2f}{error:10.1e}{time.perf_counter() - start:6.0f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(SHAPES), help="comma-separated BxHxLxD shapes")
    parser.add_argument(
        "--sections", default="", help="rows as forward/dkdv/dq sections, e.g. 4/4/4,4/2/8 (default: one per SECTIONS)"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.only.split(",")]
    if args.sections:
        rows = [tuple(int(n) for n in row.split("/")) for row in args.sections.split(",")]
    else:
        rows = [(section,) * 3 for section in SECTIONS]
    start = time.perf_counter()
    print(f"{torch.cuda.get_device_name(device)}, {DTYPE}, causal; sections forward/dkdv/dq")
    print(f"{'shape':<16}{'backend':<10}{'section':>8}{'fwd ms':>9}{'f+b ms':>9}{'fwd x':>8}{'f+b x':>8}"
          f"{'error':>10}{'at s':>6}")  # fmt: skip
    for shape in shapes:
        shape_rows(shape, rows, device, start)
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
