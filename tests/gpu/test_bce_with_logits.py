"""binary_cross_entropy_with_logits on CUDA: both kernel backends against float64, outputs and every
gradient (kernel outputs are poisoned with NaN by conftest), determinism of the reductions, huge logits."""

import pytest
import torch

from runtime.accelerators.bce_with_logits import binary_cross_entropy_with_logits as bce
from runtime.accelerators.bce_with_logits.reference import bce_with_logits_reference, loss_dtype
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
BACKENDS = ("triton", "tilelang")
DTYPES = {"f32": f32, "bf16": bf16, "f16": f16}


@pytest.fixture(scope="module", autouse=True)
def _tilelang_kernels_compiled_in_parallel():
    """The TileLang kernels these tests use, compiled up front in parallel (lazily, one by one, they take
    a few seconds each). Names: logits, targets, weight, pos_weight, loss-or-gradient dtypes, modes, flags."""
    from runtime.accelerators.bce_with_logits import tilelang as kernels
    from runtime.accelerators.bce_with_logits.layout import ABSENT as A
    from runtime.accelerators.bce_with_logits.layout import BROADCAST as B
    from runtime.accelerators.bce_with_logits.layout import FULL as F
    from runtime.accelerators.tilelang_common import precompile

    f, b, h = "float32", "bfloat16", "float16"
    plain = [(d, d, d, d, d, A, A) for d in (f, b, h)]
    # (names, reduce / scalar gradient, targets grad) of test_features, the mixed, half, huge and tiny tests
    used = [
        ((f, f, f, f, f, A, A), False, True),
        ((f, f, f, f, f, F, A), True, True),
        ((f, f, f, f, f, B, B), True, True),
        ((f, f, f, f, f, B, B), False, True),
        ((f, f, f, f, f, F, B), True, True),
        ((b, f, f, b, f, B, A), True, False),
        ((h, h, h, h, h, A, B), False, True),
        ((f, f, f, f, f, A, B), False, True),
        ((f, f, f, f, f, A, B), True, True),
        ((b, b, b, b, b, A, A), False, True),
    ]
    entries = [kernels.sum_entry(d) for d in (f, b, h)]
    for names, reduce, targets_grad in [(n, True, True) for n in plain] + used:
        entries += [kernels.forward_entry(*names, reduce, False), kernels.backward_entry(*names, reduce, targets_grad)]
    for names, reduce, targets_grad in [(n, True, False) for n in plain] + used:
        if not targets_grad:  # small inputs whose targets need no gradient: the forward writes dlogits
            entries.append(kernels.forward_entry(*names, reduce, True))
    precompile(entries, torch.device("cuda", torch.cuda.current_device()))


def check(backend, x, y, weight=None, pos_weight=None, reduction="mean", sum_backward=False, grad_scale=1.0):
    """Loss and the gradients of every input that requires one, against float64 autograd of the reference."""
    out = bce(x, y, weight, pos_weight, reduction, backend=backend)
    inputs = [t for t in (x, y) if t.requires_grad]
    grad_out = out.new_ones(()).expand(out.shape) if sum_backward else torch.randn_like(out) * grad_scale
    grads = torch.autograd.grad(out, inputs, grad_out)
    check_against_reference(backend, x, y, weight, pos_weight, reduction, out, grads, grad_out)
    return out, grads


def check_against_reference(backend, x, y, weight, pos_weight, reduction, out, grads, grad_out):
    """out and the gradients of the inputs that require one against float64 autograd of the reference."""
    inputs = [t for t in (x, y) if t.requires_grad]
    x64 = x.detach().double().requires_grad_(x.requires_grad)
    y64 = y.detach().double().requires_grad_(y.requires_grad)
    w64 = None if weight is None else weight.double()
    pw64 = None if pos_weight is None else pos_weight.double()
    ref = bce_with_logits_reference(x64, y64, w64, pw64, reduction)
    ref_grads = torch.autograd.grad(ref, [t for t in (x64, y64) if t.requires_grad], grad_out.double())

    tag = f"{backend} {tuple(x.shape)} {x.dtype}/{y.dtype} {reduction}"
    assert out.shape == ref.shape and out.dtype == loss_dtype(x, y, weight, pos_weight)
    assert_close(f"{tag} loss", out, ref, RTOL[out.dtype])
    for tensor, grad, ref_grad in zip(inputs, grads, ref_grads):
        assert grad.dtype == tensor.dtype
        assert_close(f"{tag} grad", grad, ref_grad, gradient_tolerance(tensor.dtype))


def logits_targets(shape, dtype, targets_dtype=None, targets_grad=True):
    x = (4 * torch.randn(shape, device="cuda")).to(dtype).requires_grad_()
    y = torch.rand(shape, device="cuda").to(targets_dtype or dtype).requires_grad_(targets_grad)
    return x, y


@pytest.mark.parametrize("n", [1, 1000, 2**20 + 3])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
def test_dtypes_and_sizes(backend, dtype, n):
    # fp16 gradients of a mean, about 1/n, underflow for large n: scale the loss gradient as a loss scaler does
    check(backend, *logits_targets((n,), dtype), grad_scale=min(n, 1024) if dtype == f16 else 1.0)


# (shape, reduction, weight shape, pos_weight shape); 37 x 1000 is 9 full blocks and a partial one
FEATURES = [
    pytest.param((37, 1000), "none", None, None, id="none"),
    pytest.param((37, 1000), "sum", None, None, id="sum"),
    pytest.param((37, 1000), "mean", (37, 1000), None, id="weight-full"),
    pytest.param((37, 1000), "mean", (1000,), (1000,), id="weight-posweight-per-class"),
    pytest.param((37, 1000), "none", (37, 1), (1,), id="weight-per-row-posweight-scalar"),
    pytest.param((5, 37, 200), "sum", (5, 1, 200), (37, 1), id="weight-materialised-posweight-middle"),
    pytest.param((16, 256), "mean", None, (256,), id="one-block-mean"),  # PCVR batches: reduced in one program
    pytest.param((4096,), "sum", (4096,), None, id="one-full-block-sum"),
]


@pytest.mark.parametrize("shape, reduction, weight_shape, pos_weight_shape", FEATURES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_features(backend, shape, reduction, weight_shape, pos_weight_shape):
    x, y = logits_targets(shape, f32)
    weight = None if weight_shape is None else 0.5 + torch.rand(weight_shape, device="cuda")
    pos_weight = None if pos_weight_shape is None else 0.5 + 2 * torch.rand(pos_weight_shape, device="cuda")
    check(backend, x, y, weight, pos_weight, reduction)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_without_target_gradient(backend):
    x, y = logits_targets((37, 1000), bf16, targets_dtype=f32, targets_grad=False)
    weight = 0.5 + torch.rand(1000, device="cuda")
    out, _ = check(backend, x, y, weight)
    assert out.dtype == f32  # torch's type promotion


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_pos_weight_none(backend):
    x, y = logits_targets((37, 1000), f16)
    check(backend, x, y, pos_weight=(0.5 + 2 * torch.rand(1000, device="cuda")).to(f16), reduction="none")


@pytest.mark.parametrize("backend", BACKENDS)
def test_none_with_broadcast_gradient_and_strided_logits(backend):
    base = 4 * torch.randn(37, 2000, device="cuda")
    x = base[:, ::2].requires_grad_()  # a strided view
    y = torch.rand(37, 1000, device="cuda", requires_grad=True)
    check(backend, x, y, reduction="none", sum_backward=True)  # loss.sum().backward(): a stride-0 gradient


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reductions_are_bitwise_deterministic(backend, reduction):
    x, y = logits_targets((2**22 + 3,), f32)
    first = bce(x, y, reduction=reduction, backend=backend)
    first_grads = torch.autograd.grad(first, (x, y))
    for _ in range(3):
        again = bce(x, y, reduction=reduction, backend=backend)
        assert torch.equal(again, first)
        for g, g0 in zip(torch.autograd.grad(again, (x, y)), first_grads):
            assert torch.equal(g, g0)


LOOPING_LAUNCHES = {  # launches a sweep tried besides the default: programs looping over blocks
    "4xSM-reverse": dict(programs_per_sm=4, reverse=True),
    "6xSM-3-stages": dict(block=2048, num_warps=4, programs_per_sm=6, stages=3),
}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("launch", LOOPING_LAUNCHES.values(), ids=LOOPING_LAUNCHES.keys())
def test_triton_looping_launches(launch, reduction):
    from runtime.accelerators.bce_with_logits import triton as kernels
    from runtime.accelerators.bce_with_logits.layout import kernel_operand

    looping = kernels.Launch(**launch)
    launches = kernels.LargeLaunches(forward=looping, forward_none=looping, backward=looping)
    x, y = logits_targets((2**22 + 3,), bf16)  # several blocks per program and a partial one
    pos_weight = 0.5 + 2 * torch.rand(1, device="cuda")
    args = (x.detach(), y.detach(), None, kernel_operand(pos_weight, x.shape), reduction)
    out = kernels.forward(*args, True, launches=launches)
    grad_out = torch.randn_like(out)
    grads = kernels.backward(grad_out, *args, True, launches=launches)[:2]
    check_against_reference("triton", x, y, None, pos_weight, reduction, out, grads, grad_out)
    unit_out, unit = kernels.unit_gradient_forward(*args, launches=launches)
    unit_grads = kernels.UNIT_GRADIENT_KERNELS.backward(grad_out, *args, unit_out, unit)[:1]
    check_against_reference("triton", x, y, None, pos_weight, reduction, unit_out, unit_grads, grad_out)
    if reduction == "mean":  # bit-identical run to run, with or without the unit gradient written
        assert torch.equal(unit_out, out)
        assert torch.equal(kernels.forward(*args, True, launches=launches), out)


@pytest.mark.parametrize(
    "dtype, with_pos_weight", [(f32, False), (f32, True), (bf16, False)], ids=["f32", "f32-pos_weight", "bf16"]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_logits_are_finite_and_accurate(backend, dtype, with_pos_weight):
    n = 5000
    sign = torch.where(torch.rand(n, device="cuda") < 0.5, -1.0, 1.0)
    magnitude = torch.where(
        torch.rand(n, device="cuda") < 0.8,
        1e4 * (0.5 + torch.rand(n, device="cuda")),
        30 * torch.rand(n, device="cuda"),
    )
    x = (sign * magnitude).to(dtype).requires_grad_()
    y = torch.rand(n, device="cuda").to(dtype)
    y[:100] = 0.0
    y[100:200] = 1.0
    y.requires_grad_()
    pos_weight = torch.full((1,), 3.0, device="cuda") if with_pos_weight else None
    for reduction in ("none", "mean"):
        out, grads = check(backend, x, y, pos_weight=pos_weight, reduction=reduction)
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_losses_keep_their_relative_accuracy(backend):
    """Confident, correct predictions: losses log1p(exp(-|x|)) of 3e-4 down to 2e-9 (and their gradients),
    which only an accurate log1p and no cancellation get right to fp32 precision."""
    magnitude = 8 + 12 * torch.rand(5000, device="cuda")
    x = torch.cat([magnitude, -magnitude]).requires_grad_()
    y = torch.cat([torch.ones(5000, device="cuda"), torch.zeros(5000, device="cuda")]).requires_grad_()
    check(backend, x, y, reduction="none")
    check(backend, x, y, pos_weight=torch.full((1,), 3.0, device="cuda"), reduction="none")


@pytest.mark.parametrize(
    "dtype, weighted, pos_weighted",
    [(f32, False, False), (f32, True, True), (f32, False, True), (bf16, False, False)],
    ids=["f32", "f32-weight-pos_weight", "f32-pos_weight", "bf16"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_logits_give_what_torch_gives(backend, dtype, weighted, pos_weighted):
    """+inf and -inf logits against targets 0, 0.3 and 1, among finite ones, over several blocks: the loss, dlogits
    and dtargets equal torch's own on CUDA, inf and NaN included (forward alone, with dlogits written by the forward,
    and through the backward kernel)."""
    inf, reps = float("inf"), 700
    x = torch.tensor([inf, inf, inf, -inf, -inf, -inf, 2.5, -1.5], device="cuda").repeat(reps).to(dtype)
    y = torch.tensor([0.0, 0.3, 1.0, 0.0, 0.3, 1.0, 0.3, 0.8], device="cuda").repeat(reps).to(dtype)
    weight = (0.25 + torch.rand(x.shape, device="cuda")).to(dtype) if weighted else None
    pos_weight = (0.5 + 2 * torch.rand(x.shape, device="cuda")).to(dtype) if pos_weighted else None
    grad_out = (0.5 + torch.rand(x.shape, device="cuda")).to(dtype)
    for targets_grad in (False, True):
        tensors = [x.clone().requires_grad_(), y.clone().requires_grad_(targets_grad)]
        # torch's own function in float64 on CUDA: its inf and NaN, and finite values free of bf16 intermediates
        twins = [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]
        w64, pw64 = (None if t is None else t.double() for t in (weight, pos_weight))
        out = bce(*tensors, weight, pos_weight, reduction="none", backend=backend)
        expected = torch.nn.functional.binary_cross_entropy_with_logits(*twins, w64, pos_weight=pw64, reduction="none")
        assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())
        torch.testing.assert_close(out.double(), expected, equal_nan=True, rtol=RTOL[dtype], atol=0)
        grads = torch.autograd.grad(out, tensors[: 1 + targets_grad], grad_out)
        expected_grads = torch.autograd.grad(expected, twins[: 1 + targets_grad], grad_out.double())
        for name, got, want in zip(("dlogits", "dtargets"), grads, expected_grads):
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), name
            tolerance = gradient_tolerance(dtype)
            torch.testing.assert_close(
                got.double(), want, equal_nan=True, rtol=tolerance, atol=tolerance, msg=lambda m, n=name: f"{n}: {m}"
            )
    for reduction in ("mean", "sum"):
        assert bce(x, y, weight, pos_weight, reduction=reduction, backend=backend).isnan()
        first = slice(0, 8 * reps, 8)  # +inf against target 0 only: inf, not NaN
        only_inf = bce(x[first], y[first], None if weight is None else weight[first],
                       None if pos_weight is None else pos_weight[first], reduction=reduction, backend=backend)  # fmt: skip
        assert only_inf.item() == inf
