"""swiglu on CUDA: both kernel backends against float64, output and both gradients (kernel outputs
are poisoned with NaN by conftest), every dtype, odd sizes around the block size, strided and
misaligned inputs."""

import pytest
import torch

from runtime.accelerators.swiglu import swiglu
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
BACKENDS = ("triton", "tilelang")
# sizes that are not multiples of the kernels' blocks (4096 elements): 1 element, a partial block
# only, full blocks plus a partial one
SHAPES = {"1": (1,), "1000": (1000,), "4097x3": (4097, 3), "3x8193": (3, 8193)}
CASES = [(bf16, s) for s in SHAPES] + [(f32, "1000"), (f32, "4097x3"), (f16, "1000"), (f16, "3x8193")]


@pytest.fixture(scope="module", autouse=True)
def _tilelang_kernels_compiled_in_parallel():
    from runtime.accelerators.swiglu import tilelang as kernels
    from runtime.accelerators.tilelang_common import precompile

    entries = [make(d) for d in (f32, bf16, f16) for make in (kernels.forward_entry, kernels.backward_entry)]
    precompile(entries, torch.device("cuda", torch.cuda.current_device()))


def textbook(gate, up, dy):
    """y, dgate, dup in float64."""
    g, u, dy = gate.double(), up.double(), dy.double()
    s = torch.sigmoid(g)
    return g * s * u, dy * u * (s + g * s * (1 - s)), dy * g * s


def check(backend, gate, up):
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    y = swiglu(gate, up, backend=backend)
    dy = torch.randn_like(y)
    dgate, dup = torch.autograd.grad(y, (gate, up), dy)
    ref_y, ref_dgate, ref_dup = textbook(gate.detach(), up.detach(), dy)
    tag = f"{backend} {tuple(gate.shape)} {gate.dtype}"
    assert y.dtype == dgate.dtype == dup.dtype == gate.dtype
    assert_close(f"{tag} y", y, ref_y, RTOL[gate.dtype])
    assert_close(f"{tag} dgate", dgate, ref_dgate, gradient_tolerance(gate.dtype))
    assert_close(f"{tag} dup", dup, ref_dup, gradient_tolerance(gate.dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, shape", CASES, ids=[f"{str(d)[6:]}-{s}" for d, s in CASES])
def test_forward_backward_against_float64(backend, dtype, shape):
    shape = SHAPES[shape]
    check(backend, 3 * torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_misaligned_inputs(backend):
    gate = (3 * torch.randn(4097, 3, device="cuda", dtype=bf16)).t()  # transposed: not contiguous
    up = torch.randn(3 * 4097 + 1, device="cuda", dtype=bf16)[1:].view(3, 4097)  # 2 bytes past 16-byte alignment
    check(backend, gate, up)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_gates_stay_finite(backend):
    g = torch.tensor([-1e4, -100.0, -1.0, 0.0, 1.0, 100.0, 1e4], device="cuda", requires_grad=True)
    u = torch.ones(7, device="cuda", requires_grad=True)
    y = swiglu(g, u, backend=backend)
    dg, du = torch.autograd.grad(y, (g, u), torch.ones_like(y))
    for t in (y, dg, du):
        assert torch.isfinite(t).all(), t
    torch.testing.assert_close(y, torch.nn.functional.silu(g.detach()))
