"""Nsight Compute on flash attention: one forward + backward of ours (Triton, or the backend named before a colon:
"tilelang:64x4x2048x48") and of SDPA's cuDNN backend per shape, inside the profiled range (each runs once before it,
to compile). Shapes as BxHxLxD, a trailing "c" for causal:

    bash .device/gpu ncu --profile-from-start off -k 'regex:_fwd_kernel|_bwd_|cudnn' --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section WarpStateStats --page raw \
        python scripts/fa_ncu.py 128x8x1024x32 64x4x2048x48

(session 29: results/flash_attention-ncu-d32-d48-a7c6f1a-2026-11-24-h100-s29.txt, trimmed). TileLang's kernels match
'regex:flash_fwd|flash_bwd'.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.accelerators.flash_attention import flash_attention


def calls(shape: tuple[int, ...], causal: bool, backend: str) -> list:
    """(ours, cuDNN's): each runs forward + backward of the same bf16 inputs."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def ours():
        torch.autograd.grad(flash_attention(q, k, v, causal=causal, backend=backend), (q, k, v), do)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), do)

    return [ours, cudnn]


def main(names: list[str]) -> None:
    functions = []
    for name in names:
        backend, _, shape = name.rpartition(":")
        functions += calls(tuple(int(x) for x in shape.rstrip("c").split("x")), shape.endswith("c"), backend or "triton")
    for fn in functions:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in functions:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(names))


if __name__ == "__main__":
    main(sys.argv[1:] or ["128x8x1024x32"])
