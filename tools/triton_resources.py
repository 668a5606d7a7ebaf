"""Registers, register-spill stack and shared memory per thread of every Triton kernel, compiled for sm_90, no GPU.

    TRITON_INTERPRET=1 python tools/triton_resources.py [case ...]

Cases are those of tests/unit/test_triton_compile_sm90.py (default: all); TAAC_SM90_TRITON=<folder> compiles with
another Triton (the GPU machine's 3.6, as .ci/run installs it). A kernel at 255 registers with a stack is spilling.
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "unit"))
os.environ["TRITON_INTERPRET"] = "1"  # the cases run their launchers under the interpreter, recording launches

import test_triton_compile_sm90 as sm90  # noqa: E402


def main(names: list[str]) -> None:
    cases = {name: sm90.CASES[name] for name in names} if names else sm90.CASES
    with tempfile.TemporaryDirectory() as folder:
        compiled = sm90.compile_cases(cases, Path(folder))
    print(f"{'kernel':44s} {'case':30s} {'warps':>5s} {'regs':>5s} {'stack B':>8s} {'shared KB':>9s}")
    for kernel, launches in sorted(compiled.items()):
        for launch, result in launches:
            if "error" in result:
                print(f"{kernel:44s} {launch['case']:30s} error: {result['error'].splitlines()[0]}")
                continue
            print(
                f"{kernel:44s} {launch['case']:30s} {launch['options'].get('num_warps', 4):5d} {result.get('registers', -1):5d}"
                f" {result.get('stack_bytes', -1):8d} {result['shared'] / 1024:9.0f}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
