"""Compile recorded Triton launches for sm_90 (Hopper) without a GPU; run by test_triton_compile_sm90.py.

    python sm90_compile.py LAUNCHES.pkl RESULTS.pkl

Run in a fresh process without TRITON_INTERPRET, so that importing a kernel module defines real
JITFunctions (under the interpreter they are InterpretedFunctions, which cannot be compiled).
LAUNCHES.pkl holds a list of dicts (module, name, signature, constexprs, attrs, options) as Triton's
launch binder works them out; RESULTS.pkl gets one dict per launch: {"shared": bytes} or {"error": text}.
"""

import importlib
import os
import pickle
import sys
import traceback

SM90 = ("cuda", 90, 32)  # GPUTarget(backend, compute capability, warp size)


def compile_one(launch: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        source = ASTSource(kernel, launch["signature"], launch["constexprs"], launch["attrs"])
        compiled = triton.compile(source, target=GPUTarget(*SM90), options=launch["options"])
        return {"shared": compiled.metadata.shared}
    except Exception as error:  # reported per launch; the test shows it
        return {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-3)}"}


def main(launches_path: str, results_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET=1"
    with open(launches_path, "rb") as f:
        launches = pickle.load(f)
    results = [compile_one(launch) for launch in launches]
    with open(results_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
