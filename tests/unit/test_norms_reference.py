"""The norm references against textbook float64 math, the public API's checks and mixed precision."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import runtime.accelerators as acc


def _textbook_rms(x, w, eps):
    rows = x.reshape(-1, x.shape[-1]).tolist()
    out = [[v / math.sqrt(sum(u * u for u in r) / len(r) + eps) * wi for v, wi in zip(r, w.tolist())] for r in rows]
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def _textbook_l2(x, eps):
    rows = x.reshape(-1, x.shape[-1]).tolist()
    out = [[v / math.sqrt(sum(u * u for u in r) + eps) for v in r] for r in rows]
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


@pytest.mark.parametrize("shape", [(1, 16), (3, 5, 48), (7, 200)], ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_reference_matches_textbook(shape):
    x, w = torch.randn(shape, dtype=torch.float64), torch.randn(shape[-1], dtype=torch.float64)
    torch.testing.assert_close(
        acc.rms_norm(x, w, 1e-6, backend="torch"), _textbook_rms(x, w, 1e-6), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("shape", [(1, 16), (3, 5, 48), (7, 200)], ids=lambda s: "x".join(map(str, s)))
def test_l2norm_reference_matches_textbook(shape):
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(acc.l2norm(x, 1e-6, backend="torch"), _textbook_l2(x, 1e-6), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(1, 16), (3, 5, 48), (7, 200)], ids=lambda s: "x".join(map(str, s)))
def test_layer_norm_reference_matches_textbook(shape):
    x = torch.randn(shape, dtype=torch.float64)
    w, b = torch.randn(shape[-1], dtype=torch.float64), torch.randn(shape[-1], dtype=torch.float64)
    rows = x.reshape(-1, shape[-1]).tolist()
    expected = []
    for r in rows:
        mean = sum(r) / len(r)
        var = sum((v - mean) ** 2 for v in r) / len(r)
        expected.append([(v - mean) / math.sqrt(var + 1e-5) * wi + bi for v, wi, bi in zip(r, w.tolist(), b.tolist())])
    expected = torch.tensor(expected, dtype=torch.float64).reshape(shape)
    torch.testing.assert_close(acc.layer_norm(x, w, b, 1e-5, backend="torch"), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        acc.layer_norm(x, w, b, 1e-5, backend="torch"), F.layer_norm(x, (shape[-1],), w, b, 1e-5)
    )


def test_mixed_precision_output_in_activation_dtype_grads_in_input_dtype():
    x = torch.randn(4, 48, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, dtype=torch.float32, requires_grad=True)
    y = acc.rms_norm(x, w, backend="torch")
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "l2norm"])
def test_empty_batch_returns_empty_result(op):
    x = torch.randn(0, 3, 48, requires_grad=True)
    y = getattr(acc, op)(x, backend="triton")
    assert y.shape == (0, 3, 48)
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "l2norm"])
def test_errors_name_the_argument(op):
    fn = getattr(acc, op)
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        fn(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got list"):
        fn([1.0, 2.0])
    with pytest.raises(ValueError, match=r"x: the last dimension \(the normalised width\) is empty"):
        fn(torch.randn(3, 0))
    with pytest.raises(ValueError, match="x: expected at least 1 dimension"):
        fn(torch.tensor(1.0))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "l2norm"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_eps_errors_name_eps(op, backend):
    fn, x = getattr(acc, op), torch.randn(2, 8)
    for eps in (-1e-6, float("nan"), math.inf):
        with pytest.raises(ValueError, match="eps: expected a finite float >= 0"):
            fn(x, eps=eps, backend=backend)
    for eps in (None, "1e-6", True):
        with pytest.raises(TypeError, match="eps: expected a float >= 0"):
            fn(x, eps=eps, backend=backend)
    expected = fn(x, eps=1e-3, backend="torch")
    for eps in (np.float32(1e-3), np.float64(1e-3), 0):  # any real number
        torch.testing.assert_close(fn(x, eps=eps, backend=backend), fn(x, eps=float(eps), backend="torch"))
    torch.testing.assert_close(fn(x, eps=np.float32(1e-3), backend=backend), expected)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_weight_errors(op):
    fn, x = getattr(acc, op), torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\) to match the last dimension of x, got \(7,\)"):
        fn(x, torch.randn(7))
    with pytest.raises(TypeError, match="weight: expected a floating-point tensor"):
        fn(x, torch.ones(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight: expected a tensor on cpu like x, got one on meta"):
        fn(x, torch.randn(8, device="meta"))


def test_bias_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"bias: expected shape \(8,\)"):
        acc.layer_norm(x, torch.randn(8), torch.randn(9))
