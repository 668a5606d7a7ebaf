"""Copy and read-only (sum) bandwidth on the GPU by dtype and size, timed as the benchmark times GPU time.

    bash .device/gpu python scripts/copy_probe.py

Why the benchmark's copy reference copies 256 MiB (runtime.benchmark.timing.copy_bandwidth_tbs): session 27 on an
H100 gave 3.05-3.06 TB/s at 256 MiB and 2.44 at 1 GiB for every dtype
(docs/benchmark/results/copy-probe-2026-11-24-h100-s27.txt).
"""

import torch

from runtime.benchmark.timing import gpu_time_ms


def main() -> None:
    device = torch.device("cuda")
    for dtype in (torch.uint8, torch.int32, torch.bfloat16, torch.float32):
        for nbytes in (2**28, 2**30):
            src = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
            dst = torch.empty_like(src)
            copy, _ = gpu_time_ms(lambda: dst.copy_(src), device, replays=20)
            read, _ = gpu_time_ms(lambda: src.sum(), device, replays=20)
            print(
                f"{str(dtype):16s} {nbytes / 2**20:6.0f} MiB copy {2 * nbytes / (copy['median'] * 1e-3) / 1e12:5.2f} TB/s"
                f"  read-only sum {nbytes / (read['median'] * 1e-3) / 1e12:5.2f} TB/s"
            )


if __name__ == "__main__":
    main()
