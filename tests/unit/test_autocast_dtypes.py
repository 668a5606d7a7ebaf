"""dropout_add, add_rms_norm / add_layer_norm and swiglu under CPU autocast (bf16), on the torch backend and the
Triton kernels under TRITON_INTERPRET=1: the dtypes of the outputs and of every gradient are those of the eager torch
composition the op stands for; activations of two dtypes are refused with an error naming the argument."""

import pytest
import torch
import torch.nn.functional as F

from runtime.accelerators import add_layer_norm, add_rms_norm, dropout_add, layer_norm, rms_norm, swiglu

f32, bf16 = torch.float32, torch.bfloat16
BACKENDS = ["torch", "triton"]

# name: (the op on a backend, the eager composition it stands for, how many parameters follow the two activations)
CASES = {
    "dropout_add": (
        lambda be: lambda x, r: dropout_add(x, r, 0.25, backend=be),
        lambda x, r: r + F.dropout(x, 0.25),
        0,
    ),
    "dropout_add-eval": (
        lambda be: lambda x, r: dropout_add(x, r, 0.25, training=False, backend=be),
        lambda x, r: r + x,
        0,
    ),
    "swiglu": (lambda be: lambda g, u: swiglu(g, u, backend=be), lambda g, u: F.silu(g) * u, 0),
    "add_rms_norm": (
        lambda be: lambda x, r, w: add_rms_norm(x, r, w, backend=be),
        lambda x, r, w: (rms_norm(x + r, w, backend="torch"), x + r),
        1,
    ),
    "add_layer_norm": (
        lambda be: lambda x, r, w, b: add_layer_norm(x, r, w, b, backend=be),
        lambda x, r, w, b: (layer_norm(x + r, w, b, backend="torch"), x + r),
        2,
    ),
}


def _dtypes(fn, *args):
    """(output dtypes, gradient dtypes) of fn(*args) under CPU bf16 autocast, the backward outside it."""
    args = [a.detach().clone().requires_grad_() for a in args]
    with torch.autocast("cpu", dtype=bf16):
        out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return [o.dtype for o in outs], [a.grad.dtype for a in args]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(
    "activation, parameter",
    [(bf16, f32), (bf16, bf16), (f32, f32), (f32, bf16)],
    ids=["bf16-f32", "bf16-bf16", "f32-f32", "f32-bf16"],
)
def test_dtypes_under_autocast_are_the_eager_compositions(name, backend, activation, parameter):
    op, eager, n_parameters = CASES[name]
    args = [torch.randn(3, 37, dtype=activation) for _ in range(2)]
    args += [torch.randn(37, dtype=parameter) for _ in range(n_parameters)]
    assert _dtypes(op(backend), *args) == _dtypes(eager, *args)


MIXED = {
    # name: (call, the argument named, the one it must match, the eager expression)
    "dropout_add": (lambda a, b, be: dropout_add(a, b, 0.25, backend=be), "residual", "x", "residual + x"),
    "dropout_add-eval": (
        lambda a, b, be: dropout_add(a, b, 0.25, training=False, backend=be),
        "residual",
        "x",
        "residual + x",
    ),
    "add_rms_norm": (lambda a, b, be: add_rms_norm(a, b, backend=be), "residual", "x", "x + residual"),
    "add_layer_norm": (lambda a, b, be: add_layer_norm(a, b, backend=be), "residual", "x", "x + residual"),
    "swiglu": (lambda a, b, be: swiglu(a, b, backend=be), "up", "gate", "silu(gate) * up"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MIXED))
@pytest.mark.parametrize("first, second", [(bf16, f32), (f32, bf16)], ids=["bf16-f32", "f32-bf16"])
def test_activations_of_two_dtypes_under_autocast_are_refused_naming_the_argument(name, backend, first, second):
    call, argument, other, expression = MIXED[name]
    a, b = torch.randn(3, 37, dtype=first), torch.randn(3, 37, dtype=second)
    with torch.autocast("cpu", dtype=bf16), pytest.raises(TypeError) as error:
        call(a, b, backend)
    assert str(error.value) == (
        f"{argument}: expected the dtype of {other} ({first}), got {second}; cast both to one dtype first "
        f"(under autocast too: eager {expression} would give torch.float32)"
    )
