"""Launch sweep of the gated delta rule's Triton kernels (warps and pipeline stages per kernel), step 5's variants,
and the backward's products on bf16 operands (triton_backward.HALF_BACKWARD).

    bash .device/gpu python scripts/gdr_sweep.py [pcvr] [large] [kernel ...]      (GPU machine, repo root)
    bash .device/gpu python scripts/gdr_sweep.py pcvr large half_backward         (HALF_BACKWARD on against off)
    bash .device/gpu python scripts/gdr_sweep.py large half_wy                    (triton.HALF_WY on against off)
    bash .device/gpu python scripts/gdr_sweep.py pcvr large qk_state             (GRAD_QK_STATE fused against split)

For each shape (pcvr: B256-T256-H4-D16; large: B4-T4096-H16-D128; packed: one sequence of 32768 tokens through
cu_seqlens, H16 HV32 D128; bf16, l2norm in the kernel; default: pcvr) and
each kernel of KERNELS (see triton.LAUNCH_OVERRIDES), one row per launch of LAUNCHES, the other kernels at their
defaults: the GPU time of forward + backward as the benchmark takes it (CUDA graph, L2 flushed), after checking the
output and every gradient against the default launch's (relative RMS error within the bf16 bound). Then each
variant of the backward's step 5 (triton_backward.GRAD_WY, see GRAD_WY_KERNELS) at its default launches
("GRAD_WY=fused"), and its kernels' launches. The last lines name the fastest launch per kernel. Kernel names after
the shapes keep only those kernels' rows ("grad_wy": step 5's, every variant and its kernels); the whole sweep of
both shapes should take about four minutes on an H100 (session 14, before the variants: 71 s + 52 s).
"half_backward": after the default row (HALF_BACKWARD as the shape's default resolves it: on at K = 128, off below; the
time and the reference of every row), HALF_BACKWARD forced the other way at the default launches (row
"HALF_BACKWARD=on/off": "/default" is its time over the default's, its error the largest relative RMS difference of
the output and the gradients from the default's), then, with it so, the launches of the backward's kernels
(BACKWARD_KERNELS; "-- ... HALF_BACKWARD=True" lines) and each variant of step 5 ("GRAD_WY=... HALF=on") with its
kernels' launches. The numerics against the float64 recurrence are tests/gpu's (pytest tests/gpu -k half_backward).
"half_wy": the forward alone and forward + backward with triton.HALF_WY (the WY factors on bf16 operands) as it is
and flipped (rows "fwd HALF_WY=..." and "HALF_WY=...").
"qk_state": forward + backward with steps 3 and 4 as triton_backward.GRAD_QK_STATE says and the other way (rows
"GRAD_QK_STATE=..."), then the launches of the fused kernel ("grad_qk_state").
"split": the forward alone and forward + backward with the context-parallel split forced to each of SPLIT_CHUNKS
chunks per segment (0: never split; rows "fwd split=..." and "split=...").
A kernel with EXTRA_LAUNCHES outside KERNELS (step 5's "grad_wy_fused"): those launches alone, at the defaults of
the rest.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule
from runtime.accelerators.gated_delta_rule import triton as kernels
from runtime.accelerators.gated_delta_rule import triton_backward as backward
from runtime.accelerators.testing import RTOL, relative_rms_error
from runtime.benchmark.timing import gpu_time_ms

SHAPES = {  # (B, T, H, HV, D, packed)
    "pcvr": (256, 256, 4, 4, 16, False),
    "large": (4, 4096, 16, 16, 128, False),
    "packed": (1, 32768, 16, 32, 128, True),
}
SPLIT_CHUNKS = (0, 8, 16, 32, 64)
KERNELS = ("grad_qk", "grad_state", "local", "state_grad", "wy", "walk", "output")  # and step 5's, by variant:
QK_STATE_KERNELS = {"fused": ("grad_qk_state",), "split": ("grad_state", "grad_qk")}
GRAD_WY_KERNELS = {"single": ("grad_wy",), "fused": ("grad_wy_fused",)}
BACKWARD_KERNELS = ("local", "state_grad", "grad_state", "grad_qk")  # with half_backward: swept with it on
LAUNCHES = {  # launch options per K (the kernel's other options at their defaults)
    16: [dict(num_warps=w, num_stages=s) for w, s in [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1)]],
    128: [dict(num_warps=w, num_stages=s) for w, s in [(4, 2), (8, 1), (8, 2), (8, 3)]],
}
EXTRA_LAUNCHES = {  # (kernel, K) -> more launches: the blocks of k and v of step 5's variants, the V blocks of the
    # state walk and the output (session 16: with their products on bf16 operands, fewer registers a V column)
    # (session 21: BK 64, the default since, 4 loop steps over K instead of 16, from helper-46's comparison with fla's)
    # (BV 32 made an illegal memory access at B4, session 21)
    ("grad_wy_fused", 128): [dict(BK=16), dict(BK=64, num_stages=3), dict(BK=32)],
    ("grad_qk_state", 128): [dict(BV=16), dict(BV=64), dict(BV=16, num_warps=4)],
    # two warps: mma from registers instead of the warpgroup's wgmma, whose operands go through shared memory
    # (session 20: 2 warps, BV 64 and BV 16 were slower at both shapes; 8 warps crash, see below)
    ("walk", 128): [dict(num_stages=3), dict(num_stages=4), dict(BV=16, num_stages=3)],
    # the reverse walk (default: BV 32 where the grid is one wave, else 64; 3 stages; see triton_backward._walk_launch).
    # Before session 21 its state was one [128, BV] tile, and BV 32 made illegal memory accesses (session 20).
    ("state_grad", 128): [dict(BV=32, num_stages=2), dict(BV=32, num_stages=3), dict(BV=64, num_stages=3),
                          dict(num_warps=4, num_stages=2)],
    ("output", 128): [dict(BV=128), dict(BV=128, num_warps=8), dict(BV=32)],
}


def inputs(B, T, H, HV, D, packed):
    torch.manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = make(B, T, H, D), make(B, T, H, D), make(B, T, HV, D)
    g = F.logsigmoid(torch.randn(B, T, HV, device="cuda") + 2.0).to(torch.bfloat16)
    beta = torch.rand(B, T, HV, device="cuda", dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, T], dtype=torch.long) if packed else None  # on the host, as the harness gives it
    return [x.requires_grad_() for x in (q, k, v, g, beta)], cu_seqlens


def describe(options: dict) -> str:
    return " ".join(f"{key.removeprefix('num_')}={value}" for key, value in options.items())


def main(args: list[str]) -> None:
    shapes = [a for a in args if a in SHAPES] or ["pcvr"]
    wanted = [a for a in args if a not in SHAPES] or [*KERNELS, "grad_wy"]
    modes = {"default", "grad_wy", "half_backward", "half_wy", "qk_state", "split"}  # "default": its row alone
    extra_only = {kernel for kernel, _ in EXTRA_LAUNCHES} - set(KERNELS)  # step 5's kernels: their extra launches alone
    unknown = set(wanted) - {*KERNELS, *modes, *extra_only}
    assert not unknown, f"unknown {sorted(unknown)}: shapes {list(SHAPES)}, kernels {KERNELS}, {sorted(modes)}"
    start = time.perf_counter()
    default_grad_wy, default_half = backward.GRAD_WY, backward.HALF_BACKWARD
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "default GRAD_WY", default_grad_wy or "by K",
          "HALF_BACKWARD", default_half)  # fmt: skip
    print(f"{'shape':<7}{'kernel':<16}{'launch':<24}{'ms':>9}{'/default':>9}{'max grad err':>14}{'at s':>6}")
    for shape in shapes:
        B, T, H, HV, D, packed = SHAPES[shape]
        tensors, cu_seqlens = inputs(B, T, H, HV, D, packed)
        grad_o = torch.randn(B, T, HV, D, device="cuda", dtype=torch.bfloat16)

        def forward():
            options = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, backend="triton")
            return chunk_gated_delta_rule(*tensors, **options)[0]

        def forward_ms() -> float:
            with torch.no_grad():
                return gpu_time_ms(forward, torch.device("cuda"))[0]["median"]

        def step():
            o = forward()
            return (o.detach(), *torch.autograd.grad(o, tensors, grad_o))

        def row(kernel: str, launch: str) -> float | None:
            """Checks and times the current settings; prints their row; their ms or None."""
            try:
                error = max(relative_rms_error(a, b) for a, b in zip(step(), reference))
            except Exception as failure:  # a launch that does not compile or fit
                print(f"{shape:<7}{kernel:<16}{launch:<24}  FAILED {type(failure).__name__}: {str(failure)[:80]}")
                return None
            if not error <= RTOL[torch.bfloat16]:
                print(f"{shape:<7}{kernel:<16}{launch:<24}  WRONG {error:.1e}")
                return None
            ms = gpu_time_ms(step, torch.device("cuda"))[0]["median"]
            print(f"{shape:<7}{kernel:<16}{launch:<24}{ms:9.4f}{ms / default_ms:9.3f}{error:14.1e}"
                  f"{time.perf_counter() - start:6.0f}")  # fmt: skip
            return ms

        def sweep(kernel: str, extra_only: bool = False) -> None:
            best = None
            # the extra launches first: an 8-warp walk made an illegal memory access on the packed shape (session 20)
            for options in EXTRA_LAUNCHES.get((kernel, D), []) + ([] if extra_only else LAUNCHES[D]):
                kernels.LAUNCH_OVERRIDES.clear()
                kernels.LAUNCH_OVERRIDES[kernel, D] = options
                ms = row(kernel, describe(options))
                if ms is not None and (best is None or ms < best[0]):
                    best = (ms, options)
            kernels.LAUNCH_OVERRIDES.clear()
            if best:
                print(f"-- {shape} {kernel} (GRAD_WY={backward.GRAD_WY}, HALF_BACKWARD={backward.HALF_BACKWARD}): "
                      f"fastest {describe(best[1])} ({best[0]:.4f} ms vs default {default_ms:.4f})")  # fmt: skip

        def grad_wy_variants() -> None:
            """Step 5: each variant at its default launches (the default one is the first row), then its kernels'."""
            try:
                for variant, names in GRAD_WY_KERNELS.items():
                    backward.GRAD_WY = variant
                    label = f"GRAD_WY={variant}{' HALF=on' if backward.HALF_BACKWARD else ''}"
                    if variant == default_grad_wy or row("all", label) is not None:
                        for kernel in names:
                            sweep(kernel)
            finally:
                backward.GRAD_WY = default_grad_wy

        kernels.LAUNCH_OVERRIDES.clear()
        reference = step()
        default_ms = gpu_time_ms(step, torch.device("cuda"))[0]["median"]
        print(f"{shape:<7}{'all':<16}{'default':<24}{default_ms:9.4f}{1.0:9.3f}{0.0:14.1e}"
              f"{time.perf_counter() - start:6.0f}   forward alone {forward_ms():.4f} ms")  # fmt: skip
        for kernel in KERNELS:
            if kernel in wanted:
                sweep(kernel)
        for kernel in sorted(extra_only & set(wanted)):
            sweep(kernel, extra_only=True)
        if "grad_wy" in wanted:
            grad_wy_variants()
        if "half_backward" in wanted:
            try:
                backward.HALF_BACKWARD = not backward._half_backward(tensors[0])  # the other side of this shape's default
                if row("all", f"HALF_BACKWARD={'on' if backward.HALF_BACKWARD else 'off'}") is not None:
                    for kernel in BACKWARD_KERNELS:
                        sweep(kernel)
                    grad_wy_variants()
            finally:
                backward.HALF_BACKWARD = default_half
        if "qk_state" in wanted:
            default_qk_state = backward.GRAD_QK_STATE
            try:
                for variant in (default_qk_state, *(set(QK_STATE_KERNELS) - {default_qk_state})):
                    backward.GRAD_QK_STATE = variant
                    row("all", f"GRAD_QK_STATE={variant}")
                backward.GRAD_QK_STATE = "fused"
                sweep("grad_qk_state")
            finally:
                backward.GRAD_QK_STATE = default_qk_state
        if "half_wy" in wanted:
            default_half_wy = kernels.HALF_WY

            try:
                for half_wy in (default_half_wy, not default_half_wy):
                    kernels.HALF_WY = half_wy
                    print(f"{shape:<7}{'fwd':<16}{f'HALF_WY={half_wy}':<24}{forward_ms():9.4f}")
                row("all", f"HALF_WY={kernels.HALF_WY}")
            finally:
                kernels.HALF_WY = default_half_wy
        if "split" in wanted:
            for segment_chunks in SPLIT_CHUNKS:
                with kernels.split_sequences(segment_chunks):
                    print(f"{shape:<7}{'fwd':<16}{f'split={segment_chunks}':<24}{forward_ms():9.4f}")
                    row("all", f"split={segment_chunks}")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
