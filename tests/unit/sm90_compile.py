"""Compile recorded Triton launches for sm_90 (Hopper) without a GPU; run by test_triton_compile_sm90.py.

    python sm90_compile.py LAUNCHES.pkl RESULTS.pkl

Run in a fresh process without TRITON_INTERPRET, so that importing a kernel module defines real
JITFunctions (under the interpreter they are InterpretedFunctions, which cannot be compiled).
LAUNCHES.pkl holds a list of dicts (module, name, signature, constexprs, attrs, options) as Triton's
launch binder works them out; RESULTS.pkl gets one dict per launch: {"shared": bytes, "seconds": compile time,
"registers" and "stack_bytes" per thread, "ptx_markers": which of PTX_MARKERS the PTX holds} or {"error": text}.
"""

import importlib
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

SM90 = ("cuda", 90, 32)  # GPUTarget(backend, compute capability, warp size)
# TMA loads (into shared memory; ::cluster in Triton 3.6, ::cta in 3.9) and stores, Hopper tensor-core MMAs
PTX_MARKERS = ("cp.async.bulk.tensor.2d.shared::", "cp.async.bulk.tensor.2d.global.shared::", "wgmma.mma_async")


def compile_one(launch: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from runtime.accelerators.triton_launch import DirectLaunch

    start = time.perf_counter()
    try:
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        kernel = kernel.kernel if isinstance(kernel, DirectLaunch) else kernel
        source = ASTSource(kernel, launch["signature"], launch["constexprs"], launch["attrs"])
        compiled = triton.compile(source, target=GPUTarget(*SM90), options=launch["options"])
        result = {"shared": compiled.metadata.shared, "seconds": round(time.perf_counter() - start, 1)}
        result["ptx_markers"] = [marker for marker in PTX_MARKERS if marker in compiled.asm["ptx"]]
        return result | register_use(compiled.asm["cubin"], os.path.dirname(triton.__file__))
    except Exception as error:  # reported per launch; the test shows it
        return {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-3)}"}


def register_use(cubin: bytes, triton_dir: str) -> dict:
    """{"registers", "stack_bytes"} per thread of the compiled kernel, from the cuobjdump Triton bundles
    (stack bytes are mostly register spills); {} where it cannot tell."""
    tool = os.path.join(triton_dir, "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        try:
            report = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
        except OSError:
            return {}
    found = re.search(r"REG:(\d+) STACK:(\d+)", report)
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2))} if found else {}


def main(launches_path: str, results_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET=1"
    with open(launches_path, "rb") as f:
        launches = pickle.load(f)
    # one compile is single-threaded: spread them over the cores (spawn: no forked torch/LLVM state)
    workers = max(1, min(len(launches), os.cpu_count() or 1, 4))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(compile_one, launches))
    with open(results_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
