"""Registers, spills, shared memory and a SASS profile of TileLang kernels compiled for sm_90a, no GPU.

    python tools/tilelang_resources.py [--source DIR] [case ...]

A case is an op's kernel_entries arguments (CASES below; default: all). Each kernel's generated CUDA source is
compiled as TileLang compiles it (nvcc -O3, sm_90a, its template includes) with ptxas's verbose report, then
disassembled: per kernel the registers, spill bytes, static shared memory (not the dynamic buffer TileLang sizes at
launch), the blocks an SM can hold by registers and shared memory, the blocks an SM that a persistent grid launches
(`__launch_bounds__`' minimum), the SASS instruction count, calls (64-bit division, fp32 division's slow path), global
loads by width (16-byte vectors or narrower), barriers and shuffles.
`--source DIR` keeps each kernel's .cu file there (to read or diff).
"""

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16

# case -> (kernel module, kernel_entries arguments): the benchmark shapes' widths, silu_attention's head dims, linear's
# benchmark shape
CASES = {
    "add_layer_norm-4096-bf16": ("add_norm", (bf16, 4096, bf16, bf16, True)),
    "add_layer_norm-256-bf16": ("add_norm", (bf16, 256, bf16, bf16, True)),
    "add_rms_norm-4096-bf16": ("add_norm", (bf16, 4096, bf16, None, False)),
    "add_rms_norm-256-bf16": ("add_norm", (bf16, 256, bf16, None, False)),
    # (dtype, N, K, activation, bias, save the pre-activation[, blocks an SM]): the inference and the training
    # forward at K = 256, and the inference forward's launch for two blocks an SM
    "linear-gelu-256x1024-bf16": ("linear", (bf16, 1024, 256, "gelu", True, False)),
    "linear-gelu-256x1024-save-bf16": ("linear", (bf16, 1024, 256, "gelu", True, True)),
    "linear-gelu-256x1024-2sm-bf16": ("linear", (bf16, 1024, 256, "gelu", True, False, 2)),
    "layer_norm-4096-bf16": ("layer_norm", (bf16, 4096, bf16, bf16)),
    "rms_norm-4096-bf16": ("rms_norm", (bf16, 4096, bf16)),
    # causal with both biases: (head dim, dtype, causal, targets, position bias, time bias, dropout)
    "silu_attention-d32-bf16": ("silu_attention", (32, bf16, True, False, True, True, False)),
    "silu_attention-d64-bf16": ("silu_attention", (64, bf16, True, False, True, True, False)),
}


def nvdisasm_tool() -> str | None:
    """nvdisasm from PATH or the one Triton bundles."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    return str(bundled) if bundled.exists() else None


def compile_source(source: str, folder: Path) -> tuple[str, str]:
    """(ptxas's verbose report, SASS text or "") of one kernel source compiled for sm_90a as TileLang does."""
    from tilelang import env

    path = folder / "kernel.cu"
    path.write_text(source)
    cubin = folder / "kernel.cubin"
    command = [
        "nvcc", "-cubin", "-O3", "-arch=sm_90a", "-std=c++20", f"-I{env.TILELANG_TEMPLATE_PATH}",
        f"-I{env.CUTLASS_INCLUDE_DIR}", "--ptxas-options=--verbose", "-w", str(path), "-o", str(cubin),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    disasm = nvdisasm_tool()
    sass = subprocess.run([disasm, "-c", str(cubin)], capture_output=True, text=True).stdout if disasm else ""
    return done.stdout + done.stderr, sass


def profile(report: str, sass: str) -> dict:
    """What the ptxas report and the SASS say about one kernel."""
    found = {}
    if m := re.search(r"Used (\d+) registers", report):
        found["registers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report):
        found["spill"] = int(m.group(1)) + int(m.group(2))
    m = re.search(r"(\d+) bytes smem", report)
    found["smem"] = int(m.group(1)) if m else 0
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    counts = Counter(op.split(".")[0] for op in ops)
    loads = Counter(op for op in ops if op.startswith("LDG"))
    found["instructions"] = len(ops)
    found["calls"] = counts["CALL"]
    found["ldg128"] = sum(n for op, n in loads.items() if ".128" in op)
    found["ldg_narrow"] = sum(loads.values()) - found["ldg128"]
    found["bar"] = counts["BAR"]
    found["shfl"] = counts["SHFL"]
    return found


def blocks_per_sm(threads: int, registers: int, smem: int) -> int:
    """Resident blocks per sm_90 SM from registers (64K, allocated per warp in units of 256) and shared memory."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = 65536 // (per_warp * -(-threads // 32))
    by_smem = (228 * 1024) // (smem + 1024) if smem else 32
    return min(by_registers, by_smem, 2048 // threads, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"default: all of {', '.join(CASES)}")
    parser.add_argument("--source", type=Path, help="write each kernel's CUDA source into this folder")
    args = parser.parse_args()
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    os.environ.setdefault("TILELANG_LOG_LEVEL", "WARNING")
    from runtime.accelerators.tilelang_common import SM90A, compile_built, device_info

    if args.source:
        args.source.mkdir(parents=True, exist_ok=True)
    header = (
        f"{'case':26s} {'kernel':24s} {'thr':>4s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'blk/SM':>6s} {'grid':>4s}"
    )
    print(header + f" {'SASS':>5s} {'calls':>5s} {'LDG128':>6s} {'LDG<16B':>7s} {'BAR':>4s} {'SHFL':>4s}")
    for case in args.cases or CASES:
        op, entry_args = CASES[case]
        module = importlib.import_module(f"runtime.accelerators.{op}.tilelang")
        for key, build in module.kernel_entries(*entry_args):
            if key[0] == "column_sum":
                continue
            kernel = compile_built(build(device_info(None)), SM90A)
            source = kernel.get_kernel_source()
            if args.source:
                (args.source / f"{case}-{key[0]}.cu").write_text(source)
            with tempfile.TemporaryDirectory() as folder:
                p = profile(*compile_source(source, Path(folder)))
            bounds = re.search(r"__launch_bounds__\((\d+)(?:, (\d+))?\)", source)
            threads, grid_blocks = int(bounds.group(1)), bounds.group(2) or "-"
            blocks = blocks_per_sm(threads, p.get("registers", 255), p["smem"])
            print(
                f"{case:26s} {key[0]:24s} {threads:4d} {p.get('registers', -1):4d} {p.get('spill', -1):5d}"
                f" {p['smem']:6d} {blocks:6d} {grid_blocks:>4s} {p['instructions']:5d} {p['calls']:5d} {p['ldg128']:6d}"
                f" {p['ldg_narrow']:7d} {p['bar']:4d} {p['shfl']:4d}"
            )


if __name__ == "__main__":
    sys.exit(main())
