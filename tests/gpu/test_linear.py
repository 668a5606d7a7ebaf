"""linear on CUDA: both kernel backends against float64, the output and every gradient (x, weight, bias), kernel
outputs poisoned with NaN by conftest. Rows 1, 37, 4096 and 65536; (K, N) in (64, 256), (256, 1024), (1024, 4096),
(4096, 4096); every activation, bias or not, both dtypes (not the full product); fp32 parameters under autocast,
strided and batched inputs, torch.compile; the Hopper persistent TMA forward forced on (every activation, ragged
rows and tiles, flattened and nested tile loops) and taken by the op at the benchmark shape."""

import math

import pytest
import torch

from runtime.accelerators.linear import linear
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
BACKENDS = ("triton", "tilelang")

# (dtype, M, K, N = the weight's rows, activation, bias)
CASES = [
    (bf16, 1, 64, 256, None, True),
    (f16, 37, 64, 256, "relu", True),
    (bf16, 37, 256, 1024, "gelu", False),
    (bf16, 4096, 256, 1024, "gelu_tanh", True),
    (f16, 4096, 1024, 4096, "silu", True),
    (bf16, 65536, 64, 256, "swiglu", True),
    (f16, 37, 256, 1024, "swiglu", False),
    (bf16, 4096, 4096, 4096, "swiglu", True),
    (f16, 65536, 1024, 4096, "gelu", True),
    (bf16, 1, 4096, 4096, "relu", False),
    (bf16, 65536, 4096, 4096, "silu", True),
    (f16, 4096, 64, 256, None, False),
    # sizes off the tiles: K = 40 (a partial K block), N = 200, F = 200 (swiglu's narrowest column blocks)
    (bf16, 1000, 40, 200, "gelu", True),
    # 257 row tiles over 256 groups: programs of two row steps, half of them past the last row
    (bf16, 8200, 64, 256, "gelu", True),
    (f16, 37, 40, 400, "swiglu", True),
]


def _id(case) -> str:
    dtype, m, k, n, activation, bias = case
    return f"{str(dtype)[6:]}-{m}x{k}x{n}-{activation}" + ("-bias" if bias else "")


@pytest.fixture(scope="module", autouse=True)
def _tilelang_kernels_compiled_in_parallel():
    from runtime.accelerators.linear import tilelang as kernels
    from runtime.accelerators.tilelang_common import precompile

    # the cases, then the other tests' kernels: no_grad (not saving), batched/strided, autocast, compile
    others = [(bf16, 0, 256, 1024, "gelu", True, False), (bf16, 0, 256, 1024, "swiglu", True, False),
              (bf16, 0, 256, 512, "gelu_tanh", True, True), (bf16, 0, 256, 512, "swiglu", True, True),
              (bf16, 0, 256, 1024, "silu", True, True), (bf16, 0, 256, 1024, "gelu", True, True)]  # fmt: skip
    entries = {}
    for dtype, _, k, n, activation, bias, save in [(*case, True) for case in CASES] + others:
        columns = n // 2 if activation == "swiglu" else n
        key, build = kernels.forward_entry(dtype, columns, k, activation, bias, save)
        entries[key] = build
        if activation is not None and save:
            key, build = kernels.backward_entry(dtype, columns, activation, bias)
            entries[key] = build
    precompile(list(entries.items()), torch.device("cuda", torch.cuda.current_device()))


def textbook(x, weight, bias, activation):
    z = x.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if activation is None:
        return z
    if activation == "relu":
        return torch.where(z > 0, z, torch.zeros_like(z))
    if activation == "gelu":
        return 0.5 * z * (1 + torch.special.erf(z / math.sqrt(2)))
    if activation == "gelu_tanh":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    if activation == "silu":
        return z * torch.sigmoid(z)
    gate, up = z.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def make_inputs(dtype, m, k, n, bias, lead=()):
    x = torch.randn(*lead, m, k, device="cuda", dtype=dtype)
    weight = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    return x, weight, b


def check(backend, x, weight, bias, activation):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    y = linear(*leaves, activation, backend=backend)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [t for t in leaves if t is not None], dy)
    ref_leaves = [t.detach().double().requires_grad_() if t is not None else None for t in leaves]
    ref = textbook(*ref_leaves, activation)
    ref_grads = torch.autograd.grad(ref, [t for t in ref_leaves if t is not None], dy.double())
    dtype = x.dtype
    tag = f"{backend} {activation} {tuple(x.shape)}x{tuple(weight.shape)} {dtype} bias={bias is not None}"
    assert y.dtype == dtype and y.shape == ref.shape
    assert_close(f"{tag} y", y, ref, RTOL[dtype])
    for name, g, r in zip(("dx", "dweight", "dbias"), grads, ref_grads):
        assert g.dtype == dtype
        assert_close(f"{tag} {name}", g, r, gradient_tolerance(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_forward_backward_against_float64(backend, case):
    dtype, m, k, n, activation, bias = case
    check(backend, *make_inputs(dtype, m, k, n, bias), activation)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_no_grad_forward_matches(backend, activation):
    """The inference launch (no pre-activation saved) against float64."""
    x, w, b = make_inputs(bf16, 4097, 256, 1024, True)
    with torch.no_grad():
        y = linear(x, w, b, activation, backend=backend)
    assert_close(f"{backend} {activation} no_grad", y, textbook(x, w, b, activation), RTOL[bf16])


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_and_strided_inputs(backend):
    x, w, b = make_inputs(bf16, 100, 256, 512, True, lead=(3,))
    check(backend, x, w, b, "gelu_tanh")  # [3, 100, 256]: rows from the leading dims
    strided = torch.randn(256, 300, device="cuda", dtype=bf16).t()  # column-major rows
    check(backend, strided, w, b, "swiglu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_parameters_under_autocast_behave_as_nn_linear(backend):
    module = torch.nn.Linear(256, 1024, device="cuda")
    x = torch.randn(4096, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=bf16):
        ours = linear(x, module.weight, module.bias, "silu", backend=backend)
        theirs = torch.nn.functional.silu(module(x))
    assert ours.dtype == theirs.dtype == bf16
    assert_close(f"{backend} autocast y", ours, theirs, RTOL[bf16])
    dy = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, [x, module.weight, module.bias], dy)
    ref_grads = torch.autograd.grad(theirs, [x, module.weight, module.bias], dy)
    for name, g, r in zip(("dx", "dweight", "dbias"), grads, ref_grads):
        assert g.dtype == f32
        assert_close(f"{backend} autocast {name}", g, r, gradient_tolerance(bf16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_full_graph_matches_eager(backend):
    x, w, b = make_inputs(bf16, 333, 256, 1024, True)
    x = x.t().contiguous().t().requires_grad_()  # non-contiguous

    def fn(x, w, b):
        return linear(x, w, b, "gelu", backend=backend)

    compiled = torch.compile(fn, fullgraph=True)
    y_c = compiled(x, w, b)
    y_e = fn(x, w, b)
    torch.testing.assert_close(y_c, y_e)
    (dx_c,) = torch.autograd.grad(y_c.float().square().sum(), [x])
    (dx_e,) = torch.autograd.grad(y_e.float().square().sum(), [x])
    torch.testing.assert_close(dx_c, dx_e)


# --------------------------------------------------------------------------- the Hopper persistent TMA forward

# (M, K, N = the weight's rows, activation, bias): ragged M (4097, 1000 rows: a part row tile), odd tile counts
# (N = 384: 3 column tiles of 128; 131 x 3 tiles, a partial last wave over 132 SMs), N = 200 (a part column tile),
# K = 40 (a part K block), swiglu with F = 192 (3 column tiles of 64), the benchmark's shape class (K 256, N 1024)
PERSISTENT_CASES = [
    (4097, 256, 1024, "gelu", True),
    (131 * 128, 256, 384, "gelu_tanh", False),
    (1000, 40, 200, "silu", True),
    (4097, 64, 256, "relu", True),
    (4097, 1024, 384, None, False),
    (4097, 256, 384, "swiglu", True),
    (1000, 40, 400, "swiglu", False),
    (65536, 256, 1024, "gelu", False),
]


def _persistent_id(case) -> str:
    m, k, n, activation, bias = case
    return f"{m}x{k}x{n}-{activation}" + ("-bias" if bias else "")


@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=[_persistent_id(c) for c in PERSISTENT_CASES])
def test_persistent_forward_against_float64(dtype, case):
    """The persistent kernel forced on: y and the saved pre-activation against float64, infer equal to forward."""
    from runtime.accelerators.linear import triton as linear_triton
    from runtime.accelerators.linear import triton_persistent

    m, k, n, activation, bias = case
    x, w, b = make_inputs(dtype, m, k, n, bias)
    assert triton_persistent.hopper_ready(x, w)
    y, z = linear_triton.forward(x, w, b, activation, persistent=True)
    tag = f"persistent {dtype} {_persistent_id(case)}"
    assert_close(f"{tag} y", y, textbook(x, w, b, activation), RTOL[dtype])
    if activation in ("gelu", "gelu_tanh", "silu", "swiglu"):
        assert_close(f"{tag} z", z, textbook(x, w, b, None), RTOL[dtype])
    torch.testing.assert_close(linear_triton.infer(x, w, b, activation, persistent=True), y, rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_persistent_forward_nested_tile_loop(activation):
    """The tile loop not flattened into the K loop (the other schedule the benchmark may compare)."""
    from runtime.accelerators.linear import triton as linear_triton
    from runtime.accelerators.linear import triton_persistent
    from runtime.accelerators.linear.launch import persistent_forward_config

    n = 768 if activation == "swiglu" else 384
    x, w, b = make_inputs(bf16, 4097, 256, n, True)
    columns = n // 2 if activation == "swiglu" else n
    y = torch.empty(4097, columns, device="cuda", dtype=bf16)
    z = torch.empty(4097, n, device="cuda", dtype=bf16)
    cfg = persistent_forward_config(4097, columns, 256, activation == "swiglu")
    triton_persistent.launch(x, w, b, y, z, activation, True, cfg, flatten=False)
    assert_close(f"nested {activation} y", y, textbook(x, w, b, activation), RTOL[bf16])
    flat_y, flat_z = linear_triton.forward(x, w, b, activation, persistent=True)
    torch.testing.assert_close(y, flat_y, rtol=0, atol=0)
    torch.testing.assert_close(z, flat_z, rtol=0, atol=0)


def test_the_op_takes_the_persistent_kernel_at_the_benchmark_shape(monkeypatch):
    """linear(...) on an sm_90 GPU at M = 131072, K = 256, N = 1024 launches the persistent kernel (and the portable
    one for a single row), and the result matches float64 either way."""
    from runtime.accelerators.linear import triton_persistent

    launched = []
    real_launch = triton_persistent.launch
    monkeypatch.setattr(
        triton_persistent, "launch", lambda *a, **kw: launched.append(a[0].shape) or real_launch(*a, **kw)
    )
    for m in (131072, 1):
        x, w, b = make_inputs(bf16, m, 256, 1024, True)
        with torch.no_grad():
            y = linear(x, w, b, "gelu", backend="triton")
        assert_close(f"op gelu {m} rows", y, textbook(x, w, b, "gelu"), RTOL[bf16])
    assert launched == [torch.Size([131072, 256])]


# (dtype, M, K, F or N, activation): ragged rows, a partial K block, every epilogue kind
TWO_BLOCKS_CASES = [
    (bf16, 4097, 256, 1024, "gelu"),
    (f16, 1000, 40, 200, "silu"),
    (bf16, 8200, 64, 256, None),
    (bf16, 4096, 512, 1024, "swiglu"),
    (f16, 37, 128, 512, "gelu_tanh"),
]


@pytest.mark.parametrize("case", TWO_BLOCKS_CASES, ids=[_id((*c, True)) for c in TWO_BLOCKS_CASES])
def test_tilelang_two_blocks_an_sm_forward_against_float64(case):
    """The TileLang forward launched for two blocks an SM (smaller tiles, a register split): the result, and the
    saved pre-activation that backward reads, against float64."""
    from runtime.accelerators.linear import tilelang as kernels

    dtype, m, k, n, activation = case
    rows = 2 * n if activation == "swiglu" else n
    x, w, b = make_inputs(dtype, m, k, rows, True)
    y, z = kernels.forward(x, w, b, activation, blocks_per_sm=2)
    assert_close(f"two blocks {case} y", y, textbook(x, w, b, activation), RTOL[dtype])
    if z.numel():
        assert_close(f"two blocks {case} z", z, textbook(x, w, b, None), RTOL[dtype])
    infer = kernels.infer(x, w, b, activation, blocks_per_sm=2)
    assert_close(f"two blocks {case} infer", infer, textbook(x, w, b, activation), RTOL[dtype])
