"""The TileLang row-norm kernels on CUDA, through the public API with backend="tilelang":
outputs and every gradient vs float64 (kernel outputs poisoned with NaN by conftest).

Every op x dtype x width, each with one parameter variant (they rotate so that every variant
meets every dtype), several row counts per compiled kernel (one kernel serves them all),
including one past a full wave of the persistent backward. All kernels are compiled up front,
in parallel.
"""

import importlib

import pytest
import torch

from norm_reference import DEFAULT_EPS, reference64
from runtime.accelerators import l2norm, layer_norm, rms_norm, use_accelerators
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = {"f32": f32, "bf16": bf16, "f16": f16}
WIDTHS = (48, 200, 1000, 4095, 8192)
OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm, "l2norm": l2norm}
# parameter variants as (weight, bias); "x" takes x's dtype, "f32" is mixed precision when x is not fp32
VARIANTS = {
    "rms_norm": [("x", None), ("f32", None), (None, None)],
    "layer_norm": [("x", "x"), ("f32", "f32"), (None, None), ("x", None), (None, "f32")],
    "l2norm": [(None, None)],
}
# extra cases: (op, shape, dtype, weight dtype, bias dtype)
EXTRA = [
    ("rms_norm", (4, 63, 200), bf16, f32, None),
    ("layer_norm", (4, 63, 200), bf16, f32, bf16),  # weight and bias of different dtypes
    ("l2norm", (4, 63, 200), bf16, None, None),
]


def kernels(op):
    return importlib.import_module(f"runtime.accelerators.{op}.tilelang")


def common():
    return importlib.import_module("runtime.accelerators.tilelang_common")


def variant(op, dtype_name, width):
    weight, bias = VARIANTS[op][(WIDTHS.index(width) + list(DTYPES).index(dtype_name)) % len(VARIANTS[op])]
    resolve = {None: None, "x": DTYPES[dtype_name], "f32": f32}
    return resolve[weight], resolve[bias]


def device():
    return torch.device("cuda", torch.cuda.current_device())


def entries(op, dtype, width, weight_dtype, bias_dtype):
    if op == "rms_norm":
        return kernels(op).kernel_entries(dtype, width, weight_dtype, device())
    if op == "layer_norm":
        return kernels(op).kernel_entries(dtype, width, weight_dtype, bias_dtype, device())
    return kernels(op).kernel_entries(dtype, width)


@pytest.fixture(scope="module", autouse=True)
def _precompiled():
    """Compile every kernel the module needs in parallel, once."""
    if not torch.cuda.is_available():
        return
    wanted = []
    for op in OPS:
        for name, dtype in DTYPES.items():
            for width in WIDTHS:
                wanted += entries(op, dtype, width, *variant(op, name, width))
    for op, shape, dtype, weight_dtype, bias_dtype in EXTRA:
        wanted += entries(op, dtype, shape[-1], weight_dtype, bias_dtype)
    common().precompile(wanted, device())


@pytest.fixture(autouse=True)
def _no_fallback():
    """A tilelang backend that cannot run must fail the test, not quietly run the torch reference."""
    with use_accelerators(fallback="error"):
        yield


def call(op, x, params, eps=None):
    eps = DEFAULT_EPS[op] if eps is None else eps
    if op == "l2norm":
        return l2norm(x, eps, backend="tilelang")
    return OPS[op](x, **params, eps=eps, backend="tilelang")


def check_op(op, x, weight_dtype=None, bias_dtype=None, eps=None, scale=1.0):
    """x: any CUDA tensor (strided views allowed); compares y and every gradient with float64."""
    x = x.detach().requires_grad_()
    width, dtype = x.shape[-1], x.dtype
    params = {}
    if weight_dtype is not None:
        params["weight"] = (1 + 0.5 * torch.randn(width, device="cuda")).to(weight_dtype).requires_grad_()
    if bias_dtype is not None:
        params["bias"] = torch.randn(width, device="cuda").to(bias_dtype).requires_grad_()
    y = call(op, x, params, eps)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *params.values()], dy)

    x64 = x.detach().double().requires_grad_()
    params64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    y64 = reference64(op, x64, **params64, eps=eps)
    grads64 = torch.autograd.grad(y64, [x64, *params64.values()], dy.double())

    tag = f"{op} {tuple(x.shape)} {dtype} w={weight_dtype} b={bias_dtype}"
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(f"{tag} y", y, y64, RTOL[dtype])
    for name, tensor, grad, grad64 in zip(["x", *params], [x, *params.values()], grads, grads64):
        assert grad.dtype == tensor.dtype and grad.shape == tensor.shape
        assert_close(f"{tag} d{name}", grad, grad64, gradient_tolerance(tensor.dtype))


def rows_past_one_wave(op, dtype, width):
    """More row groups than the persistent backward has blocks: some blocks loop twice."""
    if op == "l2norm":  # not persistent: one block per row group
        return 3000
    plan, _, n_blocks = kernels(op).persistent_grid(dtype, width, common().info_for(device()).sm_count)
    return n_blocks * plan.block_rows + 37


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(OPS))
def test_norm_tilelang(op, dtype, width):
    weight_dtype, bias_dtype = variant(op, dtype, width)
    for rows in (1, 37, rows_past_one_wave(op, DTYPES[dtype], width)):
        x = torch.randn(rows, width, dtype=DTYPES[dtype], device="cuda")
        check_op(op, x, weight_dtype, bias_dtype)


@pytest.mark.parametrize("case", range(len(EXTRA)), ids=[c[0] for c in EXTRA])
def test_norm_tilelang_leading_dims_and_strided_inputs(case):
    op, shape, dtype, weight_dtype, bias_dtype = EXTRA[case]
    check_op(op, torch.randn(shape, dtype=dtype, device="cuda"), weight_dtype, bias_dtype)
    # rows padded in memory (a column slice), and a start 2 bytes off the 16-byte alignment
    wide = torch.randn(*shape[:-1], shape[-1] + 8, dtype=dtype, device="cuda")
    check_op(op, wide[..., : shape[-1]], weight_dtype, bias_dtype)
    flat = torch.randn(1 + shape[0] * shape[1] * shape[2], dtype=dtype, device="cuda")
    check_op(op, flat[1:].view(shape), weight_dtype, bias_dtype)
    # a gradient that reaches backward as an expanded tensor (stride 0 over the rows)
    x = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
    c = torch.randn(shape[-1], device="cuda", dtype=torch.float64)
    (call(op, x, {}).sum((0, 1)).double() * c).sum().backward()
    x64 = x.detach().double().requires_grad_()
    (reference64(op, x64).sum((0, 1)) * c).sum().backward()
    assert_close(f"{op} dx for an expanded dy", x.grad, x64.grad, gradient_tolerance(dtype))


@pytest.mark.parametrize("op", list(OPS))
def test_eps_is_a_kernel_argument(op, monkeypatch):
    """Another eps is honoured and compiles nothing new (nor does another row count)."""
    weight_dtype, bias_dtype = (f32, f32) if op == "layer_norm" else ((f32, None) if op == "rms_norm" else (None, None))
    x = 0.05 * torch.randn(37, 200, dtype=bf16, device="cuda")  # small rows: eps matters
    check_op(op, x, weight_dtype, bias_dtype)
    tc = common()

    def no_compile(*args, **kwargs):
        raise AssertionError("a kernel was compiled again for another eps or row count")

    monkeypatch.setattr(tc.tilelang, "compile", no_compile)
    check_op(op, x, weight_dtype, bias_dtype, eps=0.1)
    check_op(op, 0.05 * torch.randn(3, 5, 200, dtype=bf16, device="cuda"), weight_dtype, bias_dtype, eps=0.1)


@pytest.mark.parametrize("op", list(OPS))
def test_empty_batch(op):
    """Through the API and straight through the kernel module (what torch.compile's custom op calls)."""
    params = {"rms_norm": {"weight": torch.ones(48, device="cuda", requires_grad=True)}, "l2norm": {}}
    params["layer_norm"] = {**params["rms_norm"], "bias": torch.zeros(48, device="cuda", requires_grad=True)}
    for shape in [(0, 48), (2, 0, 48)]:
        x = torch.randn(shape, device="cuda", requires_grad=True)
        y = call(op, x, params[op])
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape
        for p in params[op].values():
            assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))
            p.grad = None

    x = torch.randn(0, 48, device="cuda")
    module = kernels(op)
    args = list(params[op].values())
    results = module.forward(x, *args, DEFAULT_EPS[op])
    assert results[0].shape == (0, 48) and all(r.shape == (0,) for r in results[1:])
    grads = module.backward(torch.randn(0, 48, device="cuda"), x, *args, DEFAULT_EPS[op], *results)
    assert grads[0].shape == (0, 48)
    for p, g in zip(args, grads[1:]):
        assert torch.equal(g, torch.zeros_like(p))
