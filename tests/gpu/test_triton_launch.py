"""Direct launches of compiled Triton kernels on CUDA: after the first call per argument signature the kernel is
launched without Triton's binder, on the current stream, with launch hooks honoured; results stay exact."""

import pytest
import torch
import triton

from runtime.accelerators import rms_norm
from runtime.accelerators.norms_kernels import row_norm_forward

WIDTH = 200


def _reference(x, weight):
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * weight.double()).to(x.dtype)


@pytest.fixture
def binder_calls(monkeypatch):
    """How many launches of the row norms' forward kernel (rms_norm's) went through Triton's own JIT path."""
    jit = row_norm_forward.kernel
    calls, run = [], jit.run

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(jit, "run", counted)
    return calls


def _check(x, weight):
    y = rms_norm(x, weight, backend="triton")
    torch.testing.assert_close(y, _reference(x, weight), rtol=1e-2, atol=1e-2)
    return y


def test_later_calls_of_a_signature_skip_the_binder(binder_calls):
    weight = torch.randn(WIDTH, device="cuda", dtype=torch.bfloat16)
    rows = [7, 64, 1000, 3]
    for n in rows:
        _check(torch.randn(n, WIDTH, device="cuda", dtype=torch.bfloat16), weight)
    compiled = len(binder_calls)
    assert compiled <= 2  # n_rows % 16 == 0 is a signature of its own
    for n in rows:
        _check(torch.randn(n, WIDTH, device="cuda", dtype=torch.bfloat16), weight)
    assert len(binder_calls) == compiled


def test_misaligned_and_other_dtype_inputs_get_their_own_compiled_kernels(binder_calls):
    base = torch.randn(65 * WIDTH + 1, device="cuda", dtype=torch.float32)
    aligned = base[: 64 * WIDTH].view(64, WIDTH)
    misaligned = base[1 : 64 * WIDTH + 1].view(64, WIDTH)  # 4 bytes off
    weight = torch.randn(WIDTH, device="cuda", dtype=torch.float32)
    for _ in range(3):
        for x in (aligned, misaligned, aligned.half(), misaligned):
            _check(x, weight if x.dtype == torch.float32 else weight.half())
    assert 1 <= len(binder_calls) <= 3


def test_a_side_stream_and_a_launch_hook(binder_calls):
    weight = torch.randn(WIDTH, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, WIDTH, device="cuda", dtype=torch.bfloat16)
    _check(x, weight)
    compiled = len(binder_calls)
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731  (a LazyDict)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            y = rms_norm(x, weight, backend="triton")
        torch.cuda.current_stream().wait_stream(stream)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.testing.assert_close(y, _reference(x, weight), rtol=1e-2, atol=1e-2)
    assert seen == ["row_norm_forward"] and len(binder_calls) == compiled


def test_triton_36_direct_launches_call_the_launch_function(binder_calls):
    """On Triton 3.6.0 (the GPU machine's) a direct launch calls CudaLauncher's launch function itself, with the four
    arguments its Python __call__ adds (triton_launch._launcher); results stay exact."""
    if triton.__version__ != "3.6.0":
        pytest.skip(f"Triton {triton.__version__}: direct launches call compiled.run")
    weight = torch.randn(WIDTH, device="cuda", dtype=torch.bfloat16)
    for n in (64, 64, 37):
        _check(torch.randn(n, WIDTH, device="cuda", dtype=torch.bfloat16), weight)
    entries = list(row_norm_forward._compiled.values())
    assert entries and all(type(compiled.run).__name__ == "CudaLauncher" for compiled, *_ in entries)
    assert all(launch == compiled.run.launch and len(extra) == 4 for compiled, _, launch, extra in entries)
