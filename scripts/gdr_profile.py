"""Where the gated delta rule's GPU time goes, per kernel (Triton backend; fla beside it when installed).

    bash .device/gpu python scripts/gdr_profile.py [shape ...]      (default: every shape below)

For the issue's shapes (bf16, l2norm in the kernel): CUDA time per kernel name over a few forward and
forward+backward calls, from torch.profiler. The packed shape is one sequence given through cu_seqlens, with twice as
many value heads as q/k heads (GVA).
"""

import sys

import torch
import torch.nn.functional as F

from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule
from runtime.benchmark.timing import kernel_breakdown

SHAPES = {  # (B, T, H, HV, D, packed)
    "B4-T4096-H16-D128": (4, 4096, 16, 16, 128, False),
    "packed32768-H16-HV32-D128": (1, 32768, 16, 32, 128, True),
    "B256-T256-H4-D16": (256, 256, 4, 4, 16, False),
}
CALLS = 3


def inputs(B, T, H, HV, D, packed):
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    q, k, v = make(B, T, H, D), make(B, T, H, D), make(B, T, HV, D)
    g = F.logsigmoid(torch.randn(B, T, HV, device="cuda") + 2.0).to(torch.bfloat16)
    beta = torch.rand(B, T, HV, device="cuda", dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, T], dtype=torch.long) if packed else None  # ours on the host, fla's on the device
    return [x.requires_grad_() for x in (q, k, v, g, beta)], cu_seqlens


def implementations(cu_seqlens):
    def ours(*x):
        return chunk_gated_delta_rule(*x, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, backend="triton")[0]

    found = {"triton": ours}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        on_device = None if cu_seqlens is None else cu_seqlens.cuda()
        found["fla"] = lambda *x: fla_chunk(*x, use_qk_l2norm_in_kernel=True, cu_seqlens=on_device)[0]
    except ImportError:
        pass
    return found


def report(name, fn, tensors, backward):
    def step():
        out = fn(*tensors)
        if backward:
            out.backward(torch.ones_like(out))

    kernels = kernel_breakdown(step, calls=CALLS, top=None)
    total = sum(k["us"] for k in kernels)
    print(f"\n{name} {'fwd+bwd' if backward else 'fwd'}: {total / 1e3:.3f} ms of kernels per call")
    for k in kernels[:12]:
        print(f"  {k['us'] / 1e3:8.3f} ms  x{k['per_call']:<4g} {k['kernel'][:90]}")


def main(names: list[str]):
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for shape, dims in SHAPES.items():
        if names and shape not in names:
            continue
        tensors, cu_seqlens = inputs(*dims)
        for impl, fn in implementations(cu_seqlens).items():
            for backward in (False, True):
                report(f"{shape} {impl}", fn, tensors, backward)


if __name__ == "__main__":
    main(sys.argv[1:])
