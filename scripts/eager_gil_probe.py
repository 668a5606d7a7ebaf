"""Eager forward+backward per call with autograd's device threads on and off: a Python autograd.Function whose two
launches are ATen ops, the same with Triton launches (Triton's launcher releases the GIL around cuLaunchKernel), with
two Triton launches each way, our LayerNorm and F.layer_norm (8192x128 bf16). Median of 5 windows of 200 calls.

    bash .device/gpu python scripts/eager_gil_probe.py [--hold-gil]

--hold-gil: the Triton launchers keep the GIL across cuLaunchKernel (Triton's generated launcher source with its
Py_BEGIN/END_ALLOW_THREADS taken out; this process only), to test whether the release is what costs.

--python-work: instead, a Function with one ATen op each way plus the same pure-Python work (a loop over tuples, dict
and global lookups, calibrated to about 5 and 20 us on this host's main thread) in its forward or in its backward:
does Python cost more on autograd's device thread than on the main thread?

Session 28 (results/eager-gil-probe-2026-11-24-h100-s28.txt): with the device threads on, a Triton launch in the
Function cost 17-32 us a call more than an ATen op; with them off, 2 us. --hold-gil did not make ours faster
(results/eager-gil-probe-hold-2026-11-24-h100-s28.txt).
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

if "--hold-gil" in sys.argv:  # every Triton launcher of this process built without releasing the GIL (a test only)
    import triton.backends.nvidia.driver as driver

    _make_launcher = driver.make_launcher
    driver.make_launcher = lambda *args: _make_launcher(*args).replace("Py_BEGIN_ALLOW_THREADS;", "").replace(
        "Py_END_ALLOW_THREADS;", "")

from runtime.accelerators import layer_norm  # noqa: E402  (after the patch: no launcher is built before it)
from runtime.accelerators.triton_launch import direct_launch  # noqa: E402


@direct_launch
@triton.jit
def _touch(out_ptr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], dtype=tl.float32))


class Aten(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _touched(like, launches):
    out = torch.empty_like(like)
    for _ in range(launches):
        _touch[(1,)](out, BLOCK=16)
    return out


def triton_function(launches):
    """A Function whose forward and backward each make `launches` Triton launches."""

    class Touch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return _touched(x, launches)

        @staticmethod
        def backward(ctx, g):
            return _touched(g, launches)

    return Touch


Trit, Trit2 = triton_function(1), triton_function(2)
TABLE = {"a": 1}


def busy(n: int) -> int:
    """n steps of interpreter work touching a tuple, a dict, a global and a builtin each."""
    total = 0
    for i in range(n):
        total += len((i, TABLE["a"], LOOPS_PER_US))
    return total


def worked(n: int, where: str):
    """A Function with one ATen op each way and busy(n) in its forward or its backward."""

    class Worked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            if where == "forward":
                busy(n)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            if where == "backward":
                busy(n)
            return g * 2

    return Worked


def loops_per_us() -> float:
    start = time.perf_counter()
    busy(100_000)
    return 100_000 / ((time.perf_counter() - start) * 1e6)


LOOPS_PER_US = 1.0
LOOPS_PER_US = min(loops_per_us() for _ in range(5))

small = torch.randn(4096, device="cuda", requires_grad=True)
g = torch.randn_like(small)
x = torch.randn(8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
cases = {} if "--python-work" not in sys.argv else {
    f"{us} us Python in {where}": lambda f=worked(int(us * LOOPS_PER_US), where): torch.autograd.grad(f.apply(small), [small], g)
    for us in (0, 5, 20) for where in ("forward", "backward")
}
cases = cases or {
    "aten Function": lambda: torch.autograd.grad(Aten.apply(small), [small], g),
    "triton Function": lambda: torch.autograd.grad(Trit.apply(small), [small], g),
    "triton Function x2": lambda: torch.autograd.grad(Trit2.apply(small), [small], g),
    "ours LN": lambda: torch.autograd.grad(layer_norm(x, w, b, backend="triton"), [x, w, b], dy),
    "native LN": lambda: torch.autograd.grad(F.layer_norm(x, (128,), w, b), [x, w, b], dy),
}
print(f"busy(): {LOOPS_PER_US:.1f} steps per us on the main thread")
for mt in (True, False, True):
    torch.autograd.set_multithreading_enabled(mt)
    for name, fn in cases.items():
        for _ in range(50): fn()
        torch.cuda.synchronize()
        windows = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200): fn()
            torch.cuda.synchronize()
            windows.append((time.perf_counter() - t0) / 200 * 1e6)
        print(f"MT {mt!s:5} {name:20s} {statistics.median(windows):7.1f} us  (windows {min(windows):.1f}-{max(windows):.1f})", flush=True)
