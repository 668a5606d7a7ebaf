"""Nsight Compute on the gated delta rule's kernels: ours (Triton) and fla's, one call each inside the profiled range,
on one shape (packed: one sequence of 32768 tokens, H16 HV32 D128; large: B4-T4096-H16-D128), forward alone or
forward + backward (`bwd`). ncu's -k picks the kernels, for example the forward walks:

    bash .device/gpu ncu --profile-from-start off -k 'regex:state_kernel|fwd_kernel_h' --section SpeedOfLight \
        --section WarpStateStats --section LaunchStats --section Occupancy --section InstructionStats \
        python scripts/gdr_ncu.py packed

or step 5 of the backward against fla's WY backward:

    bash .device/gpu ncu --profile-from-start off -k 'regex:grad_wy|prepare_wy_repr_bwd' --section SpeedOfLight \
        --section MemoryWorkloadAnalysis python scripts/gdr_ncu.py large bwd

Each call runs once outside the profiled range first (compiles, fla's autotuning).
"""

import sys

import torch

from gdr_profile import SHAPES, implementations, inputs

NAMES = {"packed": "packed32768-H16-HV32-D128", "large": "B4-T4096-H16-D128"}


def main(shape: str, backward: bool) -> None:
    tensors, cu_seqlens = inputs(*SHAPES[NAMES[shape]])

    def call(fn):
        with torch.set_grad_enabled(backward):
            out = fn(*tensors)
            if backward:
                out.backward(torch.ones_like(out))

    found = implementations(cu_seqlens)
    for fn in found.values():
        call(fn)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in found.values():
        call(fn)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(found), "forward + backward" if backward else "forward")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(next((a for a in args if a in NAMES), "packed"), "bwd" in args)
