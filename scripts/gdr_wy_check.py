"""The WY factors (triton.prepare) with triton.HALF_WY on against off, per K, V and dtype (GPU machine): relative RMS
differences of w and u, to locate a shape where the bf16-operand products go wrong.

    bash .device/gpu python scripts/gdr_wy_check.py              (HALF_WY as the launcher applies it: triton._half_wy)
    bash .device/gpu python scripts/gdr_wy_check.py unguarded    (bf16 products wherever the inputs are half)

"unguarded" drops _half_wy's width rule, so the Triton 3.6 fault it avoids shows again (session 18: K = 64, V = 32
a wrong u; K = 128, V = 32 an illegal memory access, which ends the process).
"""

import sys

import torch
import torch.nn.functional as F

from runtime.accelerators.gated_delta_rule import triton as kernels
from runtime.accelerators.testing import relative_rms_error


def main():
    if "unguarded" in sys.argv[1:]:
        kernels._half_wy = lambda k, BK, BV: kernels.HALF_WY and kernels._half_dots(k)
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for K in (16, 32, 64, 128):
            for V in (16, 32, 64, 128):
                for H, HV in ((1, 4),):
                    if dtype == torch.float16 and K != V:
                        continue
                    B, T = 1, 1000
                    k = torch.randn(B, T, H, K, device="cuda", dtype=dtype)
                    v = torch.randn(B, T, HV, V, device="cuda", dtype=dtype)
                    g = F.logsigmoid(torch.randn(B, T, HV, device="cuda") + 2.0).to(dtype)
                    beta = torch.rand(B, T, HV, device="cuda", dtype=dtype)
                    chunks = kernels.Chunks.of(v, None)
                    results = {}
                    for half in (False, True):
                        kernels.HALF_WY = half
                        results[half] = kernels.prepare(k, v, g, beta, True, chunks, "tf32")
                    kernels.HALF_WY = True
                    w0, u0 = results[False][1:3]
                    w1, u1 = results[True][1:3]
                    ew, eu = relative_rms_error(w1, w0), relative_rms_error(u1, u0)
                    flag = "  <-- WRONG" if not (ew < 1e-2 and eu < 1e-2) else ""
                    half = kernels._half_wy(k, min(K, 64), min(V, 64))  # the blocks prepare launches for half inputs
                    print(f"{str(dtype)[6:]:9s} K={K:3d} V={V:3d} H={H} HV={HV} half={half!s:5s} w {ew:.1e}  u {eu:.1e}{flag}",
                          flush=True)


main()
