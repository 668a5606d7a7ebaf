"""GPU time of the Triton row norms at the PCVR widths for other tile sizes, beside torch.compile of the reference.

    bash .device/gpu python scripts/norm_tiles_sweep.py [--ops l2norm,rms_norm,layer_norm] [--rounds 5] [--shapes 8192x128,...]
    bash .device/gpu python scripts/norm_tiles_sweep.py --ops l2norm --tiles 16x2,32x4,...   # rows x warps

Tiles are norms_triton's TILE_ELEMENTS (elements per program at narrow widths) and ELEMENTS_PER_THREAD (which sets
the warps); the default is 4096 / 16. With --tiles, each candidate is a tile of that many rows run by that many warps
instead, at every width (the op module's row_tiles replaced). Each row is timed as the benchmark times it
(runtime.benchmark.timing: CUDA-graph replays after an L2 flush, the GPU kept busy first), forward and
forward+backward (`torch.autograd.grad` of every input), bf16, and checked against the float64 reference first. The
candidates (torch.compile of the reference, static shapes as a one-shape benchmark run compiles it, then each tile)
are timed in interleaved rounds; each row gives the median over rounds and the fastest round.
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch

from runtime.accelerators import l2norm, layer_norm, norms_triton, rms_norm
from runtime.accelerators.l2norm.reference import l2norm_reference
from runtime.accelerators.layer_norm.reference import layer_norm_reference
from runtime.accelerators.rms_norm.reference import rms_norm_reference
from runtime.benchmark.timing import gpu_time_ms

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


def _set_explicit(name: str, rows: int | None, warps: int | None) -> None:
    """Tiles of `rows` rows and `warps` warps in the op's Triton module (None: back to norms_triton.row_tiles)."""
    module = importlib.import_module(f"runtime.accelerators.{name}.triton")

    def explicit(width: int) -> norms_triton.RowTiles:
        block = norms_triton.row_tiles(width).block
        return norms_triton.RowTiles(block, rows, warps, max(1, norms_triton.RESIDENT_WARPS // warps))

    module.row_tiles = norms_triton.row_tiles if rows is None else explicit


def _apply(name: str, tiles) -> None:
    if tiles is None:
        return
    if tiles[0] == "explicit":
        _set_explicit(name, *tiles[1:])
    else:
        _set_tiles(*tiles)


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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default="8192x128,131072x64", help="rows x width, comma-separated")
    parser.add_argument("--tiles", default="", help="rows x warps candidates, e.g. 16x2,32x4 (instead of TILES)")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, bf16, GPU us: median over {args.rounds} interleaved rounds (fastest round)")
    for name in args.ops.split(","):
        ours, reference, has_params = OPS[name]
        for rows, width in [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]:
            x = torch.randn(rows, width, device=device, dtype=torch.bfloat16, requires_grad=True)
            w = (1 + 0.1 * torch.randn(width, device=device, dtype=torch.bfloat16)).requires_grad_() if has_params else None
            b = (0.1 * torch.randn(width, device=device, dtype=torch.bfloat16)).requires_grad_() if name == "layer_norm" else None
            inputs, grad_out = (x, w, b), torch.randn(rows, width, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                expect = reference(*(t.double() if t is not None else None for t in inputs))
            candidates = {"torch.compile": (torch.compile(reference, dynamic=False), None)}
            if args.tiles:
                explicit = [tuple(int(n) for n in c.split("x")) for c in args.tiles.split(",")]
                candidates["default tiles"] = (ours, ("explicit", None, None))
                candidates.update({f"{r} rows x {w} warps": (ours, ("explicit", r, w)) for r, w in explicit})
            else:
                candidates.update({f"tile {e:5d} / {t:2d} per thread": (ours, (e, t)) for e, t in TILES})
            for label, (fn, tiles) in candidates.items():
                _apply(name, tiles)
                with torch.no_grad():
                    error = ((fn(*inputs).double() - expect).norm() / expect.norm()).item()
                assert error < 1e-2, f"{name} {label}: relative error {error:.1e}"
            times = {label: {"fwd": [], "fwd+bwd": []} for label in candidates}
            for _ in range(args.rounds):
                for label, (fn, tiles) in candidates.items():
                    _apply(name, tiles)
                    for mode in ("fwd", "fwd+bwd"):
                        times[label][mode].append(_timed(fn, inputs, grad_out, mode))
            _set_tiles(4096, 16)
            _set_explicit(name, None, None)
            print(f"{name} {rows}x{width}")
            for label, (fn, tiles) in candidates.items():
                cells = "  ".join(
                    f"{mode} {statistics.median(t):6.2f} ({min(t):6.2f})" for mode, t in times[label].items()
                )
                print(f"  {label:30s} {cells}")


if __name__ == "__main__":
    main()
