"""Host cost of one Triton launch on the GPU machine, piece by piece (us per call, back-to-back calls on tiny inputs
so that the host, not the GPU, sets the pace; medians over rounds as scripts/autograd_overhead.py).

    bash .device/gpu python scripts/launch_cost.py

Session 18 (results/launch-cost-2026-11-23-h100-s18.txt): Triton's C launcher 7.0 us (5.7 with the pointers passed as
ints: it calls data_ptr and cuPointerGetAttribute per tensor), DirectLaunch 14.8 (7.8 us of Python above the C
launcher), a native zero_ 7.9, torch.empty_like 3.6.
"""

import torch

from runtime.accelerators import binary_cross_entropy_with_logits as bce
from runtime.accelerators.bce import triton as bce_triton

from autograd_overhead import per_call_us  # scripts/ is on the path of a script run from it


def main():
    cases = {}
    for n in (16, 4096):
        x = torch.randn(n, device="cuda")
        y = torch.rand(n, device="cuda")
        out = torch.empty((), device="cuda")
        unit = torch.empty(n, device="cuda")
        args = (x, y, None, None, out, unit, n, None, None, None, None, float(n))
        constexprs = dict(W_MODE=0, PW_MODE=0, REDUCE=True, UNIT_GRAD=True, ONE_PROGRAM=True, REVERSE=False,
                          NUM_STAGES=1, BLOCK=4096, num_warps=8)
        kernel = bce_triton._forward_kernel
        kernel[(1,)](*args, **constexprs)
        compiled, tail, launch, extra = kernel._compiled[next(k for k in kernel._compiled)]
        stream = torch.cuda.current_stream().cuda_stream
        ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        raw = lambda arguments: (lambda: launch(1, 1, 1, stream, compiled.function, *extra, compiled.packed_metadata,
                                                None, None, None, *arguments, *tail))  # noqa: E731
        cases.update({
            f"n={n} native x.zero_()": x.zero_,
            f"n={n} native torch.mul(x, y)": lambda x=x, y=y: torch.mul(x, y),
            f"n={n} torch.empty(())": lambda: torch.empty((), device="cuda"),
            f"n={n} torch.empty_like(x)": lambda x=x: torch.empty_like(x),
            f"n={n} C launcher, tensors": raw(args),
            f"n={n} C launcher, int pointers": raw(ints),
            f"n={n} DirectLaunch": lambda a=args, c=constexprs: kernel[(1,)](*a, **c),
            f"n={n} bce_triton.forward (grad_in_forward)": lambda x=x, y=y: bce_triton.forward(x, y, None, None, "mean", False, True),
            f"n={n} bce_triton.infer": lambda x=x, y=y: bce_triton.infer(x, y, None, None, "mean", False, False),
            f"n={n} public bce, no grad": lambda x=x, y=y: bce(x, y, backend="triton"),
            f"n={n} F.bce, no grad": lambda x=x, y=y: torch.nn.functional.binary_cross_entropy_with_logits(x, y),
        })
    for name, us in per_call_us(cases, rounds=11, calls=400).items():
        print(f"{name:45s} {us:8.2f}", flush=True)


main()
