"""add_rms_norm / add_layer_norm on the CPU: the reference against float64 textbook math, the Triton kernels under
TRITON_INTERPRET=1 (set by conftest) forward and backward with gradients flowing into both outputs, the TileLang
kernels compiled for sm_90a, torch.compile, the benchmark runner's two-output path, dispatch and every error."""

import dataclasses
import re
import warnings

import pytest
import torch

import runtime.accelerators as acc
from conftest import SM90A, requires_gxx, requires_nvcc, tilelang_on_cpu
from norm_reference import reference64
from runtime.accelerators import add_layer_norm, add_rms_norm, norms_triton
from runtime.accelerators.add_norm import triton as add_norm_triton
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
OPS = {"rms": add_rms_norm, "layer": add_layer_norm}
EPS = {"rms": 1e-6, "layer": 1e-5}
NORM = {"rms": "rms_norm", "layer": "layer_norm"}


def textbook(op, x, residual, weight=None, bias=None, eps=None):
    """(y, x + residual) in float64 from the formulas."""
    total = x + residual
    return reference64(NORM[op], total, weight, bias, EPS[op] if eps is None else eps), total


def make_inputs(op, shape, dtype, weight_dtype=None, bias_dtype=None, strided=False):
    """x, residual and the parameters (requiring grad); strided: x and residual rows padded differently."""
    width = shape[-1]
    if strided:
        x = torch.randn(*shape[:-1], width + 8, dtype=dtype)[..., :width]
        residual = torch.randn(*shape[:-1], width + 3, dtype=dtype)[..., 3:]
    else:
        x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    params = {}
    if weight_dtype is not None:
        params["weight"] = (1 + 0.5 * torch.randn(width)).to(weight_dtype).requires_grad_()
    if bias_dtype is not None and op == "layer":
        params["bias"] = torch.randn(width).to(bias_dtype).requires_grad_()
    return x.requires_grad_(), residual.requires_grad_(), params


def check(op, backend, x, residual, params, eps=None, rtol=None):
    """y, the new residual and the gradients of x, residual and every parameter (dy and dnew both flowing in)
    against float64."""
    dtype = x.dtype
    kwargs = {} if eps is None else {"eps": eps}
    with poison_outputs():
        y, total = OPS[op](x, residual, **params, **kwargs, backend=backend)
        dy, dnew = torch.randn_like(y), torch.randn_like(total)
        grads = torch.autograd.grad((y, total), [x, residual, *params.values()], (dy, dnew))
    x64, r64 = x.detach().double().requires_grad_(), residual.detach().double().requires_grad_()
    params64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    y64, total64 = textbook(op, x64, r64, **params64, eps=eps)
    grads64 = torch.autograd.grad((y64, total64), [x64, r64, *params64.values()], (dy.double(), dnew.double()))

    tag = f"{op} {backend} {tuple(x.shape)} {dtype} " + " ".join(f"{k}={v.dtype}" for k, v in params.items())
    rtol = RTOL[dtype] if rtol is None else rtol
    assert y.dtype == total.dtype == dtype and y.shape == total.shape == x.shape
    assert_close(f"{tag} y", y, y64, rtol)
    assert_close(f"{tag} new_residual", total, total64, rtol)
    for name, tensor, grad, grad64 in zip(["x", "residual", *params], [x, residual, *params.values()], grads, grads64):
        assert grad.dtype == tensor.dtype and grad.shape == tensor.shape, f"d{name}: {grad.dtype} {tuple(grad.shape)}"
        assert_close(f"{tag} d{name}", grad, grad64, gradient_tolerance(tensor.dtype, rtol))
    return grads


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", [f32, bf16, f16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("op", list(OPS))
def test_reference_matches_textbook_math(op, dtype):
    x, residual, params = make_inputs(op, (37, 200), dtype, f32, f32)
    check(op, "torch", x, residual, params)


@pytest.mark.parametrize("op", list(OPS))
def test_reference_keeps_float64(op):
    x, residual, params = make_inputs(op, (5, 8), torch.float64, torch.float64, torch.float64)
    y, total = OPS[op](x, residual, **params, backend="torch")
    y64, total64 = textbook(op, x, residual, **params)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, y64, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, total64, rtol=0, atol=0)


# --------------------------------------------------------------------------- Triton under the interpreter

# (op, shape, x dtype, weight dtype, bias dtype): rows 1 and 37, widths 8, 200 and 1000, mixed precision
TRITON_CASES = [
    pytest.param("rms", (1, 8), f32, None, None, id="rms-1x8-f32"),
    pytest.param("rms", (37, 200), bf16, f32, None, id="rms-37x200-bf16-w_f32"),
    pytest.param("rms", (37, 1000), f16, f16, None, id="rms-37x1000-f16-w_f16"),
    pytest.param("rms", (2, 3, 200), f32, f32, None, id="rms-2x3x200-f32-w"),
    pytest.param("layer", (1, 8), bf16, bf16, bf16, id="layer-1x8-bf16-wb"),
    pytest.param("layer", (37, 200), f32, f32, f32, id="layer-37x200-f32-wb"),
    pytest.param("layer", (37, 1000), bf16, f32, f32, id="layer-37x1000-bf16-wb_f32"),
    pytest.param("layer", (37, 8), f16, None, None, id="layer-37x8-f16"),
    pytest.param("layer", (37, 200), bf16, None, f32, id="layer-37x200-bf16-b_f32"),
    pytest.param("layer", (1, 200), f16, f16, None, id="layer-1x200-f16-w"),
]


@pytest.mark.parametrize("op, shape, dtype, weight_dtype, bias_dtype", TRITON_CASES)
def test_triton_forward_backward(op, shape, dtype, weight_dtype, bias_dtype):
    check(op, "triton", *make_inputs(op, shape, dtype, weight_dtype, bias_dtype))


@pytest.mark.parametrize("op", list(OPS))
def test_triton_strided_rows(op):
    """x and residual whose rows are padded (each its own row stride) are read in place, as they hold."""
    check(op, "triton", *make_inputs(op, (37, 200), f32, f32, f32, strided=True))


@pytest.mark.parametrize("op", list(OPS))
def test_triton_eps(op):
    check(op, "triton", *make_inputs(op, (7, 200), f32, f32, f32), eps=0.5)


@pytest.mark.parametrize("which", ["y", "new_residual"])
@pytest.mark.parametrize("op", list(OPS))
def test_triton_gradient_of_one_output(op, which):
    """A gradient reaching only one of the outputs (autograd gives the other zeros)."""
    x, residual, params = make_inputs(op, (37, 200), bf16, f32, f32)
    y, total = OPS[op](x, residual, **params, backend="triton")
    out = y if which == "y" else total
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, residual, *params.values()], dout)
    x64, r64 = x.detach().double().requires_grad_(), residual.detach().double().requires_grad_()
    params64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    out64 = textbook(op, x64, r64, **params64)[0 if which == "y" else 1]
    grads64 = torch.autograd.grad(out64, [x64, r64, *params64.values()], dout.double(), allow_unused=True)
    for name, grad, grad64 in zip(["x", "residual", *params], grads, grads64):
        if grad64 is None:  # the parameters do not reach the new residual
            assert torch.equal(grad, torch.zeros_like(grad)), f"d{name} should be zero"
        else:
            assert_close(f"{op} {which} d{name}", grad, grad64, gradient_tolerance(bf16))


@pytest.mark.parametrize("op", list(OPS))
def test_triton_only_parameters_require_grad(op):
    """x and residual without grad, the weight (and bias) with: the new residual requires no grad, as on the torch
    backend, and the parameters' gradients are right."""
    x, residual, params = make_inputs(op, (5, 24), f32, f32, f32)
    x, residual = x.detach(), residual.detach()
    y, total = OPS[op](x, residual, **params, backend="triton")
    y_ref, total_ref = OPS[op](x, residual, **params, backend="torch")
    assert not total.requires_grad and not total_ref.requires_grad and y.requires_grad
    assert_close(f"{op} new_residual", total, total_ref, RTOL[f32])
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, list(params.values()), dy)
    grads_ref = torch.autograd.grad(y_ref, list(params.values()), dy)
    for name, grad, grad_ref in zip(params, grads, grads_ref):
        assert_close(f"{op} d{name}", grad, grad_ref, gradient_tolerance(f32))


@pytest.mark.parametrize("op", list(OPS))
def test_triton_forward_without_autograd_matches(op):
    """With nothing to differentiate the kernel module's infer runs (no statistics): the same outputs, bit for bit."""
    x, residual, params = make_inputs(op, (37, 200), bf16, f32, f32)
    with poison_outputs():
        with torch.no_grad():
            inferred = OPS[op](x, residual, **params, backend="triton")
        trained = OPS[op](x, residual, **params, backend="triton")
    assert inferred[0].grad_fn is None and trained[0].grad_fn is not None
    for a, b in zip(inferred, trained):
        assert torch.equal(a, b.detach())


@pytest.mark.parametrize("op", list(OPS))
def test_eager_calls_do_not_keep_x_and_residual_for_backward(op):
    """The backward reads the sum, not x or residual: changing them in place after the forward is no error (autograd
    would refuse a saved tensor changed in place), and the gradients are those of the values at the forward."""
    x0, r0, params = make_inputs(op, (37, 200), f32, f32, f32)
    x, residual = x0 * 1, r0 * 1  # non-leaf tensors, changeable in place
    y, total = OPS[op](x, residual, **params, backend="triton")
    dy, dnew = torch.randn_like(y), torch.randn_like(total)
    with torch.no_grad():
        x.add_(1.0)
        residual.mul_(3.0)
    grads = torch.autograd.grad((y, total), [x0, r0, *params.values()], (dy, dnew))
    check_x, check_r = x0.detach().requires_grad_(), r0.detach().requires_grad_()
    expected = torch.autograd.grad(
        OPS[op](check_x, check_r, **params, backend="torch"), [check_x, check_r, *params.values()], (dy, dnew)
    )
    for grad, ref in zip(grads, expected):
        assert_close(f"{op} gradient after in-place change", grad, ref.double(), 1e-5)


SEVERAL_PROGRAMS = norms_triton.ParameterBackwardLaunch(max_programs=5)


def kernel_grads(op, x, residual, params, dy, dnew, launch):
    """The gradients of x, residual and the parameters by the op's Triton module, its backward launched as
    `launch`."""
    parameters = [params["weight"].detach()] + ([params["bias"].detach()] if op == "layer" else [])
    args = (x.detach(), residual.detach(), *parameters, EPS[op])
    forward = getattr(add_norm_triton, f"{op}_forward")
    backward = getattr(add_norm_triton, f"{op}_backward")
    with poison_outputs():
        results = forward(*args)
        grads = backward(dy, dnew, *args, *results, launch=launch)
    return grads[: 2 + len(params)]


@pytest.mark.parametrize("op", list(OPS))
def test_triton_one_launch_backward_with_several_programs(op):
    """Several persistent programs each looping over tiles: the last adds every program's partials; the gradients
    match float64, repeat bit for bit, and match the two-launch path (sum_partials)."""
    x, residual, params = make_inputs(op, (1000, 48), bf16, f32, f32)
    torch.manual_seed(1)
    dy, dnew = torch.randn(1000, 48, dtype=bf16), torch.randn(1000, 48, dtype=bf16)
    one = kernel_grads(op, x, residual, params, dy, dnew, SEVERAL_PROGRAMS)
    x64, r64 = x.detach().double().requires_grad_(), residual.detach().double().requires_grad_()
    params64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    expected = torch.autograd.grad(
        textbook(op, x64, r64, **params64), [x64, r64, *params64.values()], (dy.double(), dnew.double())
    )
    for name, tensor, grad, grad64 in zip(["x", "residual", *params], [x, residual, *params.values()], one, expected):
        assert grad.dtype == tensor.dtype and grad.shape == tensor.shape, f"d{name}: {grad.dtype} {tuple(grad.shape)}"
        assert_close(f"{op} d{name}", grad, grad64, gradient_tolerance(tensor.dtype, RTOL[bf16]))
    for a, b in zip(one, kernel_grads(op, x, residual, params, dy, dnew, SEVERAL_PROGRAMS)):
        assert torch.equal(a, b)
    # the partials added in a second launch
    two = kernel_grads(op, x, residual, params, dy, dnew, dataclasses.replace(SEVERAL_PROGRAMS, finish_max_steps=0))
    assert len(one) == len(two)
    for a, b in zip(one[:2], two[:2]):
        assert torch.equal(a, b)
    for a, b in zip(one[2:], two[2:]):
        assert_close(f"{op} one vs two launches", a, b.double(), 1e-6)


@pytest.mark.parametrize("op", list(OPS))
def test_compiled_full_graph_matches_eager(op):
    """Under torch.compile the kernels run as custom ops: the same outputs and gradients as eager, and dx and
    dresidual do not share memory (a custom op's outputs may not alias)."""
    x, residual, params = make_inputs(op, (37, 200), f32, f32, f32)
    fn = lambda x, r, *p: OPS[op](x, r, *p, backend="triton")  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    dy, dnew = torch.randn(37, 200), torch.randn(37, 200)
    out_c = compiled(x, residual, *params.values())
    grads_c = torch.autograd.grad(out_c, [x, residual, *params.values()], (dy, dnew))
    out_e = fn(x, residual, *params.values())
    grads_e = torch.autograd.grad(out_e, [x, residual, *params.values()], (dy, dnew))
    for a, b in zip((*out_c, *grads_c), (*out_e, *grads_e)):
        torch.testing.assert_close(a, b)
    assert grads_c[0].untyped_storage().data_ptr() != grads_c[1].untyped_storage().data_ptr()


def test_kernel_modules_custom_op_backward_returns_unaliased_gradients():
    from runtime.accelerators.add_norm import RMS_KERNEL

    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    weight = torch.ones(8)
    y, total, rstd = RMS_KERNEL._forward_op("triton", x, residual, weight, 1e-6)
    dx, dresidual, dweight = RMS_KERNEL._backward_op(
        "triton", torch.randn(3, 8), torch.randn(3, 8), x, residual, weight, 1e-6, y, total, rstd
    )
    assert torch.equal(dx, dresidual) and dx.untyped_storage().data_ptr() != dresidual.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- dispatch and errors


def test_empty_batch():
    x = torch.randn(0, 3, 200, requires_grad=True)
    residual = torch.randn(0, 3, 200, requires_grad=True)
    weight = torch.randn(200, requires_grad=True)
    y, total = add_rms_norm(x, residual, weight, backend="triton")
    assert y.shape == total.shape == x.shape
    grads = torch.autograd.grad((y, total), [x, residual, weight], (torch.randn_like(y), torch.randn_like(total)))
    assert grads[0].shape == x.shape and torch.equal(grads[2], torch.zeros(200))


@pytest.mark.parametrize("op", list(OPS))
def test_errors_name_the_argument(op):
    fn = OPS[op]
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"residual: expected the shape of x \(4, 8\), got \(4, 9\)"):
        fn(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match=r"residual: expected the shape of x \(4, 8\), got \(8,\)"):
        fn(x, torch.randn(8))
    with pytest.raises(TypeError, match=r"residual: expected the dtype of x \(torch.float32\), got torch.bfloat16"):
        fn(x, torch.randn(4, 8, dtype=bf16))
    with pytest.raises(TypeError, match="residual: expected a torch.Tensor, got list"):
        fn(x, [1.0] * 8)
    with pytest.raises(TypeError, match="residual: expected a floating-point tensor"):
        fn(x, torch.ones(4, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        fn(torch.ones(4, 8, dtype=torch.int64), torch.ones(4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="eps: expected a finite float >= 0, got -1"):
        fn(x, x, eps=-1.0)
    with pytest.raises(ValueError, match="eps: expected a finite float >= 0, got nan"):
        fn(x, x, eps=float("nan"))
    with pytest.raises(TypeError, match="eps: expected a float >= 0, got str"):
        fn(x, x, eps="1e-6")
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\)"):
        fn(x, x, torch.ones(9))
    with pytest.raises(ValueError, match="x: the last dimension .* is empty"):
        fn(torch.randn(4, 0), torch.randn(4, 0))


def test_layer_bias_shape_error():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"bias: expected shape \(8,\)"):
        add_layer_norm(x, x, None, torch.ones(3))


def test_unsupported_dtype_falls_back_or_raises():
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.warns(
        acc.BackendFallbackWarning, match="add_norm: the triton backend cannot run these inputs: x has dtype float64"
    ):
        y, total = add_rms_norm(x, x, backend="triton")
    assert y.dtype == torch.float64
    with acc.use_accelerators(fallback="error"):
        with pytest.raises(acc.BackendUnavailableError, match="add_norm: the tilelang backend .*CUDA"):
            add_layer_norm(torch.randn(4, 8), torch.randn(4, 8), backend="tilelang")


def test_config_key_and_explain():
    assert "add_norm" in acc.OP_NAMES
    with acc.use_accelerators(ops={"add_norm": "torch"}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y, _ = add_rms_norm(torch.randn(3, 8), torch.randn(3, 8))
    text = acc.explain(
        "add_norm", x=torch.randn(3, 8, dtype=torch.float64), residual=torch.randn(3, 8), weight=torch.ones(8)
    )
    assert "add_norm: configured 'auto' -> runs torch" in text and "x has dtype float64" in text


def test_benchmark_runner_checks_both_outputs_and_all_gradients():
    from runtime.benchmark.ops import add_norm as cases
    from runtime.benchmark.runner import Machine, measure

    machine = Machine(torch.device("cpu"))
    for case in cases.CASES[:1] + cases.LAYER_CASES[:1]:
        small = dataclasses.replace(case, make_inputs=cases._inputs(37, 200, bias=case.op == "add_layer_norm"))
        for backend in ("torch", "triton"):
            row = measure(small, backend, "backend", lambda i, b=backend, s=small: s.run(b, i), f32, "fwd+bwd", machine)
            assert row["status"] == "ok", row
            expected = {"out0", "out1", "dx", "dresidual", "dweight"} | (
                {"dbias"} if case.op == "add_layer_norm" else set()
            )
            assert set(row["errors"]) == expected


# --------------------------------------------------------------------------- TileLang, compile-only


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [(bf16, 4096, f32, None, False), (f16, 200, f16, f32, True)],
    ids=["rms-4096-bf16-w_f32", "layer-200-f16-w_f16-b_f32"],
)
def test_tilelang_kernels_compile_for_sm90a(args):
    kernels = pytest.importorskip(
        "runtime.accelerators.add_norm.tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
    )
    import tilelang

    from runtime.accelerators.tilelang_common import device_info

    info = device_info(None)
    compiled = {key[0]: tilelang.compile(build(info), target=SM90A) for key, build in kernels.kernel_entries(*args)}
    assert set(compiled) == {"add_norm_fwd", "add_norm_bwd", "column_sum"}
    width = args[1]
    for name in ("add_norm_fwd", "add_norm_bwd"):
        kernel = compiled[name]
        source = kernel.get_kernel_source()
        assert "__global__" in source and "atomic" not in source.lower()
        rows_dim = kernel.params[0].shape[0]
        assert not isinstance(rows_dim, int) and not hasattr(rows_dim, "value"), f"{name}: rows must be dynamic"
        assert int(kernel.params[0].shape[1]) == width
        assert "uint4" in source, f"{name}: expected 16-byte accesses"


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [(bf16, 4096, bf16, bf16, True), (bf16, 4096, bf16, None, False), (bf16, 256, bf16, bf16, True)],
    ids=["layer-4096-bf16", "rms-4096-bf16", "layer-256-bf16"],
)
def test_tilelang_backward_loads_each_row_at_once_and_fills_the_sm(args, tmp_path):
    """The persistent backward launches as many blocks an SM as its registers allow (ptxas's count, no spills), and
    every 16-byte load of a row is issued before the row sums' barriers (dnew too: one round trip to memory a row)."""
    pytest.importorskip("runtime.accelerators.add_norm.tilelang", reason="tilelang 0.1.15 is not installed")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
    import tilelang_resources as resources

    from runtime.accelerators.add_norm import tilelang as kernels
    from runtime.accelerators.tilelang_common import compile_built, device_info

    if resources.nvdisasm_tool() is None:
        pytest.skip("no nvdisasm (on PATH or bundled with Triton)")
    (build,) = [build for key, build in kernels.kernel_entries(*args) if key[0] == "add_norm_bwd"]
    source = compile_built(build(device_info(None)), SM90A).get_kernel_source()
    report, sass = resources.compile_source(source, tmp_path)
    found = resources.profile(report, sass)
    threads, launched = map(int, re.search(r"__launch_bounds__\((\d+), (\d+)\)", source).groups())
    assert found["spill"] == 0, report
    fit = min(4, resources.blocks_per_sm(threads, found["registers"], found["smem"]))
    assert launched == fit, f"{launched} blocks an SM launched, {fit} fit ({found['registers']} registers)"
    addresses = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(\S+)", sass)]
    loads = [a for a, op in addresses if op.startswith("LDG.E.128")]
    barriers = [a for a, op in addresses if op.startswith("BAR.SYNC") and a > loads[0]]
    late = [hex(a) for a in loads if barriers and a > barriers[0]]
    assert not late, f"16-byte loads issued after a barrier of the row sums: {late}"


# --------------------------------------------------------------------------- nn modules


def test_modules_match_torch_norms_and_their_state_dicts():
    from runtime.nn import AddLayerNorm, AddRMSNorm

    x, residual = torch.randn(5, 8), torch.randn(5, 8)
    rms, layer = AddRMSNorm(8, dtype=torch.float64), AddLayerNorm(8, device="cpu")
    assert rms.weight.dtype == torch.float64 and layer.weight.device.type == "cpu"
    assert rms.state_dict().keys() == torch.nn.RMSNorm(8).state_dict().keys()
    assert layer.state_dict().keys() == torch.nn.LayerNorm(8).state_dict().keys()
    reference = torch.nn.LayerNorm(8)
    with torch.no_grad():
        reference.weight.uniform_()
        reference.bias.uniform_()
    layer.load_state_dict(reference.state_dict())
    with acc.use_accelerators(ops={"add_norm": "triton"}, fallback="error"):
        y, total = layer(x, residual)
        torch.testing.assert_close(y, reference(x + residual))
        torch.testing.assert_close(total, x + residual)
        y, _ = AddRMSNorm(8)(x, residual)
        torch.testing.assert_close(y, torch.nn.RMSNorm(8, eps=1e-6)(x + residual))
    assert AddLayerNorm(8, elementwise_affine=False).state_dict() == {}
    assert list(AddLayerNorm(8, bias=False).state_dict()) == ["weight"]


@requires_nvcc
@requires_gxx
@pytest.mark.slow
@pytest.mark.parametrize("width, centre", [(64, False), (200, True)], ids=["rms-64", "layer-200"])
def test_tilelang_forward_normalises_rows_near_1e30_on_the_cpu(width, centre):
    """The TileLang forward's generated CUDA run on the CPU (tools/tilelang_on_cpu.py) on fp32 rows whose squares pass
    fp32's range, between ordinary rows: each row normalised as float64 does, as in the plain norms."""
    torch.manual_seed(0)
    assert tilelang_on_cpu().add_norm_huge_row_problems(width, centre) == []
