"""The l2norm forward at 32768 x 4096 bf16 in a few access patterns, beside torch.compile, on the GPU.

    bash .device/gpu python scripts/l2norm_forward_variants.py [--rounds 7]

Every variant moves the same bytes (x read once, y written once; torch.compile's generated code reads x twice, the
second time from L2). GPU time as the benchmark takes it (CUDA-graph replays, L2 flushed first), median over
interleaved rounds (fastest round):
- product: runtime.accelerators.l2norm (Triton, no autograd: the infer path)
- streaming store: the same kernel, y stored with the .cs (evict-first) cache hint
- persistent: one program per SM x PER_SM, each striding over the rows and loading its next row before it
  reduces and stores the current one (two rows in flight per program)
- rows x warps: tiles of several rows
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from runtime.accelerators import l2norm
from runtime.accelerators.backends import sm_count
from runtime.accelerators.l2norm.reference import l2norm_reference
from runtime.benchmark.timing import gpu_time_ms


@triton.jit
def _rows_kernel(x_ptr, y_ptr, n_rows, N, eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, CACHE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) + eps)
    tl.store(y_ptr + offsets, (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=mask, cache_modifier=CACHE)


@triton.jit
def _persistent_kernel(x_ptr, y_ptr, n_rows, N, eps, BLOCK_N: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    row = tl.program_id(0)
    step = tl.num_programs(0)
    x = tl.load(x_ptr + row.to(tl.int64) * N + cols, mask=col_mask & (row + 0 * cols < n_rows), other=0.0)
    while row < n_rows:
        following = row + step
        x_next = tl.load(
            x_ptr + following.to(tl.int64) * N + cols, mask=col_mask & (following + 0 * cols < n_rows), other=0.0
        )
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) + eps)
        tl.store(y_ptr + row.to(tl.int64) * N + cols, (xf * rstd).to(y_ptr.dtype.element_ty), mask=col_mask)
        x = x_next
        row = following


def rows_variant(rows: int, warps: int, cache: str = ""):
    def run(x):
        y = torch.empty_like(x)
        n_rows, n = x.shape
        _rows_kernel[(triton.cdiv(n_rows, rows),)](
            x, y, n_rows, n, 1e-6, BLOCK_N=triton.next_power_of_2(n), ROWS=rows, CACHE=cache, num_warps=warps
        )
        return y

    return run


def persistent_variant(per_sm: int, warps: int):
    def run(x):
        y = torch.empty_like(x)
        n_rows, n = x.shape
        programs = min(n_rows, sm_count(x.device) * per_sm)
        _persistent_kernel[(programs,)](x, y, n_rows, n, 1e-6, BLOCK_N=triton.next_power_of_2(n), num_warps=warps)
        return y

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device("cuda")
    x = torch.randn(32768, 4096, device=device, dtype=torch.bfloat16)
    expect = l2norm_reference(x.double())
    candidates = {
        "torch.compile": torch.compile(l2norm_reference, dynamic=False),
        "product (triton infer)": lambda t: l2norm(t, backend="triton"),
        "1 row x 8 warps": rows_variant(1, 8),
        "1 row x 8 warps, .cs store": rows_variant(1, 8, ".cs"),
        "2 rows x 16 warps": rows_variant(2, 16),
        "4 rows x 16 warps": rows_variant(4, 16),
        "persistent 4/SM x 8 warps": persistent_variant(4, 8),
        "persistent 8/SM x 4 warps": persistent_variant(8, 4),
        "persistent 2/SM x 16 warps": persistent_variant(2, 16),
    }
    times = {label: [] for label in candidates}
    with torch.no_grad():
        for label, fn in candidates.items():
            error = ((fn(x).double() - expect).norm() / expect.norm()).item()
            assert error < 1e-2, f"{label}: relative error {error:.1e}"
        for _ in range(args.rounds):
            for label, fn in candidates.items():
                times[label].append(1e3 * gpu_time_ms(lambda fn=fn: fn(x), device)[0]["median"])
    print(f"{torch.cuda.get_device_name()}, l2norm forward 32768x4096 bf16, GPU us: median of {args.rounds} rounds (fastest)")
    for label, samples in times.items():
        print(f"  {label:30s} {statistics.median(samples):7.2f} ({min(samples):7.2f})")


if __name__ == "__main__":
    main()
