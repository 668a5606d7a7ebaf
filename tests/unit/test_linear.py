"""linear on the CPU: the reference against float64 textbook math (every activation, bias or not, odd row counts), the
Triton kernels under TRITON_INTERPRET=1 forward and backward (every gradient), the TileLang kernels compiled for
sm_90a, autocast, dispatch, fallback reasons and errors, and the runtime.nn.Linear module."""

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import SM90A, requires_gxx, requires_nvcc, tilelang_on_cpu
from runtime.accelerators import explain, linear
from runtime.accelerators.backends import BackendFallbackWarning, BackendUnavailableError
from runtime.accelerators.config import use_accelerators
from runtime.accelerators.linear.launch import GemmConfig
from runtime.accelerators.linear.reference import ACTIVATIONS, SAVES_PREACT, linear_reference
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


def textbook_activation(z: torch.Tensor, activation) -> torch.Tensor:
    """Float64 formulas written out (not torch's activation functions)."""
    if activation is None:
        return z
    if activation == "relu":
        return torch.where(z > 0, z, torch.zeros_like(z))
    if activation == "gelu":
        return 0.5 * z * (1 + torch.special.erf(z / math.sqrt(2)))
    if activation == "gelu_tanh":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    if activation == "silu":
        return z / (1 + torch.exp(-z))
    gate, up = z.chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


def textbook(x, weight, bias, activation):
    """act(x @ w^T + b) in float64 (differentiable, for the reference gradients)."""
    z = x.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    return textbook_activation(z, activation)


def make_inputs(m, k, n, dtype, activation, with_bias=True, lead=()):
    rows = 2 * n if activation == "swiglu" else n
    x = torch.randn(*lead, m, k).to(dtype)
    weight = (torch.randn(rows, k) / math.sqrt(k)).to(dtype)
    bias = torch.randn(rows).to(dtype) if with_bias else None
    return x, weight, bias


def check(backend, x, weight, bias, activation, rtol=None, triton_backward=None):
    """Output and every gradient (x, weight, bias) against float64 textbook math. triton_backward: a
    linear.launch.BackwardLaunch, with which the Triton module's functions run instead of the op."""
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    if triton_backward is None:
        y = linear(*leaves, activation, backend=backend)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, [t for t in leaves if t is not None], dy)
    else:
        from runtime.accelerators.linear import triton as linear_triton

        args = *[None if t is None else t.detach() for t in leaves], activation
        y, z = linear_triton.forward(*args)
        dy = torch.randn_like(y)
        grads = [g for g in linear_triton.backward(dy, *args, y, z, launch=triton_backward) if g is not None]
    ref_leaves = [t.detach().double().requires_grad_() if t is not None else None for t in leaves]
    ref = textbook(*ref_leaves, activation)
    ref_grads = torch.autograd.grad(ref, [t for t in ref_leaves if t is not None], dy.double())
    rtol = rtol if rtol is not None else RTOL[x.dtype]
    tag = f"{backend} {activation} {tuple(x.shape)}x{tuple(weight.shape)} {x.dtype} bias={bias is not None}"
    assert y.dtype == x.dtype
    assert_close(f"{tag} y", y, ref, rtol)
    for name, g, r in zip(("dx", "dweight", "dbias"), grads, ref_grads):
        assert g.dtype == x.dtype
        assert_close(f"{tag} {name}", g, r, gradient_tolerance(x.dtype, rtol))


# --------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_reference_matches_textbook_math(activation, m, with_bias):
    check("torch", *make_inputs(m, 24, 40, f32, activation, with_bias), activation)


@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "f16"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_reference_in_half_precision(dtype, activation):
    check("torch", *make_inputs(37, 64, 64, dtype, activation), activation)


def test_reference_keeps_float64():
    x, w, b = make_inputs(5, 8, 8, f64, "gelu_tanh")
    out = linear_reference(x, w, b, "gelu_tanh")
    assert out.dtype == f64
    torch.testing.assert_close(out, textbook(x, w, b, "gelu_tanh"), rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------- Triton under the interpreter


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_triton_interpreter_forward_backward(activation, n, with_bias):
    check("triton", *make_inputs(37, 64, n, f16, activation, with_bias), activation)


@pytest.mark.parametrize("activation", ["silu", "swiglu"])
def test_triton_interpreter_one_row_leading_dims_and_partial_k(activation):
    check("triton", *make_inputs(1, 64, 64, f16, activation), activation)
    # K = 40: a partial K block (masked loads); rows from leading dims (2 x 3 x 5 = 30)
    check("triton", *make_inputs(5, 40, 24, f16, activation, lead=(2, 3)), activation)


def test_triton_interpreter_no_grad_matches_forward():
    x, w, b = make_inputs(37, 64, 64, f16, "gelu")
    with torch.no_grad():
        inferred = linear(x, w, b, "gelu", backend="triton")
    trained = linear(x, w.requires_grad_(), b, "gelu", backend="triton")
    assert torch.equal(inferred, trained.detach())


def test_triton_interpreter_strided_input():
    x, w, b = make_inputs(37, 64, 64, f16, "relu")
    check("triton", x.t().contiguous().t(), w, b, "relu")  # column-major x
    check("triton", torch.randn(64, 37).to(f16).t(), w, b, "relu")


def test_triton_backward_dbias_partials_over_several_row_groups():
    from runtime.accelerators.linear.launch import BackwardLaunch

    two_groups = BackwardLaunch(row_groups=2)  # 100 rows in 2 groups of 2 steps of 32 or 64 rows
    check("triton", *make_inputs(100, 32, 48, f16, "gelu"), "gelu", triton_backward=two_groups)
    check("triton", *make_inputs(100, 32, 48, f16, "swiglu"), "swiglu", triton_backward=two_groups)


SMALL_PERSISTENT = GemmConfig(32, 16, 16, 4, 2, 2)  # tiles small enough for several per program on the CPU


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(
    "flatten, subtile", [(True, False), (False, False), (True, True)], ids=["flat", "nested", "subtiled"]
)
def test_triton_interpreter_persistent_forward(activation, with_bias, flatten, subtile):
    """The Hopper kernel forced on (the interpreter runs its descriptors): 37 rows (a ragged row tile), N = 40 (a
    ragged column tile), K = 40 (a partial K block), 6 tiles over the interpreter's 3 programs; y against float64,
    the saved pre-activation equal to the portable kernel's, infer's y equal to forward's."""
    from runtime.accelerators.linear import triton as linear_triton
    from runtime.accelerators.linear import triton_persistent

    x, weight, bias = make_inputs(37, 40, 40, f16, activation, with_bias)
    columns = 40
    y = torch.full((37, columns), float("nan"), dtype=f16)
    z = torch.full((37, weight.shape[0]), float("nan"), dtype=f16)
    saved = activation in SAVES_PREACT
    z = z if saved else torch.empty(0, dtype=f16)
    triton_persistent.launch(
        x, weight, bias, y, z, activation, saved, SMALL_PERSISTENT._replace(subtile=subtile), flatten
    )
    assert_close(f"persistent {activation} y", y, textbook(x, weight, bias, activation), RTOL[f16])
    portable_y, portable_z = linear_triton.forward(x, weight, bias, activation, persistent=False)
    if saved:
        assert torch.allclose(z, portable_z, rtol=1e-3, atol=1e-3), (z - portable_z).abs().max()
    inferred = linear_triton.infer(x, weight, bias, activation, persistent=True, cfg=SMALL_PERSISTENT)
    assert torch.equal(inferred, y)


def test_triton_interpreter_persistent_forward_through_the_forward_launcher():
    """forward(persistent=True) with the variant's own table (one 128-row tile) and the backward on its z."""
    from runtime.accelerators.linear import triton as linear_triton

    x, weight, bias = make_inputs(37, 64, 24, f16, "swiglu")
    y, z = linear_triton.forward(x, weight, bias, "swiglu", persistent=True)
    portable_y, portable_z = linear_triton.forward(x, weight, bias, "swiglu", persistent=False)
    assert torch.allclose(y, portable_y, rtol=1e-3, atol=1e-3) and torch.allclose(z, portable_z, rtol=1e-3, atol=1e-3)


def test_the_persistent_variant_is_for_compiled_hopper_launches_only():
    from runtime.accelerators.linear import triton_persistent
    from runtime.accelerators.linear.launch import persistent_flattens, persistent_forward_config, persistent_pays

    x, weight, _ = make_inputs(37, 64, 64, f16, "gelu")
    assert not triton_persistent.hopper_ready(x, weight)  # the CPU, under the interpreter
    assert persistent_forward_config(131072, 1024, 256) == GemmConfig(128, 128, 64, 8, 3, 8, True, 2, 128)
    assert persistent_forward_config(4096, 512, 256, swiglu=True).block_n == 64
    assert persistent_forward_config(37, 24, 40).block_n == 32
    assert persistent_pays(131072, 1024, 256, False, 132)  # 8192 tiles
    assert persistent_pays(4096, 1024, 256, False, 132)  # 256 tiles: at least one wave
    assert not persistent_pays(1, 4096, 4096, False, 132)  # 32 tiles: fewer than the SMs
    assert not persistent_pays(131072, 1024, 256, False, 0)  # no SMs: the CPU
    assert not persistent_pays(131072, 512, 128, True, 132)  # swiglu below K = 256: the portable kernel
    assert persistent_pays(131072, 1024, 256, True, 132)
    assert persistent_flattens(256, True) and persistent_flattens(512, False) and not persistent_flattens(512, True)


def test_fp32_weights_under_autocast_behave_as_nn_linear():
    x = torch.randn(37, 64)
    module = torch.nn.Linear(64, 64)
    with torch.autocast("cpu", dtype=f16):
        ours = linear(x, module.weight, module.bias, backend="triton")
        theirs = module(x)
    assert ours.dtype == theirs.dtype == f16
    torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3)
    (dw,) = torch.autograd.grad(ours.float().square().sum(), [module.weight])
    assert dw.dtype == f32


def test_float64_inputs_stay_float64_under_autocast_as_in_f_linear():
    x, weight, bias = torch.randn(5, 16, dtype=f64), torch.randn(8, 16, dtype=f64), torch.randn(8, dtype=f64)
    with torch.autocast("cpu", dtype=bf16):
        ours = linear(x, weight, bias, "gelu", backend="torch")
        theirs = F.gelu(F.linear(x, weight, bias))
    assert ours.dtype == theirs.dtype == f64
    torch.testing.assert_close(ours, theirs)


def test_empty_inputs():
    x = torch.randn(0, 16, dtype=f16, requires_grad=True)
    y = linear(x, torch.randn(8, 16, dtype=f16), None, "silu", backend="triton")
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 16)


# --------------------------------------------------------------------------- TileLang, compile-only


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize(
    "direction, args",
    [
        ("forward", (bf16, 256, 128, "gelu", True, True)),
        ("forward", (f16, 200, 64, "swiglu", True, True)),
        ("forward", (bf16, 64, 64, None, False, False)),
        ("backward", (bf16, 200, "swiglu", True)),
        ("backward", (f16, 256, "gelu_tanh", True)),
        ("backward", (bf16, 64, "relu", False)),
    ],
    ids=["fwd-gelu-bias", "fwd-swiglu-f200", "fwd-plain", "bwd-swiglu", "bwd-gelu_tanh", "bwd-relu"],
)
def test_tilelang_kernels_compile_for_sm90a(direction, args):
    import tilelang

    from runtime.accelerators.linear import tilelang as kernels
    from runtime.accelerators.tilelang_common import device_info

    key, build = getattr(kernels, f"{direction}_entry")(*args)
    kernel = tilelang.compile(build(device_info(None)), target=SM90A)
    source = kernel.get_kernel_source()
    m = kernel.params[0].shape[0]
    assert not isinstance(m, int) and not hasattr(m, "value"), f"the row count must be dynamic, got {m}"
    if direction == "forward":
        assert "wgmma" in source, "the forward GEMM must use Hopper's wgmma"
        assert len(re.findall(r"wgmma_ss<", source)) == (2 if args[3] == "swiglu" else 1)
    else:
        assert "atomic" not in source.lower(), "dbias must go through partial sums, not atomics"


def _tilelang_resources():
    """tools/tilelang_resources.py (SASS profiles of TileLang kernels), imported from the repository."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
    import tilelang_resources

    return tilelang_resources


@requires_nvcc
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_tilelang_backward_binds_its_row_steps_once(activation, tmp_path):
    """The elementwise backward's steps per row group divide by the dynamic group count: bound once, not recomputed
    (a 64-bit division call each time: 12 in the GELU pass's SASS, 40 in the ReLU one's)."""
    import tilelang

    from runtime.accelerators.linear import tilelang as kernels
    from runtime.accelerators.tilelang_common import device_info

    resources = _tilelang_resources()

    if resources.nvdisasm_tool() is None:
        pytest.skip("no nvdisasm (on PATH or bundled with Triton)")
    key, build = kernels.backward_entry(bf16, 1024, activation, True)
    source = tilelang.compile(build(device_info(None)), target=SM90A).get_kernel_source()
    report, sass = resources.compile_source(source, tmp_path)
    assert "div_s64" not in sass and resources.profile(report, sass)["calls"] == 0


@requires_nvcc
@pytest.mark.slow
def test_tilelang_forward_for_two_blocks_an_sm(tmp_path):
    """blocks_per_sm=2: 128 x 128 tiles, launch bounds for two blocks of 384 threads (80 registers a thread), the
    consumer warpgroups raised only to what the producer gives back (104), and no spills at that budget."""
    import tilelang

    from runtime.accelerators.linear import tilelang as kernels
    from runtime.accelerators.tilelang_common import device_info

    resources = _tilelang_resources()
    assert kernels.forward_tiles(1024, 256, False, blocks_per_sm=2)[:2] == (128, 128)
    key, build = kernels.forward_entry(bf16, 1024, 256, "gelu", True, True, blocks_per_sm=2)
    source = tilelang.compile(build(device_info(None)), target=SM90A).get_kernel_source()
    assert "__launch_bounds__(384, 2)" in source
    assert "warpgroup_reg_dealloc<24>" in source and "warpgroup_reg_alloc<104>" in source
    report, sass = resources.compile_source(source, tmp_path)
    found = resources.profile(report, sass)
    assert found["registers"] <= 80 and found["spill"] == 0


def _loop_body(source: str, header: str) -> str:
    """The body of the first C loop whose header starts with `header`, braces matched."""
    start = source.index("{", source.index(header))
    depth = 0
    for end in range(start, len(source)):
        depth += {"{": 1, "}": -1}.get(source[end], 0)
        if depth == 0:
            return source[start : end + 1]
    raise AssertionError(f"unbalanced braces after {header!r}")


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_tilelang_backward_folds_the_dbias_sums_after_the_row_walk(activation, tmp_path):
    """The dbias partial sums accumulate per thread over the row tiles and fold across threads once, after the
    walk: a fold per tile put shared memory and barriers between every tile's loads and the next's."""
    import tilelang

    from runtime.accelerators.linear import tilelang as kernels
    from runtime.accelerators.tilelang_common import device_info

    resources = _tilelang_resources()

    key, build = kernels.backward_entry(bf16, 1024, activation, True)
    source = tilelang.compile(build(device_info(None)), target=SM90A).get_kernel_source()
    walk = _loop_body(source, "for (int step = 0;")
    assert "AllReduce" not in walk and "__syncthreads" not in walk
    assert source.count("AllReduce") == (2 if activation == "swiglu" else 1)
    if activation == "gelu" and resources.nvdisasm_tool() is not None:  # the tile layout keeps 16-byte loads
        report, sass = resources.compile_source(source, tmp_path)
        assert resources.profile(report, sass)["ldg_narrow"] == 0


@requires_nvcc
@requires_gxx
@pytest.mark.slow
@pytest.mark.parametrize("activation, m, n", [("gelu", 300, 16), ("swiglu", 300, 24), ("relu", 70, 200)])
def test_tilelang_backward_pass_runs_on_the_cpu_and_matches_float64(activation, m, n):
    """The elementwise kernel's generated CUDA run on the CPU (tools/tilelang_on_cpu.py): d_preact and the dbias
    partials against float64 (programs of several row steps, with rows past the end, on the GPU tier: more row
    tiles than groups takes more than 256 programs of 128 threads, each a thread here)."""
    torch.manual_seed(0)
    assert tilelang_on_cpu().linear_backward_problems(m, n, activation) == []


@requires_gxx
def test_tilelang_activations_match_float64():
    """The activations of the TileLang kernels' CUDA prelude (gelu from the rational erfc, its derivative, sigmoid)
    compiled for the CPU, in fp32 against float64 (tools/tilelang_on_cpu.py states the bounds)."""
    pytest.importorskip("tilelang")
    assert tilelang_on_cpu().linear_activation_problems() == []


# --------------------------------------------------------------------------- dispatch, reasons and errors


def test_tilelang_on_cpu_falls_back_with_a_warning():
    x, w, b = make_inputs(4, 16, 16, f16, "relu")
    with pytest.warns(BackendFallbackWarning, match="linear: the tilelang backend cannot run.*CUDA"):
        y = linear(x, w, b, "relu", backend="tilelang")
    torch.testing.assert_close(y, linear_reference(x, w, b, "relu"))


@pytest.mark.parametrize(
    "k, n, activation, match",
    [
        (12, 16, None, "K = 12 \\(the last size of x\\) is not a multiple of 8"),
        (16, 12, "gelu", "N = 12 \\(the weight's rows\\) is not a multiple of 8"),
        (16, 12, "swiglu", "F = 12 \\(half the weight's rows, swiglu\\) is not a multiple of 8"),
    ],
    ids=["k", "n", "swiglu-f"],
)
def test_sizes_not_multiples_of_8_fall_back_or_raise(k, n, activation, match):
    x, w, b = make_inputs(5, k, n, f16, activation)
    with pytest.warns(BackendFallbackWarning, match=match):
        y = linear(x, w, b, activation, backend="triton")
    torch.testing.assert_close(y, linear_reference(x, w, b, activation))
    with use_accelerators(fallback="error"), pytest.raises(BackendUnavailableError, match=f"linear.*triton.*{match}"):
        linear(x, w, b, activation, backend="triton")


def test_float32_and_cpu_bfloat16_are_reasons():
    x, w, b = make_inputs(5, 16, 16, f32, "gelu")
    with pytest.warns(
        BackendFallbackWarning, match="x has dtype float32; the triton kernels .* take bfloat16 and float16"
    ):
        linear(x, w, b, "gelu", backend="triton")
    x, w, b = make_inputs(5, 16, 16, bf16, "gelu")
    with pytest.warns(BackendFallbackWarning, match="bfloat16 on the CPU"):
        linear(x, w, b, "gelu", backend="triton")


def test_auto_picks_triton_under_the_interpreter():
    x, w, b = make_inputs(5, 16, 16, f16, "silu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = linear(x, w, b, "silu", backend="auto")
    torch.testing.assert_close(y, linear_reference(x, w, b, "silu"), rtol=2e-3, atol=2e-3)


def test_explain_lists_the_input_reasons():
    x, w, _ = make_inputs(5, 12, 16, f32, None)
    report = explain("linear", x=x, weight=w)
    assert "linear: configured 'auto'" in report
    assert "x has dtype float32" in report and "K = 12" in report


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.randn(3, 8), torch.randn(4, 6)), ValueError, r"weight: expected shape \(N, 8\)"),
        ((torch.randn(3, 8), torch.randn(8)), ValueError, r"weight: expected shape \(N, 8\).*got \(8,\)"),
        ((torch.randn(3, 8), torch.randn(4, 8), torch.randn(5)), ValueError, r"bias: expected shape \(4,\)"),
        ((torch.randn(3, 8), torch.randn(4, 8, dtype=f16)), TypeError, "weight: expected dtype float32 like x"),
        ((torch.randn(3, 8), torch.randn(4, 8), torch.randn(4, dtype=f16)), TypeError, "bias: expected dtype float32"),
        ((torch.randn(3, 8), torch.randn(4, 8), None, "tanh"), ValueError, "activation: expected one of None, 'relu'"),
        (
            (torch.randn(3, 8), torch.randn(5, 8), None, "swiglu"),
            ValueError,
            "weight: swiglu needs an even number of rows",
        ),
        ((torch.randn(3, 8), torch.randn(4, 8, device="meta")), ValueError, "weight: expected a tensor on cpu like x"),
        (([1.0], torch.randn(4, 8)), TypeError, "x: expected a torch.Tensor, got list"),
        ((torch.ones(3, 8, dtype=torch.int64), torch.randn(4, 8)), TypeError, "x: expected a floating-point tensor"),
    ],
    ids=[
        "k-mismatch",
        "weight-1d",
        "bias-shape",
        "weight-dtype",
        "bias-dtype",
        "activation",
        "swiglu-odd",
        "device",
        "x-list",
        "x-int",
    ],
)
def test_errors_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        linear(*args)


# --------------------------------------------------------------------------- runtime.nn.Linear


@pytest.mark.parametrize("activation", [None, "gelu", "swiglu"], ids=str)
def test_module_loads_an_nn_linear_state_dict(activation):
    from runtime.nn import Linear

    out = 16 if activation == "swiglu" else 32
    ours = Linear(24, out, activation=activation, backend="torch")
    theirs = torch.nn.Linear(24, 2 * out if activation == "swiglu" else out)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 24)
    y = ours(x)
    assert y.shape == (2, 5, out)
    torch.testing.assert_close(y, linear_reference(x, theirs.weight, theirs.bias, activation))
    assert "activation=" in repr(ours)


def test_module_without_bias_and_on_triton():
    from runtime.nn import Linear

    module = Linear(64, 64, bias=False, activation="silu", dtype=f16, backend="triton")
    assert module.bias is None and module.weight.dtype == f16
    x = torch.randn(37, 64, dtype=f16)
    torch.testing.assert_close(module(x), F.silu(F.linear(x, module.weight)), rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="activation: expected one of"):
        Linear(8, 8, activation="elu")


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_compiled_full_graph_matches_eager(activation):
    """The custom ops (fake shapes, the saved pre-activation, the optional bias and activation in the schema)."""
    x, w, b = make_inputs(37, 64, 64, f16, activation)
    leaves = [t.requires_grad_() for t in (x, w, b)]

    def fn(x, w, b):
        return linear(x, w, b, activation, backend="triton")

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    y_c = compiled(*leaves)
    grads_c = torch.autograd.grad(y_c.float().square().sum(), leaves)
    y_e = fn(*leaves)
    grads_e = torch.autograd.grad(y_e.float().square().sum(), leaves)
    torch.testing.assert_close(y_c, y_e)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e)
