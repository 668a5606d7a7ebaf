"""GPU time of the Triton row norms at the PCVR widths for other tile sizes, beside torch.compile of the reference.

    bash .device/gpu python scripts/norm_tiles_sweep.py [--ops l2norm,rms_norm,layer_norm]

Tiles are norms_triton's TILE_ELEMENTS (elements per program at narrow widths) and ELEMENTS_PER_THREAD (which sets
the warps); the default is 4096 / 16. Each row is timed as the benchmark times it (runtime.benchmark.timing:
CUDA-graph replays after an L2 flush), forward and forward+backward (`torch.autograd.grad` of every input), bf16,
and checked against the float64 reference first.
"""

from __future__ import annotations

import argparse

import torch

from runtime.accelerators import l2norm, layer_norm, norms_triton, rms_norm
from runtime.accelerators.l2norm.reference import l2norm_reference
from runtime.accelerators.layer_norm.reference import layer_norm_reference
from runtime.accelerators.rms_norm.reference import rms_norm_reference
from runtime.benchmark.timing import gpu_time_ms

SHAPES = [(8192, 128), (131072, 64)]
TILES = [(4096, 16), (2048, 16), (1024, 16), (2048, 8), (8192, 16), (4096, 32)]
OPS = {
    "l2norm": (lambda x, w, b: l2norm(x, backend="triton"), lambda x, w, b: l2norm_reference(x), False),
    "rms_norm": (lambda x, w, b: rms_norm(x, w, backend="triton"), lambda x, w, b: rms_norm_reference(x, w), True),
    "layer_norm": (
        lambda x, w, b: layer_norm(x, w, b, backend="triton"), lambda x, w, b: layer_norm_reference(x, w, b), True,
    ),
}


def _set_tiles(elements: int, per_thread: int) -> None:
    norms_triton.TILE_ELEMENTS, norms_triton.ELEMENTS_PER_THREAD = elements, per_thread
    norms_triton.row_tiles.cache_clear()


def _timed(fn, inputs, grad_out, mode: str) -> float:
    if mode == "fwd":
        call = lambda: fn(*inputs)  # noqa: E731
    else:
        wanted = [t for t in inputs if t is not None]
        call = lambda: torch.autograd.grad(fn(*inputs), wanted, grad_out)  # noqa: E731
    return 1e3 * gpu_time_ms(call, grad_out.device)[0]["median"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", default=",".join(OPS))
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, bf16, GPU us (median of graph replays after an L2 flush)")
    for name in args.ops.split(","):
        ours, reference, has_params = OPS[name]
        compiled = torch.compile(reference)
        for rows, width in SHAPES:
            x = torch.randn(rows, width, device=device, dtype=torch.bfloat16, requires_grad=True)
            w = (1 + 0.1 * torch.randn(width, device=device, dtype=torch.bfloat16)).requires_grad_() if has_params else None
            b = (0.1 * torch.randn(width, device=device, dtype=torch.bfloat16)).requires_grad_() if name == "layer_norm" else None
            inputs, grad_out = (x, w, b), torch.randn(rows, width, device=device, dtype=torch.bfloat16)
            peer = [_timed(compiled, inputs, grad_out, mode) for mode in ("fwd", "fwd+bwd")]
            print(f"{name} {rows}x{width}: torch.compile fwd {peer[0]:.2f}  fwd+bwd {peer[1]:.2f}")
            for elements, per_thread in TILES:
                _set_tiles(elements, per_thread)
                tiles = norms_triton.row_tiles(width)
                with torch.no_grad():
                    expect = reference(*(t.double() if t is not None else None for t in inputs))
                    error = ((ours(*inputs).double() - expect).norm() / expect.norm()).item()
                times = [_timed(ours, inputs, grad_out, mode) for mode in ("fwd", "fwd+bwd")]
                print(
                    f"  tile {elements:5d} / {per_thread:2d} per thread ({tiles.rows} rows, {tiles.warps} warps):"
                    f" fwd {times[0]:6.2f}  fwd+bwd {times[1]:6.2f}  (rel err {error:.1e})"
                )
            _set_tiles(4096, 16)


if __name__ == "__main__":
    main()
