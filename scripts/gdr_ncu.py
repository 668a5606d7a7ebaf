"""Nsight Compute on the state walks of the gated delta rule's forward: ours (_chunk_state_kernel) and fla's
(chunk_gated_delta_rule_fwd_kernel_h*), one launch each, on one shape (default: packed).

    bash .device/gpu ncu --profile-from-start off -k 'regex:state_kernel|fwd_kernel_h' --section SpeedOfLight \
        --section WarpStateStats --section LaunchStats --section Occupancy --section InstructionStats \
        python scripts/gdr_ncu.py [packed|large]

Both forwards run once outside the profiled range first (compiles, fla's autotuning), then once each inside it.
"""

import sys

import torch

from gdr_profile import SHAPES, implementations, inputs

NAMES = {"packed": "packed32768-H16-HV32-D128", "large": "B4-T4096-H16-D128"}


def main(shape: str) -> None:
    tensors, cu_seqlens = inputs(*SHAPES[NAMES[shape]])
    found = implementations(cu_seqlens)
    with torch.no_grad():
        for fn in found.values():
            fn(*tensors)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for fn in found.values():
            fn(*tensors)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print("profiled:", ", ".join(found))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "packed")
