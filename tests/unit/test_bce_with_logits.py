"""binary_cross_entropy_with_logits on the CPU: the reference vs float64 textbook math and torch, the Triton
kernels under TRITON_INTERPRET=1 (set by conftest) forward and backward, the TileLang kernels compiled for
sm_90a, dispatch and every error."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import runtime.accelerators as acc
from conftest import SM90A, requires_nvcc
from runtime.accelerators.bce_with_logits import binary_cross_entropy_with_logits as bce
from runtime.accelerators.bce_with_logits import triton as bce_triton
from runtime.accelerators.bce_with_logits.layout import ABSENT, BROADCAST, FULL, broadcast_layout, kernel_operand
from runtime.accelerators.bce_with_logits.reference import bce_with_logits_reference
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def textbook64(x, y, weight=None, pos_weight=None, reduction="mean"):
    """-w (pw y log sigmoid(x) + (1 - y) log(1 - sigmoid(x))) in float64 (moderate |x| only)."""
    pw = 1.0 if pos_weight is None else pos_weight
    w = 1.0 if weight is None else weight
    s = torch.sigmoid(x)
    loss = -w * (pw * y * torch.log(s) + (1 - y) * torch.log(1 - s))
    return {"none": loss, "mean": loss.mean(), "sum": loss.sum()}[reduction]


def make_inputs(
    shape, dtype=f32, target_dtype=None, weight_shape=None, pos_weight_shape=None, scale=3.0, targets_grad=True
):
    x = (scale * torch.randn(shape)).to(dtype).requires_grad_()
    y = torch.rand(shape).to(target_dtype or dtype).requires_grad_(targets_grad)
    w = None if weight_shape is None else (0.5 + torch.rand(weight_shape))
    pw = None if pos_weight_shape is None else (0.5 + 2 * torch.rand(pos_weight_shape))
    return x, y, w, pw


def compare(out, grads, x, y, w, pw, reduction, grad_out, rtol, name, textbook=True):
    """out and grads (dlogits, dtargets) against float64 autograd of the textbook formula (or the reference)."""
    x64, y64 = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    w64 = None if w is None else w.double()
    pw64 = None if pw is None else pw.double()
    fn = textbook64 if textbook else bce_with_logits_reference
    ref = fn(x64, y64, w64, pw64, reduction)
    ref_grads = torch.autograd.grad(ref, (x64, y64), grad_out.double())
    assert out.shape == ref.shape
    assert_close(f"{name} loss", out, ref, rtol)
    for label, grad, ref_grad, tensor in zip(("dlogits", "dtargets"), grads, ref_grads, (x, y)):
        assert grad.dtype == tensor.dtype
        assert_close(f"{name} {label}", grad, ref_grad, gradient_tolerance(tensor.dtype, rtol))


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize(
    "weight_shape, pos_weight_shape",
    [(None, None), ((4, 37), None), (None, (37,)), ((4, 1), (37,)), ((), (1,))],
    ids=["plain", "weight", "pos_weight", "rowweight-posweight", "scalars"],
)
@pytest.mark.parametrize("dtype", [f32, bf16, f16], ids=["f32", "bf16", "f16"])
def test_reference_matches_float64_textbook(dtype, weight_shape, pos_weight_shape, reduction):
    x, y, w, pw = make_inputs((4, 37), dtype, weight_shape=weight_shape, pos_weight_shape=pos_weight_shape)
    out = bce_with_logits_reference(x, y, w, pw, reduction)
    grad_out = torch.randn(out.shape)
    grads = torch.autograd.grad(out, (x, y), grad_out.to(out.dtype))
    compare(out, grads, x, y, w, pw, reduction, grad_out.to(out.dtype).float(), RTOL[dtype], "reference")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_reference_matches_torch(reduction):
    x, y, w, pw = make_inputs((3, 5, 7), weight_shape=(5, 1), pos_weight_shape=(7,))
    ours = bce_with_logits_reference(x, y, w, pw, reduction)
    torch.testing.assert_close(ours, F.binary_cross_entropy_with_logits(x, y, w, reduction=reduction, pos_weight=pw))


def test_reference_is_finite_and_exact_for_huge_logits():
    x = torch.tensor([1e4, -1e4, 1e4, -1e4, 88.0, -88.0], requires_grad=True)
    y = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.5, 0.25], requires_grad=True)
    out = bce_with_logits_reference(x, y, reduction="none")
    expected = torch.tensor([1e4, 0.0, 0.0, 1e4, 44.0, 22.0])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    gx, gy = torch.autograd.grad(out.sum(), (x, y))
    assert torch.isfinite(gx).all() and torch.isfinite(gy).all()
    torch.testing.assert_close(gx, torch.tensor([1.0, 0.0, 0.0, -1.0, 0.5, -0.25]))


# --------------------------------------------------------------------------- broadcast layouts


@pytest.mark.parametrize(
    "operand, shape, layout",
    [
        ((4, 37), (4, 37), (1, 148)),  # full
        ((37,), (4, 37), (1, 37)),  # per class
        ((4, 1), (4, 37), (37, 4)),  # per row
        ((1, 3, 1), (2, 3, 5), (5, 3)),  # a middle dimension
        ((), (2, 3, 5), (1, 1)),  # scalar
        ((1,), (2, 3, 5), (1, 1)),
        ((2, 1, 5), (2, 3, 5), None),  # broadcast between kept dims: materialised
    ],
)
def test_broadcast_layout(operand, shape, layout):
    assert broadcast_layout(torch.empty(operand), torch.Size(shape)) == layout
    if layout is not None:  # the index map reproduces torch's broadcast
        values = torch.randn(operand)
        inner, count = layout
        index = (torch.arange(math.prod(shape)) // inner) % count
        assert torch.equal(values.reshape(-1)[index], values.expand(shape).reshape(-1))


# --------------------------------------------------------------------------- Triton under the interpreter

TRITON_CASES = [
    # (shape, reduction, weight shape, pos_weight shape)
    pytest.param((1,), "mean", None, None, id="1-mean"),
    pytest.param((37,), "sum", None, None, id="37-sum"),
    pytest.param((37,), "none", None, None, id="37-none"),
    pytest.param((3, 50), "mean", (3, 50), None, id="3x50-mean-weight"),
    pytest.param((3, 50), "none", None, (50,), id="3x50-none-posweight"),
    pytest.param((3, 50), "sum", (3, 1), (50,), id="3x50-sum-rowweight-posweight"),
    pytest.param((2, 3, 5), "mean", (2, 1, 5), (1, 3, 1), id="2x3x5-mean-materialised-middle"),
    pytest.param((4097,), "mean", None, None, id="4097-mean-two-blocks"),
]


@pytest.mark.parametrize("targets_grad", [True, False], ids=["targets-grad", "dlogits-in-forward"])
@pytest.mark.parametrize("shape, reduction, weight_shape, pos_weight_shape", TRITON_CASES)
def test_triton_forward_backward(shape, reduction, weight_shape, pos_weight_shape, targets_grad):
    """Without a target gradient these small inputs take the path where the forward kernel writes dlogits."""
    x, y, w, pw = make_inputs(
        shape, weight_shape=weight_shape, pos_weight_shape=pos_weight_shape, targets_grad=targets_grad
    )
    with poison_outputs():
        out = bce(x, y, w, pw, reduction, backend="triton")
        grad_out = torch.randn(out.shape)
        grads = torch.autograd.grad(out, (x, y) if targets_grad else (x,), grad_out)
    compare(out, grads, x, y, w, pw, reduction, grad_out, RTOL[f32], "triton")


LAUNCHES = {
    "block-per-program": bce_triton.Launch(block=512, num_warps=4),
    "3-programs-looping": bce_triton.Launch(block=512, num_warps=4, programs_per_sm=3),
    "2-programs-reverse-staged": bce_triton.Launch(block=1024, programs_per_sm=2, reverse=True, stages=2),
}


@pytest.mark.parametrize("targets_grad", [True, False], ids=["targets-grad", "dlogits-in-forward"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("launch", LAUNCHES.values(), ids=LAUNCHES.keys())
@pytest.mark.slow
def test_triton_large_input_launches(launch, reduction, targets_grad):
    """Inputs above SMALL.block take the large-input launches (one CPU "SM" under the interpreter): programs that
    loop over blocks, in reverse, a masked tail (3 x 2743 is no multiple of the block), weights by index map;
    without a target gradient the looping forward writes dlogits too."""
    launches = bce_triton.LargeLaunches(forward=launch, forward_none=launch, backward=launch)
    x, y, w, pw = make_inputs((3, 2743), weight_shape=(3, 1), pos_weight_shape=(2743,), targets_grad=targets_grad)
    args = (x.detach(), y.detach(), kernel_operand(w, x.shape), kernel_operand(pw, x.shape), reduction)
    with poison_outputs():
        if targets_grad:
            out = bce_triton.forward(*args, True, launches=launches)
            grad_out = torch.randn(out.shape)
            grads = bce_triton.backward(grad_out, *args, True, None, launches=launches)[:2]
        else:
            out, unit = bce_triton.unit_gradient_forward(*args, launches=launches)
            grad_out = torch.randn(out.shape)
            grads = bce_triton.UNIT_GRADIENT_KERNELS.backward(grad_out, *args, None, unit)[:1]
    compare(out, grads, x, y, w, pw, reduction, grad_out, RTOL[f32], f"triton {launch}")
    if not targets_grad:  # the loss of the forward that also writes the unit gradient is the plain forward's
        assert torch.equal(out, bce_triton.forward(*args, False, launches=launches))


@pytest.mark.parametrize("limit, targets_grad, expected", [(37, False, True), (36, False, False), (37, True, False)])
def test_triton_dlogits_from_the_forward_only_for_small_inputs_without_target_gradient(
    limit, targets_grad, expected, monkeypatch
):
    """Up to GRAD_IN_FORWARD_MAX_NUMEL logits, with no target gradient, backward scales the forward's dlogits;
    otherwise the backward kernel computes them. Both give the same gradient."""
    import runtime.accelerators.bce_with_logits as package
    from runtime.accelerators.bce_with_logits import layout

    scaled = []
    real = layout.scale_unit_gradient
    monkeypatch.setattr(layout, "scale_unit_gradient", lambda *args: scaled.append(1) or real(*args))
    x, y, _, _ = make_inputs((37,), bf16, targets_grad=targets_grad)
    out = package.kernel_loss(x, y, None, None, "mean", "triton", grad_in_forward_max_numel=limit)
    (dx,) = torch.autograd.grad(out, x, torch.tensor(0.75, dtype=bf16))
    assert bool(scaled) == expected
    x64 = x.detach().double().requires_grad_()
    ref = textbook64(x64, y.detach().double())
    assert dx.dtype == bf16
    assert_close(
        "dlogits",
        dx,
        torch.autograd.grad(ref, x64, torch.tensor(0.75, dtype=torch.float64))[0],
        gradient_tolerance(bf16),
    )


def test_triton_mixed_dtypes_and_no_target_gradient():
    x = (3 * torch.randn(3, 50)).to(bf16).requires_grad_()
    y = torch.rand(3, 50)  # fp32 targets, no gradient
    w = 0.5 + torch.rand(50)
    with poison_outputs():
        out = bce(x, y, w, backend="triton")
        (dx,) = torch.autograd.grad(out, x)
    assert out.dtype == f32 and dx.dtype == bf16  # torch's promotion; gradients take their input's dtype
    x64 = x.detach().double().requires_grad_()
    ref = textbook64(x64, y.double(), w.double())
    assert_close("triton mixed loss", out, ref, RTOL[f32])
    assert_close("triton mixed dlogits", dx, torch.autograd.grad(ref, x64)[0], gradient_tolerance(bf16))


def test_triton_none_with_broadcast_gradient():
    """loss.sum().backward() hands the kernel a stride-0 gradient: read as one value."""
    x, y, _, _ = make_inputs((37,))
    out = bce(x, y, reduction="none", backend="triton")
    out.sum().backward()
    x64, y64 = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    textbook64(x64, y64, reduction="sum").backward()
    assert_close("dlogits", x.grad, x64.grad, gradient_tolerance(f32))
    assert_close("dtargets", y.grad, y64.grad, gradient_tolerance(f32))


def test_triton_huge_logits_are_finite_and_exact():
    x = torch.tensor([1e4, -1e4, 1e4, -1e4, 88.0, -88.0, 30.0], requires_grad=True)
    y = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.5, 0.25, 1.0], requires_grad=True)
    pw = torch.tensor(3.0)
    for pos_weight in (None, pw):
        out = bce(x, y, pos_weight=pos_weight, reduction="none", backend="triton")
        ref = bce_with_logits_reference(x.double(), y.double(), pos_weight=pos_weight, reduction="none")
        gx, gy = torch.autograd.grad(out.sum(), (x, y))
        assert torch.isfinite(out).all() and torch.isfinite(gx).all() and torch.isfinite(gy).all()
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=0)  # also the tiny loss at x = 30, y = 1


def infinite_logits_case(weighted: bool, pos_weighted: bool, dtype=f32, device="cpu"):
    """Each of +inf and -inf against targets 0, 0.3 and 1, and two finite logits beside them."""
    inf = math.inf
    x = torch.tensor([inf, inf, inf, -inf, -inf, -inf, 2.5, -1.5], dtype=dtype, device=device)
    y = torch.tensor([0.0, 0.3, 1.0, 0.0, 0.3, 1.0, 0.3, 0.8], dtype=dtype, device=device)
    weight = torch.full((8,), 0.5, dtype=dtype, device=device) if weighted else None
    pos_weight = torch.full((8,), 2.0, dtype=dtype, device=device) if pos_weighted else None
    return x, y, weight, pos_weight


def check_infinite_logits_as_torch(backend, weighted, pos_weighted, dtype=f32, device="cpu"):
    """The loss, dlogits and dtargets equal torch's, inf and NaN included (forward alone, with the logits' gradient
    written by the forward, and with the backward kernel computing both gradients)."""
    x, y, weight, pos_weight = infinite_logits_case(weighted, pos_weighted, dtype, device)
    grad_out = torch.rand(8, dtype=dtype, device=device) + 0.5
    for targets_grad in (False, True):
        tensors = [x.clone().requires_grad_(), y.clone().requires_grad_(targets_grad)]
        expected_tensors = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
        out = bce(*tensors, weight, pos_weight, reduction="none", backend=backend)
        expected = F.binary_cross_entropy_with_logits(
            *expected_tensors, weight, pos_weight=pos_weight, reduction="none"
        )
        torch.testing.assert_close(out, expected, equal_nan=True)
        grads = torch.autograd.grad(out, tensors[: 1 + targets_grad], grad_out)
        expected_grads = torch.autograd.grad(expected, expected_tensors[: 1 + targets_grad], grad_out)
        for name, got, want in zip(("dlogits", "dtargets"), grads, expected_grads):
            torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}")
    for reduction in ("mean", "sum"):
        finite = slice(0, 1)  # +inf against target 0: an infinite mean and sum, not NaN
        out = bce(x[finite], y[finite], None if weight is None else weight[finite],
                  None if pos_weight is None else pos_weight[finite], reduction=reduction, backend=backend)  # fmt: skip
        assert out.item() == math.inf
        assert bce(x, y, weight, pos_weight, reduction=reduction, backend=backend).isnan()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("weighted", [False, True], ids=["", "weight"])
@pytest.mark.parametrize("pos_weighted", [False, True], ids=["", "pos_weight"])
def test_infinite_logits_give_what_torch_gives(backend, weighted, pos_weighted):
    with acc.use_accelerators(fallback="error"):
        check_infinite_logits_as_torch(backend, weighted, pos_weighted)


@pytest.mark.parametrize("pos_weight", [None, 3.0], ids=["plain", "pos_weight"])
def test_triton_tiny_losses_keep_their_relative_accuracy(pos_weight):
    """Confident, correct predictions: losses log1p(exp(-|x|)) of 3e-4 down to 2e-9, and their gradients."""
    magnitude = 8 + 12 * torch.rand(200)
    x = torch.cat([magnitude, -magnitude]).requires_grad_()
    y = torch.cat([torch.ones(200), torch.zeros(200)]).requires_grad_()
    pw = None if pos_weight is None else torch.tensor([pos_weight])
    out = bce(x, y, pos_weight=pw, reduction="none", backend="triton")
    grad_out = torch.randn(out.shape)
    compare(
        out,
        torch.autograd.grad(out, (x, y), grad_out),
        x,
        y,
        None,
        pw,
        "none",
        grad_out,
        RTOL[f32],
        "tiny",
        textbook=False,
    )


def test_triton_log1p_term_is_relatively_accurate_everywhere():
    """y = 1, x >= 0: the loss is log1p(exp(-x)) alone, the polynomial's term; within 5e-7 relative for x < 87
    (2.4e-7 from the fit and fp32 Horner, the rest exp's rounding)."""
    x = torch.linspace(0, 87, 20001)
    out = bce(x, torch.ones_like(x), reduction="none", backend="triton")
    exact = torch.log1p(torch.exp(-x.double()))
    assert ((out.double() - exact).abs() / exact).max() <= 5e-7


def test_triton_sum_is_deterministic():
    x, y, _, _ = make_inputs((4097,))
    first = bce(x, y, reduction="sum", backend="triton")
    assert torch.equal(first, bce(x, y, reduction="sum", backend="triton"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [bf16, f16])
def test_under_autocast_the_loss_is_float32_as_torch_gives_it(backend, dtype):
    x, y, w, pw = make_inputs((5, 37), dtype, weight_shape=(37,), pos_weight_shape=(5, 1))
    w, pw = w.to(dtype), pw.to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        ours = bce(x, y, w, pw, backend=backend)
        theirs = F.binary_cross_entropy_with_logits(x, y, w, pos_weight=pw)
    assert ours.dtype == theirs.dtype == f32
    assert_close("loss", ours, theirs, RTOL[f32])
    grads = torch.autograd.grad(ours, [x, y])
    expected = torch.autograd.grad(theirs, [x, y])
    for name, grad, want in zip(("dlogits", "dtargets"), grads, expected):
        assert grad.dtype == dtype
        assert_close(name, grad, want, gradient_tolerance(dtype))


def test_empty_input_matches_torch():
    x, y = torch.empty(0, 3, requires_grad=True), torch.empty(0, 3)
    for reduction in ("none", "mean", "sum"):
        out = bce(x, y, reduction=reduction, backend="triton")
        torch.testing.assert_close(out, F.binary_cross_entropy_with_logits(x, y, reduction=reduction), equal_nan=True)


@pytest.mark.parametrize("targets_grad", [True, False], ids=["targets-grad", "dlogits-in-forward"])
def test_compiled_custom_op_matches_eager(targets_grad):
    """Under torch.compile the kernels run as the custom ops taac::bce_with_logits_forward /
    taac::bce_with_logits_backward, or, when the targets need no gradient, taac::bce_with_logits_unit_gradient_forward
    (the unit gradient as its second result) / taac::bce_with_logits_unit_gradient_backward."""
    x, y, w, pw = make_inputs((3, 50), weight_shape=(50,), pos_weight_shape=(50,), targets_grad=targets_grad)
    inputs = (x, y) if targets_grad else (x,)

    def loss(x, y):
        return bce(x, y, w, pw, backend="triton")

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    out_c = compiled(x, y)
    grads_c = torch.autograd.grad(out_c, inputs)
    out_e = loss(x, y)
    grads_e = torch.autograd.grad(out_e, inputs)
    torch.testing.assert_close(out_c, out_e)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e)


# --------------------------------------------------------------------------- TileLang, compiled for sm_90a

TILELANG_VARIANTS = [
    # forward: (x, y, weight, pos_weight, loss dtypes, weight mode, pos_weight mode, reduce, unit gradient)
    ("forward", ("float32", "float32", "float32", "float32", "float32", ABSENT, ABSENT, True, False)),
    ("forward", ("bfloat16", "float32", "float32", "bfloat16", "float32", FULL, BROADCAST, False, False)),
    ("forward", ("bfloat16", "bfloat16", "float32", "float32", "bfloat16", BROADCAST, FULL, True, True)),
    ("sum", ("bfloat16",)),
    # backward: (x, y, weight, pos_weight, grad dtypes, weight mode, pos_weight mode, scalar grad, targets grad)
    ("backward", ("float16", "float16", "float32", "float16", "float32", BROADCAST, FULL, True, True)),
    ("backward", ("float32", "float32", "float32", "float32", "float32", ABSENT, ABSENT, False, False)),
]


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, args", TILELANG_VARIANTS, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v))
)
def test_tilelang_compiles_for_sm90a(kind, args):
    import tilelang

    from runtime.accelerators.bce_with_logits import tilelang as kernels

    build = {"forward": kernels.forward_func, "sum": kernels.sum_func, "backward": kernels.backward_func}[kind]
    kernel = tilelang.compile(build(*args), target=SM90A)
    source = kernel.get_kernel_source()
    assert "__global__" in source
    assert "atomic" not in source.lower()  # the reductions are fixed-order: per-block partials, then one block
    if kind != "sum":  # full blocks move 16-byte vectors
        assert "float4" in source or "uint4" in source


# --------------------------------------------------------------------------- dispatch and errors


def test_auto_picks_triton_under_the_interpreter_and_tilelang_falls_back():
    x, y, _, _ = make_inputs((37,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bce(x, y)  # auto: triton (interpreter), no warning
    with pytest.warns(
        acc.BackendFallbackWarning, match="bce_with_logits: the tilelang backend cannot run these inputs"
    ):
        out = bce(x, y, backend="tilelang")
    torch.testing.assert_close(out, F.binary_cross_entropy_with_logits(x, y))


def test_weight_gradient_falls_back_to_the_reference():
    x, y, _, _ = make_inputs((3, 50))
    w = (0.5 + torch.rand(50)).requires_grad_()
    with pytest.warns(acc.BackendFallbackWarning, match="weight requires grad"):
        out = bce(x, y, w, backend="triton")
    (dw,) = torch.autograd.grad(out, w)
    x64, y64, w64 = x.detach().double(), y.detach().double(), w.detach().double().requires_grad_()
    assert_close("dweight", dw, torch.autograd.grad(textbook64(x64, y64, w64), w64)[0], gradient_tolerance(f32))


def test_fallback_error_names_every_reason():
    x, y = torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64)
    with acc.use_accelerators(fallback="error"):
        with pytest.raises(acc.BackendUnavailableError) as error:
            bce(x, y, backend="triton")
    assert "bce_with_logits" in str(error.value)
    assert "logits has dtype float64" in str(error.value) and "targets has dtype float64" in str(error.value)


X43, Y43 = torch.randn(4, 3), torch.rand(4, 3)
OUTSIDE = r"targets: expected values in \[0, 1\]"
BAD_INPUTS = {
    "int-logits": (
        (torch.randint(0, 2, (4,)), torch.rand(4)),
        {},
        TypeError,
        "logits: expected a floating-point tensor",
    ),
    "int-targets": (
        (torch.randn(4), torch.randint(0, 2, (4,))),
        {},
        TypeError,
        "targets: expected a floating-point tensor",
    ),
    "list-targets": ((torch.randn(4), [0.0, 1.0, 0.0, 1.0]), {}, TypeError, "targets: expected a torch.Tensor"),
    "shape": ((X43, torch.rand(4, 1)), {}, ValueError, r"targets: expected the shape of logits \(4, 3\), got \(4, 1\)"),
    "weight-shape": ((X43, Y43), {"weight": torch.rand(4)}, ValueError, "weight: expected a shape broadcastable"),
    "weight-rank": ((X43, Y43), {"weight": torch.rand(1, 4, 3)}, ValueError, "weight: expected a shape broadcastable"),
    "pos-weight-shape": (
        (X43, Y43),
        {"pos_weight": torch.rand(2)},
        ValueError,
        "pos_weight: expected a shape broadcastable",
    ),
    "reduction": (
        (X43, Y43),
        {"reduction": "avg"},
        ValueError,
        "reduction: expected one of 'none', 'mean', 'sum', got 'avg'",
    ),
    "device": ((X43, torch.rand(4, 3, device="meta")), {}, ValueError, "targets: expected a tensor on cpu"),
    "range": ((torch.randn(3), torch.tensor([0.0, 1.5, -0.1])), {"check_targets": True}, ValueError, OUTSIDE),
    "nan": ((torch.randn(2), torch.tensor([0.0, float("nan")])), {"check_targets": True}, ValueError, OUTSIDE),
}


@pytest.mark.parametrize("args, kwargs, error, match", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        bce(*args, **kwargs)


def test_check_targets_accepts_probabilities_and_is_opt_in():
    x, y = torch.randn(4), torch.tensor([0.0, 1.0, 0.25, 1.0])
    bce(x, y, check_targets=True)
    bce(x, torch.tensor([2.0, -1.0, 0.5, 0.5]))  # unchecked by default, as torch
