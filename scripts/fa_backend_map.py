"""Which kernel backend of flash_attention is faster where: Triton against TileLang (and SDPA's cuDNN backend) over
head dims and sequence lengths, the evidence behind the priority "auto" takes (SPEC in
runtime/accelerators/flash_attention).

    bash .device/gpu python scripts/fa_backend_map.py [--dims 64,128] [--lengths 512,...] [--pcvr]
                                                      [--key-lengths] [--dropout P]   (GPU machine, from scripts/)

Each row is one (B, H, L, D), causal or not, bf16, about 32K query rows over 16 heads (B = 32768 // L); --pcvr adds
the PCVR presets of the benchmark. Forward (no grad) and forward + backward (torch.autograd.grad of q, k, v) are
timed as the benchmark times GPU time (CUDA-graph replays, L2 flushed before each, median ms), through the public op:
triton, tilelang and torch (SDPA, whose fastest backend here is cuDNN; with key lengths it takes the equivalent mask).
--key-lengths gives each batch row between half and all of its keys, as the benchmark's presets do; --dropout P runs
every row with dropout (each replay draws a new seed; until session 31 the kernels refused capture with dropout and
these rows were timed over back-to-back eager calls, host time included at small shapes). Before timing, each kernel backend's output is compared with torch's (relative RMS error,
bound: the bf16 bound of runtime.accelerators.testing; not with dropout, whose masks differ); a row over it prints
WRONG. The TileLang kernels are compiled in parallel first.
"""

from __future__ import annotations

import argparse
import time

import torch

from runtime.accelerators.flash_attention import flash_attention
from runtime.accelerators.flash_attention import tilelang as tl_kernels
from runtime.accelerators.testing import RTOL, relative_rms_error
from runtime.accelerators.tilelang_common import precompile
from runtime.benchmark.ops.flash_attention import SHAPES
from runtime.benchmark.timing import gpu_time_ms

DTYPE = torch.bfloat16
HEADS, ROWS = 16, 32768
BACKENDS = ("triton", "tilelang", "torch")


def cases(dims: list[int], lengths: list[int], pcvr: bool) -> list[tuple[tuple[int, int, int, int], bool]]:
    shapes = [(max(1, ROWS // length), HEADS, length, d) for d in dims for length in lengths]
    if pcvr:
        shapes = [shape for name, shape in SHAPES.items() if name.startswith("pcvr")] + shapes
    return [(shape, causal) for shape in shapes for causal in (False, True)]


def compile_tilelang(selected, lengths: bool, dropout: bool, device: torch.device) -> float:
    start = time.perf_counter()
    entries = []
    for (_, _, _, d), causal in selected:
        entries += [tl_kernels.forward_entry(d, DTYPE, causal, lengths, dropout), tl_kernels.preprocess_entry(d, DTYPE)]
        entries.append(tl_kernels.backward_entry(d, DTYPE, causal, lengths, dropout))
    precompile(list(dict(entries).items()), device)
    return time.perf_counter() - start


def graph_ms(fn, device: torch.device) -> float:
    return gpu_time_ms(fn, device)[0]["median"]


def measure(shape, causal: bool, lengths: bool, dropout_p: float, device: torch.device) -> dict:
    """{backend: (forward ms, forward + backward ms)}, or a line saying why not."""
    b, h, length, d = shape
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, length, d, device=device, dtype=DTYPE) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    key_lengths = torch.randint(length // 2, length + 1, (b,), device=device) if lengths else None

    def run(backend):
        def fn(q, k, v):
            return flash_attention(q, k, v, causal=causal, key_lengths=key_lengths, dropout_p=dropout_p, backend=backend)

        return fn

    impls = {backend: run(backend) for backend in BACKENDS}
    with torch.no_grad():
        expected = impls["torch"](q, k, v)
    found = {}
    for name, fn in impls.items():
        with torch.no_grad():
            error = relative_rms_error(fn(q, k, v), expected)
        if not dropout_p and not error <= RTOL[DTYPE]:
            found[name] = f"WRONG: relative RMS error {error:.1e} against torch"
            continue
        with torch.no_grad():
            forward_ms = graph_ms(lambda: fn(q, k, v), device)
        both_ms = graph_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), device)
        found[name] = (forward_ms, both_ms)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--pcvr", action="store_true", help="also the benchmark's PCVR presets")
    parser.add_argument("--key-lengths", action="store_true", help="key padding: key_lengths in [L/2, L]")
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args()
    device = torch.device("cuda")
    selected = cases([int(x) for x in args.dims.split(",")], [int(x) for x in args.lengths.split(",")], args.pcvr)
    compile_s = compile_tilelang(selected, args.key_lengths, args.dropout > 0, device)
    print(f"{torch.cuda.get_device_name(device)}, {DTYPE}, key lengths {args.key_lengths}, dropout {args.dropout}; "
          f"TileLang kernels compiled in {compile_s:.0f} s")
    print("GPU ms (median); ratio = Triton's time over TileLang's (> 1: TileLang faster)")
    header = f"{'shape':<18}{'causal':<7}"
    for mode in ("fwd", "fwd+bwd"):
        header += "".join(f"{mode + ' ' + name:>17}" for name in BACKENDS) + f"{'ratio':>7}"
    print(header)
    for shape, causal in selected:
        found = measure(shape, causal, args.key_lengths, args.dropout, device)
        line = f"{'x'.join(map(str, shape)):<18}{causal!s:<7}"
        for mode in (0, 1):
            times = {name: found[name][mode] if isinstance(found[name], tuple) else float("nan") for name in found}
            line += "".join(f"{times[name]:17.4f}" for name in BACKENDS)
            line += f"{times['triton'] / times['tilelang']:7.2f}"
        print(line, flush=True)
        for name, result in found.items():
            if isinstance(result, str):
                print(f"  {name}: {result}")


if __name__ == "__main__":
    main()
