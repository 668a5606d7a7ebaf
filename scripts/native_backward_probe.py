"""The C++ backward node of eager norm calls (runtime.accelerators.native) on the GPU machine: gradients against
the autograd.Function path, bit for bit, and eager time per forward + backward call beside the native torch op.

    bash .device/gpu python scripts/native_backward_probe.py [--rounds 5]

Per round and case: 50 warm-up calls, then 2000 calls back to back, synchronised once (torch.autograd.grad, as the
benchmark's eager forward + backward). Rounds interleave the cases.
"""

import argparse
import importlib
import statistics
import time

import torch
import torch.nn.functional as F

from runtime.accelerators import l2norm, layer_norm, native, rms_norm
from runtime.accelerators.kernel_op import KernelOp

from eager_overhead import per_call_us  # scripts/ is on sys.path when a script runs


def kernel_op_of(op) -> KernelOp:
    return importlib.import_module(op.__module__).KERNEL


def python_path(kernel_op: KernelOp, backend: str):
    """A context in which eager calls of kernel_op take the autograd.Function (the native node's hook removed)."""

    class Context:
        def __enter__(self):
            kernel_op._native[backend] = None

        def __exit__(self, *exc):
            kernel_op._native.pop(backend, None)

    return Context()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    options = parser.parse_args()
    start = time.perf_counter()
    print("native reasons:", native.reasons() or "none", f"(first use {time.perf_counter() - start:.1f} s)")

    ops = {"rms_norm": rms_norm, "layer_norm": layer_norm, "l2norm": l2norm}
    natives = {
        "rms_norm": lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        "l2norm": lambda x, w, b: F.normalize(x, dim=-1, eps=1e-6),
    }
    calls_of = {
        "rms_norm": lambda x, w, b: rms_norm(x, w, backend="triton"),
        "layer_norm": lambda x, w, b: layer_norm(x, w, b, backend="triton"),
        "l2norm": lambda x, w, b: l2norm(x, backend="triton"),
    }
    # correctness: native node against the autograd.Function, bit for bit
    for name, op in ops.items():
        kernel_op = kernel_op_of(op)
        for dtype, shape, with_params, grad_kind in [
            (torch.bfloat16, (8192, 128), True, "dense"), (torch.bfloat16, (8192, 128), False, "dense"),
            (torch.float16, (3, 1000, 200), True, "expanded"), (torch.float32, (4097, 48), True, "strided"),
            (torch.bfloat16, (131072, 64), True, "dense"), (torch.bfloat16, (2048, 4096), True, "dense"),
        ]:  # fmt: skip
            torch.manual_seed(0)
            x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=True) if with_params else None
            b = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=True) if with_params else None
            if grad_kind == "dense":
                dy = torch.randn(*shape, device="cuda", dtype=dtype)
            elif grad_kind == "expanded":
                dy = torch.ones((), device="cuda", dtype=dtype).expand(*shape)
            else:
                dy = torch.randn(*shape[:-1], 2 * shape[-1], device="cuda", dtype=dtype)[..., ::2]
            inputs = [t for t in (x, w, b) if t is not None and not (name != "layer_norm" and t is b)]
            if name == "l2norm":
                inputs = [x]
            y = calls_of[name](x, w, b)
            node = type(y.grad_fn).__name__, y.grad_fn.name()
            got = torch.autograd.grad(y, inputs, dy)
            with python_path(kernel_op, "triton"):
                y_ref = calls_of[name](x, w, b)
                want = torch.autograd.grad(y_ref, inputs, dy)
            same = all(torch.equal(g, r) for g, r in zip(got, want))
            print(f"{name} {str(dtype)[6:]} {shape} params={with_params} dy={grad_kind}: node {node}, grads equal: {same}")

    # eager time per call, forward + backward
    shape, dtype = (8192, 128), torch.bfloat16
    x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(*shape, device="cuda", dtype=dtype)
    cases = {}
    for name in ops:
        params = [x] if name == "l2norm" else [x, w] if name == "rms_norm" else [x, w, b]
        cases[f"{name} F (native torch)"] = (lambda n=name, p=params: torch.autograd.grad(natives[n](x, w, b), p, dy), None)
        cases[f"{name} triton, C++ node"] = (lambda n=name, p=params: torch.autograd.grad(calls_of[n](x, w, b), p, dy), None)
        cases[f"{name} triton, autograd.Function"] = (
            lambda n=name, p=params: torch.autograd.grad(calls_of[n](x, w, b), p, dy), kernel_op_of(ops[name]))
    times = {case: [] for case in cases}
    for _ in range(options.rounds):
        for case, (fn, python_of) in cases.items():
            if python_of is None:
                times[case].append(per_call_us(fn, options.calls))
            else:
                with python_path(python_of, "triton"):
                    times[case].append(per_call_us(fn, options.calls))
    print(f"\neager forward + backward at {shape} bf16, us per call: median (rounds), {options.rounds} rounds x {options.calls} calls")
    for case, values in times.items():
        print(f"  {case:40s} {statistics.median(values):7.1f}  ({', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
