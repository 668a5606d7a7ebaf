"""dropout_add on CUDA: both kernel backends, every dtype, odd sizes around the block sizes.

Each kernel's keep mask is compared element by element with its generator rebuilt in torch
(reference.triton_keep_mask / tilelang_keep_mask), the output and dx against float64 with that
mask (outputs are poisoned with NaN by conftest). The keep rate and the independence of
neighbouring elements are checked on millions of elements, the backward's mask against the
forward's without the rebuilt generators, and torch.manual_seed repeats a run. The seed is a
device tensor drawn by the CUDA generator: forward and backward captured in a CUDA graph run the
kernels and draw a new mask on every replay."""

import math
import warnings

import pytest
import torch

from conftest import capture_graph
from runtime.accelerators.backends import BackendFallbackWarning
from runtime.accelerators.config import use_accelerators
from runtime.accelerators.dropout_add import dropout_add
from runtime.accelerators.dropout_add import reference as ref
from runtime.accelerators.seeds import draw_seed_tensor, saved_seeds
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
BACKENDS = ("triton", "tilelang")
MASKS = {"triton": ref.triton_keep_mask, "tilelang": ref.tilelang_keep_mask}
# not multiples of the blocks (Triton 8192, TileLang 4096 elements): 1 element, a partial block
# only, several full blocks plus a partial one
SHAPES = {"1": (1,), "1000": (1000,), "4097x3": (4097, 3), "3x8193": (3, 8193)}
CASES = [(bf16, s) for s in SHAPES] + [(f32, "1000"), (f32, "4097x3"), (f16, "1000"), (f16, "3x8193")]


@pytest.fixture(scope="module", autouse=True)
def _tilelang_kernels_compiled_in_parallel():
    from runtime.accelerators.dropout_add import tilelang as kernels
    from runtime.accelerators.tilelang_common import precompile

    entries = [make(d) for d in (f32, bf16, f16) for make in (kernels.forward_entry, kernels.backward_entry)]
    precompile(entries, torch.device("cuda", torch.cuda.current_device()))


def run(backend, x, r, p, seed_from):
    """dropout_add seeded by torch.manual_seed(seed_from): out, dx, dresidual, dout and the kernel's seed tensor."""
    x, r = x.detach().requires_grad_(), r.detach().requires_grad_()
    torch.manual_seed(seed_from)
    with saved_seeds() as seeds:
        out = dropout_add(x, r, p, backend=backend)
    (seed,) = seeds  # the seed tensor the kernels got (saved for backward)
    dout = torch.randn_like(out)
    dx, dr = torch.autograd.grad(out, (x, r), dout)
    return out, dx, dr, dout, seed


def assert_rate(count: int, n: int, q: float, what: str) -> None:
    """count successes of n Bernoulli(q) trials within 6 standard deviations."""
    sigma = math.sqrt(n * q * (1 - q))
    assert abs(count - n * q) <= 6 * sigma, f"{what}: {count} of {n}, expected {n * q:.0f} +- {6 * sigma:.0f}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, shape", CASES, ids=[f"{str(d)[6:]}-{s}" for d, s in CASES])
def test_forward_backward_against_float64_with_the_generators_mask(backend, dtype, shape):
    p = 0.3
    shape = SHAPES[shape]
    x, r = torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype)
    out, dx, dr, dout, seed = run(backend, x, r, p, seed_from=17)
    keep = MASKS[backend](x.numel(), seed, p, device="cuda").view(shape)
    tag = f"{backend} {shape} {dtype}"
    assert out.dtype == dx.dtype == dtype
    assert_close(f"{tag} out", out, ref.dropout_add_masked(x.double(), r.double(), keep, p), RTOL[dtype])
    assert_close(f"{tag} dx", dx, dout.double() * keep / (1 - p), gradient_tolerance(dtype))
    assert torch.equal(dr, dout)
    assert torch.equal(dx != 0, keep & (dout != 0)), "dx must be nonzero exactly where the generator keeps"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_and_independence(backend, p):
    n = 1 << 22
    x = torch.ones(n, device="cuda", requires_grad=True)
    out = dropout_add(x, torch.zeros(n, device="cuda"), p, backend=backend)
    keep = out != 0
    assert torch.equal(out[keep], torch.full_like(out[keep], 1 / (1 - p)))
    assert_rate(keep.sum().item(), n, 1 - p, f"{backend} p={p} kept")
    for i, part in enumerate(keep.chunk(64)):  # no block of the stream is off
        assert_rate(part.sum().item(), part.numel(), 1 - p, f"{backend} p={p} part {i}")
    for lag in (
        1,
        8,
        2048,
        4096,
    ):  # neighbours, vector mates, one Philox call (Triton), blocks apart: kept together with probability (1 - p)^2
        both = (keep[lag:] & keep[:-lag]).sum().item()
        assert_rate(both, n - lag, (1 - p) ** 2, f"{backend} p={p} pairs at lag {lag}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_drops_exactly_what_the_forward_dropped(backend):
    """Without the rebuilt generators: where the forward kept x (out != residual), dx = dout / (1 - p), else 0."""
    n, p = 3 * 8192 + 5, 0.4
    x = (1 + torch.rand(n, device="cuda")) * torch.randn(n, device="cuda").sign()  # |x| >= 1
    r = 1e-3 * torch.randn(n, device="cuda")  # x * scale never rounds away against r
    out, dx, _, dout, _ = run(backend, x, r, p, seed_from=23)
    kept = out != r
    torch.testing.assert_close(dx, torch.where(kept, dout / (1 - p), torch.zeros_like(dout)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_manual_seed_repeats_a_run(backend):
    x, r = torch.randn(3, 8193, device="cuda", dtype=bf16), torch.randn(3, 8193, device="cuda", dtype=bf16)
    torch.manual_seed(5)
    first = dropout_add(x, r, 0.5, backend=backend)
    second = dropout_add(x, r, 0.5, backend=backend)
    torch.manual_seed(5)
    assert torch.equal(dropout_add(x, r, 0.5, backend=backend), first)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training, p", [(False, 0.5), (True, 0.0)], ids=["eval", "p0"])
def test_identity(backend, training, p):
    x = torch.randn(1000, device="cuda", dtype=bf16, requires_grad=True)
    r = torch.randn(1000, device="cuda", dtype=bf16, requires_grad=True)
    out = dropout_add(x, r, p, training, backend=backend)
    assert torch.equal(out, x + r)
    dout = torch.randn_like(out)
    dx, dr = torch.autograd.grad(out, (x, r), dout)
    assert torch.equal(dx, dout) and torch.equal(dr, dout)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_seed_is_drawn_on_the_device_by_the_cuda_generator(backend):
    x, r = torch.randn(1000, device="cuda", requires_grad=True), torch.randn(1000, device="cuda")
    torch.manual_seed(31)
    with saved_seeds() as seeds:
        dropout_add(x, r, 0.5, backend=backend)
    (seed,) = seeds
    assert seed.device == x.device and seed.dtype == torch.int64 and seed.shape == (1,)
    torch.manual_seed(31)
    assert torch.equal(seed, draw_seed_tensor(x.device))
    torch.manual_seed(31)
    torch.rand(1)  # advances the CPU generator only: the CUDA one draws the seed
    assert torch.equal(seed, draw_seed_tensor(x.device))


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_backward_in_a_cuda_graph_run_the_kernels_with_a_new_mask_per_replay(backend):
    """Forward + backward captured in one CUDA graph, replayed twice. Each replay: the mask is the kernel's
    generator's for the seed that replay drew (read from the graph's own seed tensor), so the kernel ran in the
    graph; dx is zero exactly where out dropped x; the keep rate is 1 - p. The two replays drew different seeds
    and masks (independent: they agree on a fraction p^2 + (1 - p)^2)."""
    n, p = (1 << 20) + 5, 0.3  # not a multiple of either kernel's block
    x = (
        ((1 + torch.rand(n, device="cuda")) * torch.randn(n, device="cuda").sign()).to(bf16).requires_grad_()
    )  # |x| >= 1
    r = (1e-3 * torch.randn(n, device="cuda")).to(bf16).requires_grad_()  # x * scale never rounds away against r
    dout = ((0.5 + torch.rand(n, device="cuda")) * torch.randn(n, device="cuda").sign()).to(bf16)  # nonzero
    seeds: list[torch.Tensor] = []

    def step():
        with saved_seeds() as saved:
            out = dropout_add(x, r, p, backend=backend)
        seeds[:] = saved  # after capture: the graph's seed tensor, which every replay refills
        dx, dr = torch.autograd.grad(out, (x, r), dout)
        return out, dx, dr

    with use_accelerators(fallback="error"), warnings.catch_warnings():
        warnings.simplefilter("error", BackendFallbackWarning)
        graph, (out, dx, dr) = capture_graph(step)
    (seed,) = seeds

    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append((out.clone(), dx.clone(), dr.clone(), seed.item()))

    for i, (out_i, dx_i, dr_i, seed_i) in enumerate(replays):
        tag = f"{backend} replay {i} (seed {seed_i})"
        keep = out_i != r
        assert torch.equal(keep, MASKS[backend](n, seed_i, p, device="cuda")), (
            f"{tag}: not the kernel's mask for the replay's seed"
        )
        assert_close(f"{tag} out", out_i, ref.dropout_add_masked(x.double(), r.double(), keep, p), RTOL[bf16])
        assert torch.equal(dx_i != 0, keep), f"{tag}: dx must be zero exactly where out dropped x"
        assert_close(f"{tag} dx", dx_i, dout.double() * keep / (1 - p), gradient_tolerance(bf16))
        assert torch.equal(dr_i, dout)
        assert_rate(keep.sum().item(), n, 1 - p, f"{tag} kept")

    (out_a, _, _, seed_a), (out_b, _, _, seed_b) = replays
    assert seed_a != seed_b, "the two replays drew one seed"
    keep_a, keep_b = out_a != r, out_b != r
    assert not torch.equal(keep_a, keep_b)
    assert_rate((keep_a == keep_b).sum().item(), n, p**2 + (1 - p) ** 2, f"{backend} agreement of two replays' masks")
