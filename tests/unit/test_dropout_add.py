"""dropout_add on the CPU: the reference and the kernels' mask generators (rebuilt in torch) against
float64 math and statistics, the Triton kernels under TRITON_INTERPRET=1 (forward and backward, the
mask element by element, the seed read from its device tensor), the TileLang kernels compiled for
sm_90a, determinism, dispatch and errors."""

import math
import re

import numpy as np
import pytest
import torch

from conftest import SM90A, requires_nvcc
from runtime.accelerators.backends import BackendFallbackWarning, BackendUnavailableError
from runtime.accelerators.config import use_accelerators
from runtime.accelerators.dropout_add import dropout_add
from runtime.accelerators.dropout_add import reference as ref
from runtime.accelerators.seeds import draw_seed_tensor, saved_seeds
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16 = torch.float32, torch.bfloat16
MASKS = {"triton": ref.triton_keep_mask, "tilelang": ref.tilelang_keep_mask}


def assert_keep_rate(keep: torch.Tensor, p: float, what: str = "") -> None:
    """The kept fraction within 6 standard deviations of 1 - p."""
    n = keep.numel()
    sigma = math.sqrt(n * p * (1 - p))
    kept = keep.sum().item()
    assert abs(kept - n * (1 - p)) <= 6 * sigma, (
        f"{what}: kept {kept} of {n}, expected {n * (1 - p):.0f} +- {6 * sigma:.0f}"
    )


# --------------------------------------------------------------------------- references and generators


def test_reference_identity_when_not_training_or_p_zero():
    x, r = torch.randn(4, 37), torch.randn(4, 37)
    torch.testing.assert_close(ref.dropout_add_reference(x, r, 0.5, training=False), x + r, rtol=0, atol=0)
    torch.testing.assert_close(ref.dropout_add_reference(x, r, 0.0), x + r, rtol=0, atol=0)


def test_reference_training_keeps_or_drops_each_element():
    x, r = torch.randn(20000, dtype=torch.float64), torch.randn(20000, dtype=torch.float64)
    out = ref.dropout_add_reference(x, r, 0.25)
    kept = (out - r).abs() > 1e-12
    torch.testing.assert_close(out, r + x * kept / 0.75)
    assert_keep_rate(kept, 0.25, "torch reference")


def test_masked_reference_matches_float64_math():
    x, r = torch.randn(3, 50, dtype=bf16), torch.randn(3, 50, dtype=bf16)
    keep = torch.rand(3, 50) > 0.3
    expected = r.double() + x.double() * keep.double() / 0.7
    assert_close("masked bf16", ref.dropout_add_masked(x, r, keep, 0.3), expected, RTOL[bf16])


def test_philox_known_answer():
    """Random123's known-answer vector of Philox4x32-10: counter 0, key 0."""
    outputs = ref._philox(0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert [int(o) for o in outputs] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_mul32_is_exact():
    b = torch.tensor([0, 1, 0xFFFF, 0x10000, 0x12345678, 0xFFFFFFFF], dtype=torch.int64)
    for a in (0, 1, 0xD2511F53, 0xFFFFFFFF):
        low, high = ref._mul32(a, b)
        for bi, lo, hi in zip(b.tolist(), low.tolist(), high.tolist()):
            assert (lo, hi) == ((a * bi) & 0xFFFFFFFF, (a * bi) >> 32)


def test_hash_mix_is_a_bijection_on_a_sample():
    h = ref._mix(torch.arange(1 << 16, dtype=torch.int64) * 65537)
    assert h.unique().numel() == 1 << 16 and h.min() >= 0 and h.max() < 2**32


@pytest.mark.parametrize("backend", list(MASKS))
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_generators_keep_rate(backend, p):
    keep = MASKS[backend](200_000, seed=1234, p=p)
    assert_keep_rate(keep, p, f"{backend} p={p}")
    # no structure along the stream: every chunk of 1/8 of it has the right rate, and so have
    # pairs of neighbours (kept together with probability (1 - p)^2)
    for part in keep.chunk(8):
        assert_keep_rate(part, p, f"{backend} p={p} chunk")
    assert_keep_rate(keep[1:] & keep[:-1], 1 - (1 - p) ** 2, f"{backend} p={p} neighbours")


@pytest.mark.parametrize("backend", list(MASKS))
def test_generators_seeds_give_independent_masks(backend):
    a, b = MASKS[backend](100_000, seed=1, p=0.5), MASKS[backend](100_000, seed=2, p=0.5)
    assert_keep_rate(a == b, 0.5, f"{backend} agreement of two seeds")


# --------------------------------------------------------------------------- Triton under the interpreter


def run_kernel(backend, x, r, p, seed_from):
    """dropout_add seeded by torch.manual_seed(seed_from); returns out, grads, the kernel's seed tensor."""
    x, r = x.clone().requires_grad_(), r.clone().requires_grad_()
    torch.manual_seed(seed_from)
    with saved_seeds() as seeds:
        out = dropout_add(x, r, p, backend=backend)
    (seed,) = seeds  # the seed tensor the kernel got, saved for backward
    dout = torch.randn_like(out)
    dx, dr = torch.autograd.grad(out, (x, r), dout)
    return out, dx, dr, dout, seed


@pytest.mark.parametrize("shape", [(1,), (37,), (3, 50)], ids=["1", "37", "3x50"])
@pytest.mark.parametrize("p", [0.1, 0.6])
def test_triton_interpreter_forward_backward(shape, p):
    x, r = torch.randn(shape), torch.randn(shape)
    out, dx, dr, dout, seed = run_kernel("triton", x, r, p, seed_from=7)
    keep = ref.triton_keep_mask(x.numel(), seed, p).view(shape)
    tag = f"triton {shape} p={p}"
    assert_close(f"{tag} out", out, ref.dropout_add_masked(x.double(), r.double(), keep, p), RTOL[f32])
    assert_close(f"{tag} dx", dx, dout.double() * keep / (1 - p), gradient_tolerance(f32))
    assert torch.equal(dr, dout)
    assert torch.equal(dx != 0, keep), "the backward must regenerate the forward's mask"


def test_triton_interpreter_mask_matches_generator_across_programs():
    """8193 elements: two programs of 8192 (a full and a 1-element partial block), every element compared."""
    x, r = torch.randn(8193), torch.randn(8193)
    out, dx, _, dout, seed = run_kernel("triton", x, r, 0.3, seed_from=11)
    keep = ref.triton_keep_mask(8193, seed, 0.3)
    assert torch.equal((out - r) != 0, keep)
    assert_close("triton 8193 out", out, ref.dropout_add_masked(x.double(), r.double(), keep, 0.3), RTOL[f32])


def test_triton_interpreter_bf16():
    x, r = torch.randn(2, 37, dtype=bf16), torch.randn(2, 37, dtype=bf16)
    out, dx, dr, dout, seed = run_kernel("triton", x, r, 0.3, seed_from=3)
    keep = ref.triton_keep_mask(x.numel(), seed, 0.3).view(2, 37)
    assert out.dtype == bf16 and dx.dtype == bf16
    assert_close("triton bf16 out", out, ref.dropout_add_masked(x.double(), r.double(), keep, 0.3), RTOL[bf16])
    assert_close("triton bf16 dx", dx, dout.double() * keep / 0.7, gradient_tolerance(bf16))


def test_manual_seed_repeats_a_run_and_new_draws_differ():
    x, r = torch.randn(3, 50), torch.randn(3, 50)
    torch.manual_seed(5)
    first = dropout_add(x, r, 0.5, backend="triton")
    second = dropout_add(x, r, 0.5, backend="triton")
    torch.manual_seed(5)
    again = dropout_add(x, r, 0.5, backend="triton")
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def test_another_manual_seed_gives_another_mask():
    x, r = torch.ones(20000), torch.zeros(20000)
    torch.manual_seed(5)
    a = dropout_add(x, r, 0.5, backend="triton") != 0
    torch.manual_seed(6)
    b = dropout_add(x, r, 0.5, backend="triton") != 0
    assert_keep_rate(a == b, 0.5, "agreement of the masks of two manual seeds")  # independent, not equal


def test_the_seed_is_a_device_tensor_drawn_by_the_devices_generator():
    """The kernel gets a one-element int64 tensor on x's device: the draw of draw_seed_tensor after the same
    torch.manual_seed (the generator of x's device: the CPU one here, the CUDA one on a GPU)."""
    x, r = torch.randn(37, requires_grad=True), torch.randn(37)
    torch.manual_seed(9)
    with saved_seeds() as seeds:
        dropout_add(x, r, 0.5, backend="triton")
    (seed,) = seeds
    assert seed.dtype == torch.int64 and seed.shape == (1,) and seed.device == x.device
    torch.manual_seed(9)
    assert torch.equal(seed, draw_seed_tensor(x.device))
    assert 0 <= seed.item() < 2**31


def test_the_kernels_load_the_seed_from_the_tensor():
    """The kernel module's functions with a chosen seed tensor: the mask of that seed, forward and backward."""
    from runtime.accelerators.dropout_add import triton as kernels

    n, p = 8193, 0.3
    x, r, dout = torch.randn(n), torch.randn(n), torch.randn(n)
    for value in (0, 1234, 2**31 - 1):
        seed = torch.tensor([value])
        keep = ref.triton_keep_mask(n, value, p)
        out = kernels.forward(x, r, p, seed)
        assert torch.equal((out - r) != 0, keep), f"seed {value}: forward"
        dx, dr, *_ = kernels.backward(dout, x, r, p, seed, out)
        assert torch.equal(dx != 0, keep), f"seed {value}: backward"
        assert dr is dout


def test_backward_uses_the_forwards_seed_after_other_draws():
    """Backward reads the forward's (saved) seed tensor, not the generator: draws in between change nothing."""
    x, r = torch.randn(3, 50, requires_grad=True), torch.randn(3, 50)
    out = dropout_add(x, r, 0.5, backend="triton")
    dropout_add(torch.randn(3, 50), r, 0.5, backend="triton")  # advances the generator
    torch.rand(100)
    dout = torch.rand(3, 50) + 0.5  # nonzero
    (dx,) = torch.autograd.grad(out, (x,), dout)
    kept = (out - r).abs() > 1e-6
    assert torch.equal(dx != 0, kept)
    torch.testing.assert_close(dx, dout * kept / 0.5)


@pytest.mark.parametrize("training, p", [(False, 0.5), (True, 0.0)], ids=["eval", "p0"])
def test_identity_draws_no_seed(training, p):
    x, r = torch.randn(37, requires_grad=True), torch.randn(37)
    state = torch.get_rng_state()
    with saved_seeds() as seeds:
        dropout_add(x, r, p, training, backend="triton")
    assert seeds == [] and torch.equal(torch.get_rng_state(), state)


def test_reference_masks_take_the_seed_as_a_tensor_or_an_int():
    for mask in MASKS.values():
        assert torch.equal(mask(1000, torch.tensor([77]), 0.4), mask(1000, 77, 0.4))
    assert ref.tilelang_keys(torch.tensor([2**31 - 1])) == ref.tilelang_keys(2**31 - 1)
    with pytest.raises(ValueError, match="seed: expected a one-element integer tensor"):
        ref.seed_value(torch.tensor([1.0]))


@pytest.mark.parametrize("training, p", [(False, 0.5), (True, 0.0)], ids=["eval", "p0"])
def test_identity_is_x_plus_residual_and_differentiable(training, p):
    x, r = torch.randn(37, requires_grad=True), torch.randn(37, requires_grad=True)
    out = dropout_add(x, r, p, training, backend="triton")
    assert torch.equal(out, x + r)
    dout = torch.randn(37)
    dx, dr = torch.autograd.grad(out, (x, r), dout)
    assert torch.equal(dx, dout) and torch.equal(dr, dout)


def test_empty_input():
    x = torch.randn(0, 4, requires_grad=True)
    out = dropout_add(x, torch.randn(0, 4), 0.5, backend="triton")
    assert out.shape == (0, 4)


@pytest.mark.slow
def test_torch_compile_matches_eager():
    """Under torch.compile the kernels run as custom ops; the residual's gradient (the incoming gradient
    itself) is copied out of the backward op, which may not return its input."""

    def f(x, r):
        return dropout_add(x, r, 0.3, backend="triton") * 2

    x, r = torch.randn(3, 50, requires_grad=True), torch.randn(3, 50, requires_grad=True)
    torch.manual_seed(1)
    out = torch.compile(f, backend="aot_eager")(x, r)
    grads = torch.autograd.grad(out.sum(), (x, r))
    torch.manual_seed(1)
    out_eager = f(x, r)
    grads_eager = torch.autograd.grad(out_eager.sum(), (x, r))
    assert torch.equal(out, out_eager)
    for g, e in zip(grads, grads_eager):
        assert torch.equal(g, e)


# --------------------------------------------------------------------------- TileLang, compile-only


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_tilelang_kernels_compile_for_sm90a(direction):
    import tilelang

    from runtime.accelerators.dropout_add import tilelang as kernels
    from runtime.accelerators.tilelang_common import device_info

    key, build = getattr(kernels, f"{direction}_entry")(bf16)
    kernel = tilelang.compile(build(device_info(None)), target=SM90A)
    source = kernel.get_kernel_source()
    n = kernel.params[0].shape[0]
    assert not isinstance(n, int) and not hasattr(n, "value"), f"the element count must be dynamic, got {n}"
    tensors = "X|R|Y" if direction == "forward" else "DY|DX"
    assert len(re.findall(rf"\*\(uint4\*\)\(({tensors}) \+", source)) == (3 if direction == "forward" else 2)
    assert str(ref.HASH_M1) in source and str(ref.HASH_M2) in source  # the hash the torch rebuild uses
    # the keys come from the seed tensor (one int64 load), not from constants or host scalars
    assert re.search(r"int64_t\* __restrict__ Seed", source) and "Seed[0]" in source
    assert str(ref.KEY_MULTIPLIER) in source


# --------------------------------------------------------------------------- dispatch and errors


def test_tilelang_on_cpu_falls_back_to_torch_dropout():
    x, r = torch.randn(1000), torch.randn(1000)
    with pytest.warns(BackendFallbackWarning, match="dropout_add: the tilelang backend cannot run.*CUDA"):
        out = dropout_add(x, r, 0.5, backend="tilelang")
    kept = out != r
    torch.testing.assert_close(out, r + x * kept / 0.5)
    with use_accelerators(fallback="error"), pytest.raises(BackendUnavailableError, match="dropout_add.*tilelang"):
        dropout_add(x, r, 0.5, backend="tilelang")


def test_dropout_has_no_graph_capture_reason():
    """The seed is drawn on the device (graph-safe): capturing a CUDA graph is no reason to leave the kernels."""
    from runtime.accelerators.dropout_add import SPEC

    x, r = torch.randn(64), torch.randn(64)
    assert SPEC.reasons("triton", x, r) == []
    assert SPEC.reasons("tilelang", x, r) == []  # tilelang's device reason comes from the environment, not here


def test_unsupported_dtype_falls_back():
    x, r = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    with pytest.warns(BackendFallbackWarning, match="x has dtype float64"):
        dropout_add(x, r, 0.5, backend="triton")


@pytest.mark.parametrize("p", [1.0, -0.1, 1.5, float("nan")])
def test_p_out_of_range_is_an_error_naming_p(p):
    with pytest.raises(ValueError, match=r"p: expected a dropout probability in \[0, 1\)"):
        dropout_add(torch.randn(3), torch.randn(3), p)


def test_p_may_be_any_real_number():
    x, r = torch.randn(64), torch.randn(64)
    torch.manual_seed(3)
    expected = dropout_add(x, r, 0.25, backend="torch")
    torch.manual_seed(3)
    torch.testing.assert_close(dropout_add(x, r, np.float32(0.25), backend="torch"), expected)


@pytest.mark.parametrize("p", ["0.1", True, torch.tensor(0.1)], ids=["str", "bool", "tensor"])
def test_p_of_the_wrong_type_is_an_error_naming_p(p):
    with pytest.raises(TypeError, match="p: expected a dropout probability"):
        dropout_add(torch.randn(3), torch.randn(3), p)


@pytest.mark.parametrize(
    "x, r, error, match",
    [
        (torch.randn(3), [1.0, 2.0, 3.0], TypeError, "residual: expected a torch.Tensor, got list"),
        (torch.ones(3, dtype=torch.int32), torch.randn(3), TypeError, "x: expected a floating-point tensor"),
        (torch.randn(3), torch.randn(1), ValueError, r"residual: expected the shape of x \(3,\), got \(1,\)"),
        (torch.randn(3), torch.randn(3, dtype=bf16), TypeError, "residual: expected the dtype of x"),
        (torch.randn(3), torch.randn(3, device="meta"), ValueError, "residual: expected a tensor on cpu like x"),
    ],
    ids=["residual-list", "x-int", "shape", "dtype", "device"],
)
def test_tensor_errors_name_the_argument(x, r, error, match):
    with pytest.raises(error, match=match):
        dropout_add(x, r, 0.1)
