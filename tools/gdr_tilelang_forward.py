"""Times the TileLang chunked gated-delta-rule forward several ways side by side on one GPU: the state walk storing the
states and an output kernel over every chunk (the default, split into segments where the occupancy rule says so), the
same with the walk never split and, on the packed shape, split into segments of a forced length (context-parallel
split, tilelang_split.py); the walk computing the output itself; the Triton forward beside them. Also each way's
kernels in launch order (prepare, the walks, the chain, output) through the profiler. bf16, l2norm in the kernel,
the chunked shapes of the gated_delta_rule benchmark; a split way is checked against the whole walk first.
Usage (GPU machine): python tools/gdr_tilelang_forward.py [--json PATH] [--segments 8,16,32,64,128]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from variant_timing import kernel_launches_us, time_variant, write_json

from runtime.accelerators.gated_delta_rule import tilelang as gdr_tilelang
from runtime.accelerators.gated_delta_rule import triton as gdr_triton
from runtime.benchmark.ops.gated_delta_rule import SHAPES

SPLIT_BOUND = 5e-3  # relative RMS of the split's o from the whole walk's (the op's bf16 bound)


def close_to(reference: torch.Tensor):
    """A time_variant check: the way's o within SPLIT_BOUND of `reference` (relative RMS)."""

    def check(result) -> str | None:
        o = result[0].double()
        error = float((o - reference.double()).norm() / reference.double().norm())
        return None if error <= SPLIT_BOUND else f"o is {error:.2e} from the whole walk's (bound {SPLIT_BOUND})"

    return check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--segments", default="16,32,64,128", help="forced chunks per segment on the packed shape")
    args = parser.parse_args()
    forced = [int(s) for s in args.segments.split(",") if s]
    device = torch.device("cuda")
    results = []
    print("| shape | forward | median ms | kernels in launch order (us) |")
    print("|---|---|---:|---|")
    for name, shape in SHAPES.items():
        B, T, H, HV, K, V, packed = shape
        torch.manual_seed(0)
        bf16 = dict(device=device, dtype=torch.bfloat16)
        x = [
            torch.randn(B, T, H, K, **bf16),
            torch.randn(B, T, H, K, **bf16),
            torch.randn(B, T, HV, V, **bf16),
            F.logsigmoid(torch.randn(B, T, HV, device=device) + 2.0).to(torch.bfloat16),
            torch.rand(B, T, HV, **bf16),
        ]
        cu_seqlens = torch.tensor([0, T]) if packed else None  # one sequence, boundaries on the host
        rest = (K**-0.5, None, False, True, cu_seqlens)
        forward = functools.partial(gdr_tilelang.chunk_forward, *x, *rest)
        whole = forward(segment_chunks=0)[0]
        ways = {
            "tilelang, output kernel (split by the rule)": (forward, close_to(whole)),
            "tilelang, output kernel, whole walk": (functools.partial(forward, segment_chunks=0), None),
        }
        if packed:
            for length in forced:
                ways[f"tilelang, split into {length}-chunk segments"] = (
                    functools.partial(forward, segment_chunks=length),
                    close_to(whole),
                )
        ways["tilelang, output in the walk"] = (functools.partial(forward, fused_output=True), None)
        ways["triton"] = (functools.partial(gdr_triton.chunk_forward, *x, *rest), None)
        for label, (fn, check) in ways.items():
            ms = time_variant(name, label, fn, check)
            if ms is None:
                continue
            kernels = kernel_launches_us(fn)
            results.append({"shape": name, "forward": label, "median_ms": ms, "kernels_us": kernels})
            listed = ", ".join(f"{k.removesuffix('_kernel')[:28]} {us:.0f}" for k, us in kernels)
            print(f"| {name} | {label} | {ms:.3f} | {listed} |", flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
