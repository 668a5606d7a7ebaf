"""Row norms of inputs near 1e30 (their squares overflow fp32) on the Triton and TileLang kernels: the normalised
rows, not zeros or NaN, forward (with and without autograd) and every gradient, against float64."""

import importlib

import pytest
import torch

from huge_rows import ADD_NORMS, ROW_SCALES, check_add_norm_huge, huge_rows, reference64
from runtime.accelerators import l2norm, layer_norm, rms_norm, use_accelerators
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm, "l2norm": l2norm}
PARAMS = {"rms_norm": ("weight",), "layer_norm": ("weight", "bias"), "l2norm": ()}
CASES = [(torch.float32, 200), (torch.float32, 4095), (torch.bfloat16, 200)]


@pytest.fixture(scope="module", autouse=True)
def _tilelang_kernels_compiled_in_parallel():
    from runtime.accelerators.tilelang_common import precompile

    device = torch.device("cuda", torch.cuda.current_device())
    wanted = []
    for dtype, width in CASES:
        for op in OPS:
            kernels = importlib.import_module(f"runtime.accelerators.{op}.tilelang")
            if op == "rms_norm":
                wanted += kernels.kernel_entries(dtype, width, dtype, device)
            elif op == "layer_norm":
                wanted += kernels.kernel_entries(dtype, width, dtype, dtype, device)
            else:
                wanted += kernels.kernel_entries(dtype, width)
        add_norm = importlib.import_module("runtime.accelerators.add_norm.tilelang")
        wanted += add_norm.kernel_entries(dtype, width, dtype, None, False, device)
        wanted += add_norm.kernel_entries(dtype, width, dtype, dtype, True, device)
    precompile(wanted, device)


@pytest.mark.parametrize("dtype, width", CASES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("op", list(OPS))
def test_huge_rows_are_normalised(op, backend, dtype, width):
    offset = 3.0 if op == "layer_norm" else 0.0  # centred values near 1e30 overflow too
    x = huge_rows(width, offset, device="cuda").to(dtype)
    x.requires_grad_()
    params = {name: (1 + 0.5 * torch.randn(width, device="cuda")).to(dtype).requires_grad_() for name in PARAMS[op]}
    dy = torch.randn(x.shape, device="cuda", dtype=dtype)
    with use_accelerators(fallback="error"):
        y = OPS[op](x, **params, backend=backend)
        grads = torch.autograd.grad(y, [x, *params.values()], dy)
        with torch.no_grad():
            inferred = OPS[op](x, **params, backend=backend)
    x64 = x.detach().double().requires_grad_()
    params64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    y64 = reference64(op, x64, **params64)
    grads64 = torch.autograd.grad(y64, [x64, *params64.values()], dy.double())
    for row, scale in enumerate(ROW_SCALES):  # each row on its own: dx of a row scales as 1 / its size
        tag = f"{op} {backend} {dtype} {width} row x{scale:g}"
        assert_close(f"{tag} y", y[row], y64[row], RTOL[dtype])
        assert_close(f"{tag} y without autograd", inferred[row], y64[row], RTOL[dtype])
        assert_close(f"{tag} dx", grads[0][row], grads64[0][row], gradient_tolerance(dtype))
    for name, grad, grad64 in zip(params, grads[1:], grads64[1:]):
        assert_close(f"{op} {backend} {dtype} {width} d{name}", grad, grad64, gradient_tolerance(dtype))


@pytest.mark.parametrize("dtype, width", CASES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("name", list(ADD_NORMS))
def test_add_norm_of_huge_rows_is_normalised(name, backend, dtype, width):
    rows = huge_rows(width, offset=3.0 if name == "add_layer_norm" else 0.0, device="cuda")
    x = (rows / 2).to(dtype).requires_grad_()
    residual = (rows / 2).to(dtype).requires_grad_()
    params = {
        key: (1 + 0.5 * torch.randn(width, device="cuda")).to(dtype).requires_grad_() for key in ADD_NORMS[name][2]
    }
    check_add_norm_huge(name, backend, x, residual, params, RTOL[dtype], gradient_tolerance(dtype))
