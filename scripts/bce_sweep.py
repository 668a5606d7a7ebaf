"""Launch sweep of the BCE-with-logits Triton kernels at 2^24 elements, beside torch.compile and a plain copy.

    bash .device/gpu python scripts/bce_sweep.py        (GPU machine, repo root; about 2 minutes with compiles)

Every row is timed as `python -m runtime.benchmark` times it (CUDA-graph replays, L2 flushed before each, median
ms), after a check against a float64 torch reference (relative RMS error, the benchmark's bounds; the mean also
bit-identical over two calls). The variants replace the module globals FORWARD / FORWARD_NONE / BACKWARD of
runtime.accelerators.bce.triton, which inputs above SMALL.block elements use:

- forward (mean, none): elements per program and warps (8 to 32 values a thread: bytes in flight against
  registers), one program per block vs a persistent grid of k x SM programs looping over blocks, with and
  without cp.async prefetch of the next blocks;
- backward (timed as forward + backward, the forward the fastest of the forward rows): the same, and blocks walked
  last to first, so that the backward first reads what its forward left in L2.

fp32 repeats the default, the fastest bf16 variant and one persistent variant. `copy` is `dst.copy_(src)` of as
many bytes as the row moves; "of copy" is the row's bandwidth over the copy bandwidth the benchmark reports (of 1
GiB before session 27, which read 2.44 TB/s on an H100; of 256 MiB since, 3.05 TB/s).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from runtime.accelerators.bce import binary_cross_entropy_with_logits
from runtime.accelerators.bce import triton as kernels
from runtime.accelerators.testing import RTOL, relative_rms_error
from runtime.benchmark.timing import copy_bandwidth_tbs, gpu_time_ms

N = 2**24
Launch = kernels.Launch
FORWARD_VARIANTS = {
    "4096/8w": Launch(),
    "2048/4w": Launch(block=2048, num_warps=4),
    "1024/4w": Launch(block=1024, num_warps=4),
    "8192/8w": Launch(block=8192, num_warps=8),
    "4096/8w 4xSM": Launch(programs_per_sm=4),
    "2048/4w 8xSM": Launch(block=2048, num_warps=4, programs_per_sm=8),
    # the staged reductions need about 70 registers a thread: 3 (4096/8w) or 7 (2048/4w) programs fit on an SM
    "4096/8w 3xSM 2st": Launch(programs_per_sm=3, stages=2),
    "2048/4w 6xSM 3st": Launch(block=2048, num_warps=4, programs_per_sm=6, stages=3),
}
BACKWARD_VARIANTS = {
    "4096/8w": Launch(),
    "4096/8w rev": Launch(reverse=True),
    "2048/4w rev": Launch(block=2048, num_warps=4, reverse=True),
    "8192/8w rev": Launch(block=8192, num_warps=8, reverse=True),
    "4096/8w 4xSM rev": Launch(programs_per_sm=4, reverse=True),
    "4096/8w 4xSM rev 2st": Launch(programs_per_sm=4, reverse=True, stages=2),
    "2048/4w 8xSM rev 3st": Launch(block=2048, num_warps=4, programs_per_sm=8, reverse=True, stages=3),
}
SHORT = {torch.bfloat16: "bf16", torch.float32: "fp32"}
FP32_AFTER_S = 200  # the fp32 rows are left out when the bf16 ones took longer (compiles on a slow machine)
PERSISTENT = "4096/8w 4xSM"  # the persistent variant fp32 repeats (forward); its reversed twin for the backward


DEFAULTS = (kernels.FORWARD, kernels.FORWARD_NONE, kernels.BACKWARD)


def set_forward(reduction: str, launch: Launch) -> None:
    if reduction == "none":
        kernels.FORWARD_NONE = launch
    else:
        kernels.FORWARD = launch


def restore_defaults() -> None:
    kernels.FORWARD, kernels.FORWARD_NONE, kernels.BACKWARD = DEFAULTS


def torch_bce(logits, targets, reduction):
    return F.binary_cross_entropy_with_logits(logits, targets, reduction=reduction)


compiled_bce = torch.compile(torch_bce, dynamic=False)


def nbytes(dtype: torch.dtype, reduction: str, mode: str) -> int:
    """As the benchmark counts: fwd reads logits and targets and writes the loss; bwd reads logits, targets and the
    loss gradient and writes dlogits."""
    size = dtype.itemsize
    forward = 2 * N * size + (N * size if reduction == "none" else size)
    return forward if mode == "fwd" else 2 * forward + N * size


class Sweep:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = time.perf_counter()
        self.copy_tbs = copy_bandwidth_tbs(device)
        self.compile_ms: dict[tuple, float] = {}
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device
        print(f"{name}, copy bandwidth {self.copy_tbs:.2f} TB/s (1 GiB), N = 2^24")
        print(f"{'mode':<13}{'dtype':<6}{'impl':<9}{'launch':<22}{'ms':>8}{'TB/s':>7}{'of copy':>8}{'/compile':>9}"
              f"{'error':>10}{'at s':>6}")  # fmt: skip

    def inputs(self, dtype: torch.dtype):
        torch.manual_seed(0)
        x = (3 * torch.randn(N, device=self.device)).to(dtype).requires_grad_()
        y = torch.rand(N, device=self.device).to(dtype)
        return x, y

    def row(self, mode, reduction, dtype, impl, label, fn, error) -> float:
        times, _ = gpu_time_ms(fn, self.device)
        ms = times["median"]
        tbs = nbytes(dtype, reduction, mode) / (ms * 1e-3) / 1e12
        key = (mode, reduction, dtype)
        if impl == "compile":
            self.compile_ms[key] = ms
        ratio = ms / self.compile_ms[key] if key in self.compile_ms else float("nan")
        name = f"{mode} {reduction}"
        print(f"{name:<13}{SHORT[dtype]:<6}{impl:<9}{label:<22}{ms:8.4f}{tbs:7.2f}"
              f"{tbs / self.copy_tbs:8.0%}{ratio:9.3f}{error:10.1e}{time.perf_counter() - self.start:6.0f}")  # fmt: skip
        return ms

    def copy(self, mode, reduction, dtype):
        moved = nbytes(dtype, reduction, mode)
        src = torch.empty(moved // 2, dtype=torch.uint8, device=self.device).random_(0, 255)
        dst = torch.empty_like(src)
        self.row(mode, reduction, dtype, "copy", "", lambda: dst.copy_(src), 0.0)

    def forward(self, reduction, dtype, variants: dict[str, Launch]) -> str:
        """Rows of torch.compile, the copy and every forward variant; returns the fastest variant's name."""
        x, y = self.inputs(dtype)
        ref = torch_bce(x.detach().double(), y.double(), reduction)
        with torch.no_grad():
            error = relative_rms_error(compiled_bce(x, y, reduction), ref)
            self.row("fwd", reduction, dtype, "compile", "", lambda: compiled_bce(x, y, reduction), error)
        self.copy("fwd", reduction, dtype)
        best, best_ms = "4096/8w", float("inf")
        for name, launch in variants.items():
            set_forward(reduction, launch)
            with torch.no_grad():
                run = lambda: binary_cross_entropy_with_logits(x, y, reduction=reduction, backend="triton")  # noqa: E731
                out = run()
                error = relative_rms_error(out, ref)
                ok = error <= RTOL[dtype] and (reduction == "none" or torch.equal(out, run()))
                ms = self.row("fwd", reduction, dtype, "triton", name, run, error) if ok else None
            if ms is None:
                print(f"  {name}: WRONG (error {error:.1e}, bound {RTOL[dtype]:.0e}, or the mean not deterministic)")
            elif ms < best_ms:
                best, best_ms = name, ms
        restore_defaults()
        return best

    def forward_backward(self, reduction, dtype, forward: Launch, variants: dict[str, Launch]) -> str:
        x, y = self.inputs(dtype)
        x64 = x.detach().double().requires_grad_()
        ref = torch_bce(x64, y.double(), reduction)
        grad_out = torch.randn_like(ref).to(dtype)
        (ref_dx,) = torch.autograd.grad(ref, x64, grad_out.double())

        def timed(fn):
            def run():
                return torch.autograd.grad(fn(x, y, reduction), x, grad_out)

            return run

        def errors(fn):
            out = fn(x, y, reduction)
            (dx,) = torch.autograd.grad(out, x, grad_out)
            return relative_rms_error(out, ref), relative_rms_error(dx, ref_dx)

        self.row("fwd+bwd", reduction, dtype, "compile", "", timed(compiled_bce), max(errors(compiled_bce)))
        self.copy("fwd+bwd", reduction, dtype)

        def ours(x, y, reduction):
            return binary_cross_entropy_with_logits(x, y, reduction=reduction, backend="triton")

        set_forward(reduction, forward)
        best, best_ms = "4096/8w", float("inf")
        for name, launch in variants.items():
            kernels.BACKWARD = launch
            out_error, dx_error = errors(ours)
            if out_error <= RTOL[dtype] and dx_error <= 2 * RTOL[dtype]:
                ms = self.row("fwd+bwd", reduction, dtype, "triton", name, timed(ours), max(out_error, dx_error))
                if ms < best_ms:
                    best, best_ms = name, ms
            else:
                print(f"  {name}: WRONG (loss error {out_error:.1e}, dlogits error {dx_error:.1e})")
        restore_defaults()
        return best


def main(device: torch.device) -> None:
    sweep = Sweep(device)
    fastest = {}
    for reduction in ("mean", "none"):
        best = fastest[reduction] = sweep.forward(reduction, torch.bfloat16, FORWARD_VARIANTS)
        print(f"-- fastest bf16 forward ({reduction}): {best}")
    for reduction in ("mean", "none"):
        best = sweep.forward_backward(reduction, torch.bfloat16, FORWARD_VARIANTS[fastest[reduction]], BACKWARD_VARIANTS)
        fastest[reduction, "bwd"] = best
        print(f"-- fastest bf16 backward ({reduction}, forward {fastest[reduction]}): {best}")
    for reduction in ("mean", "none"):  # fp32: the default, the fastest bf16 variant and a persistent one
        if time.perf_counter() - sweep.start > FP32_AFTER_S:
            print(f"-- fp32 {reduction} left out: past {FP32_AFTER_S} s")
            continue
        names = dict.fromkeys(["4096/8w", fastest[reduction], PERSISTENT])
        best = sweep.forward(reduction, torch.float32, {name: FORWARD_VARIANTS[name] for name in names})
        names = dict.fromkeys(["4096/8w", fastest[reduction, "bwd"], PERSISTENT + " rev"])
        variants = {name: BACKWARD_VARIANTS[name] for name in names}
        sweep.forward_backward(reduction, torch.float32, FORWARD_VARIANTS[best], variants)
    print(f"done in {time.perf_counter() - sweep.start:.0f} s")


if __name__ == "__main__":
    torch._dynamo.config.cache_size_limit = 64  # one compiled graph per mode, reduction and dtype
    main(torch.device("cuda", torch.cuda.current_device()))
