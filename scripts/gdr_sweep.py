"""Launch sweep of the gated delta rule's Triton backward kernels (warps and pipeline stages per kernel).

    bash .device/gpu python scripts/gdr_sweep.py [pcvr] [large]      (GPU machine, repo root; default: pcvr)

For each shape (pcvr: B256-T256-H4-D16; large: B4-T4096-H16-D128; bf16, l2norm in the kernel) and each kernel of
KERNELS (see triton.LAUNCH_OVERRIDES), one row per (warps, stages), the other kernels at their defaults: the GPU
time of forward + backward as the benchmark takes it (CUDA graph, L2 flushed), after checking the output and every
gradient against the default launch's (relative RMS error within the bf16 bound). The last lines name the fastest
launch per kernel.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule
from runtime.accelerators.gated_delta_rule import triton as kernels
from runtime.accelerators.testing import RTOL, relative_rms_error
from runtime.benchmark.timing import gpu_time_ms

SHAPES = {"pcvr": (256, 256, 4, 16), "large": (4, 4096, 16, 128)}
KERNELS = ("grad_qk", "grad_wy", "grad_state", "local", "wy", "output")
GRID = {  # (warps, stages) per kernel and K
    16: [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1)],
    128: [(4, 2), (8, 1), (8, 2), (8, 3)],
}


def inputs(B, T, H, D):
    torch.manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = make(B, T, H, D), make(B, T, H, D), make(B, T, H, D)
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 2.0).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def main(shapes: list[str]) -> None:
    start = time.perf_counter()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'shape':<7}{'kernel':<11}{'warps':>6}{'stages':>7}{'ms':>9}{'/default':>9}{'max grad err':>14}{'at s':>6}")
    for shape in shapes:
        B, T, H, D = SHAPES[shape]
        tensors = inputs(B, T, H, D)
        grad_o = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

        def step():
            o = chunk_gated_delta_rule(*tensors, use_qk_l2norm_in_kernel=True, backend="triton")[0]
            return (o.detach(), *torch.autograd.grad(o, tensors, grad_o))

        kernels.LAUNCH_OVERRIDES.clear()
        reference = step()
        default_ms = gpu_time_ms(step, torch.device("cuda"))[0]["median"]
        print(f"{shape:<7}{'all':<11}{'':>6}{'default':>7}{default_ms:9.4f}{1.0:9.3f}{0.0:14.1e}{time.perf_counter() - start:6.0f}")
        for kernel in KERNELS:
            best = None
            for warps, stages in GRID[D]:
                kernels.LAUNCH_OVERRIDES.clear()
                kernels.LAUNCH_OVERRIDES[kernel, D] = dict(num_warps=warps, num_stages=stages)
                try:
                    error = max(relative_rms_error(a, b) for a, b in zip(step(), reference))
                except Exception as failure:  # a launch that does not compile or fit
                    print(f"{shape:<7}{kernel:<11}{warps:6d}{stages:7d}  FAILED {type(failure).__name__}")
                    continue
                if error > RTOL[torch.bfloat16]:
                    print(f"{shape:<7}{kernel:<11}{warps:6d}{stages:7d}  WRONG {error:.1e}")
                    continue
                ms = gpu_time_ms(step, torch.device("cuda"))[0]["median"]
                print(f"{shape:<7}{kernel:<11}{warps:6d}{stages:7d}{ms:9.4f}{ms / default_ms:9.3f}{error:14.1e}"
                      f"{time.perf_counter() - start:6.0f}")  # fmt: skip
                if best is None or ms < best[0]:
                    best = (ms, warps, stages)
            if best:
                print(f"-- {shape} {kernel}: fastest {best[1]} warps, {best[2]} stages ({best[0]:.4f} ms vs default {default_ms:.4f})")
        kernels.LAUNCH_OVERRIDES.clear()
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:] or ["pcvr"])
