"""Tensors past 2^31 elements on both kernel backends: flat offsets that no longer fit an int32.

Each op runs forward and backward once on inputs of just over 2^31 elements (4.3 GB in bf16), with the fallback
rule "error", so that each case runs its kernels or fails. The rows at both ends are checked against float64 (the last
ones sit past 2^31), parameter gradients over all rows (their float64 reference is summed in chunks). The kernels
that index in int32 decline such inputs with a reason instead (DECLINED), and the case checks that. Needs about 45 GB
of GPU memory; skipped on a smaller GPU.
"""

import pytest
import torch
import torch.nn.functional as F

from runtime.accelerators import (
    BackendUnavailableError,
    binary_cross_entropy_with_logits,
    dropout_add,
    embedding_bag_mean,
    flash_attention,
    l2norm,
    layer_norm,
    rms_norm,
    swiglu,
    use_accelerators,
)
from runtime.accelerators.flash_attention.reference import attention_float64
from runtime.accelerators.l2norm.reference import l2norm_reference
from runtime.accelerators.layer_norm.reference import layer_norm_reference
from runtime.accelerators.rms_norm.reference import rms_norm_reference
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

BACKENDS = ("triton", "tilelang")
DEVICE = "cuda"
BF16 = torch.bfloat16
WIDTH = 4096
ROWS = 2**31 // WIDTH + 5  # [ROWS, WIDTH]: 2^31 + 20480 elements
ENDS = 48  # rows checked at each end
CHUNK = 2**16  # rows per chunk of a float64 reference over all rows
# (op, backend) pairs whose kernels take at most 2^31 - 2^16 elements, and the reason they give
DECLINED = {
    ("swiglu", "tilelang"): "the most the tilelang kernels take",
    ("dropout_add", "tilelang"): "the most the tilelang kernels take",
    ("bce", "triton"): "the most the kernels index",
    ("bce", "tilelang"): "the most the kernels index",
}
ATTENTION = (2**31 // (4 * 1024 * 64) + 1, 4, 1024, 64)  # [B, H, L, D]: 2^31 + 2^18 elements

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 60 * 2**30,
    reason="needs a CUDA GPU with at least 60 GB",
)


@pytest.fixture(autouse=True)
def _kernels_or_error():
    """No silent fallback to the torch reference: a backend that cannot run raises."""
    with use_accelerators(fallback="error"):
        yield
    torch.cuda.empty_cache()


def declines(op: str, backend: str, call) -> bool:
    """For a DECLINED pair: check that call() raises with its reason, and say so (the case then ends)."""
    reason = DECLINED.get((op, backend))
    if reason is None:
        return False
    with pytest.raises(BackendUnavailableError, match=reason):
        call()
    return True


def ends(x: torch.Tensor, n: int = ENDS) -> torch.Tensor:
    """The first and the last n entries along dim 0."""
    return torch.cat([x[:n], x[-n:]])


def big(*shape, scale: float = 1.0, requires_grad: bool = True) -> torch.Tensor:
    x = torch.randn(*shape, device=DEVICE, dtype=BF16)
    if scale != 1.0:
        x.mul_(scale)
    return x.requires_grad_(requires_grad)


def check_norm(name, run, reference, x, params):
    """run(x, *params) on the kernels, reference(x, *params) in float64 over rows; y and dx at both ends, the
    parameter gradients over every row."""
    y = run(x, *params)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, *params), dy)
    x_ends = ends(x.detach()).double().requires_grad_()
    y_ref = reference(x_ends, *(p.detach().double() for p in params))
    dx_ref = torch.autograd.grad(y_ref, x_ends, ends(dy).double())[0]
    assert_close(f"{name} y", ends(y), y_ref, RTOL[BF16])
    assert_close(f"{name} dx", ends(grads[0]), dx_ref, gradient_tolerance(BF16))
    for i, (g, ref) in enumerate(zip(grads[1:], parameter_grads(reference, x.detach(), params, dy))):
        assert_close(f"{name} dparam{i}", g, ref, gradient_tolerance(BF16))


def parameter_grads(reference, x, params, dy) -> list:
    """The float64 gradients of reference(x, *params) with respect to params, summed over chunks of rows."""
    totals = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for start in range(0, x.shape[0], CHUNK) if params else ():
        params64 = [p.detach().double().requires_grad_() for p in params]
        y = reference(x[start : start + CHUNK].double(), *params64)
        for total, g in zip(totals, torch.autograd.grad(y, params64, dy[start : start + CHUNK].double())):
            total += g
    return totals


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm(backend):
    x, w = big(ROWS, WIDTH), big(WIDTH)
    check_norm(
        "rms_norm", lambda x, w: rms_norm(x, w, backend=backend), rms_norm_reference, x, [w],
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm(backend):
    x, w, b = big(ROWS, WIDTH), big(WIDTH), big(WIDTH)
    check_norm(
        "layer_norm", lambda x, w, b: layer_norm(x, w, b, backend=backend),
        layer_norm_reference, x, [w, b],
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_l2norm(backend):
    check_norm(
        "l2norm", lambda x: l2norm(x, backend=backend), l2norm_reference, big(ROWS, WIDTH), [],
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu(backend):
    gate, up = big(ROWS, WIDTH), big(ROWS, WIDTH)
    if declines("swiglu", backend, lambda: swiglu(gate, up, backend=backend)):
        return
    y = swiglu(gate, up, backend=backend)
    dy = torch.randn_like(y)
    dgate, dup = torch.autograd.grad(y, (gate, up), dy)
    g, u = ends(gate.detach()).double().requires_grad_(), ends(up.detach()).double().requires_grad_()
    y_ref = F.silu(g) * u
    dgate_ref, dup_ref = torch.autograd.grad(y_ref, (g, u), ends(dy).double())
    assert_close("swiglu y", ends(y), y_ref, RTOL[BF16])
    assert_close("swiglu dgate", ends(dgate), dgate_ref, gradient_tolerance(BF16))
    assert_close("swiglu dup", ends(dup), dup_ref, gradient_tolerance(BF16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_add(backend):
    """The mask at both ends, from small integers (exact in bf16, and 1 / (1 - p) = 2): kept elements give
    residual + 2 x and pass 2 dy back, dropped ones give the residual and pass 0; about half are kept."""
    p = 0.5
    x = torch.randint(-8, 8, (ROWS, WIDTH), device=DEVICE, dtype=BF16)
    x += x >= 0  # never 0, so that a kept element differs from a dropped one
    residual = torch.randint(-8, 9, (ROWS, WIDTH), device=DEVICE, dtype=BF16)
    x.requires_grad_(), residual.requires_grad_()
    if declines("dropout_add", backend, lambda: dropout_add(x, residual, p, True, backend=backend)):
        return
    out = dropout_add(x, residual, p, True, backend=backend)
    dy = torch.randn_like(out)
    dx, dres = torch.autograd.grad(out, (x, residual), dy)
    res_ends = ends(residual.detach())
    kept = ends(out) != res_ends
    assert abs(kept.double().mean().item() - (1 - p)) < 0.01
    assert torch.equal(ends(out), res_ends + torch.where(kept, 2 * ends(x.detach()), 0))
    assert torch.equal(ends(dx), torch.where(kept, 2 * ends(dy), 0))
    assert torch.equal(ends(dres), ends(dy))


@pytest.mark.parametrize("backend", BACKENDS)
def test_binary_cross_entropy_with_logits(backend):
    logits, targets = big(ROWS, WIDTH, scale=3.0), torch.rand(ROWS, WIDTH, device=DEVICE, dtype=BF16)
    if declines("bce", backend, lambda: binary_cross_entropy_with_logits(logits, targets, backend=backend)):
        return
    loss = binary_cross_entropy_with_logits(logits, targets, reduction="none", backend=backend)
    dy = torch.randn_like(loss)
    (dlogits,) = torch.autograd.grad(loss, logits, dy)
    x = ends(logits.detach()).double().requires_grad_()
    loss_ref = F.binary_cross_entropy_with_logits(x, ends(targets).double(), reduction="none")
    (dlogits_ref,) = torch.autograd.grad(loss_ref, x, ends(dy).double())
    assert_close("bce loss", ends(loss), loss_ref, RTOL[BF16])
    assert_close("bce dlogits", ends(dlogits), dlogits_ref, gradient_tolerance(BF16))
    del loss, dy, dlogits
    mean = binary_cross_entropy_with_logits(logits.detach(), targets, reduction="mean", backend=backend)
    total = sum(
        F.binary_cross_entropy_with_logits(
            logits.detach()[s : s + CHUNK].double(), targets[s : s + CHUNK].double(), reduction="sum"
        )
        for s in range(0, ROWS, CHUNK)
    )
    assert_close("bce mean", mean, total / logits.numel(), RTOL[BF16])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_embedding_bag_mean(backend, index_dtype):
    """A table of 2^25 + 8 rows of 64: rows past 2^25 start past element 2^31. Bags of 8 drawn from the last and the
    first rows; the dense gradient at every row a bag reads, and zero elsewhere."""
    dim, bags, bag = 64, 512, 8
    table = big(2**25 + 8, dim)
    rows = table.shape[0]
    pool = torch.cat([torch.arange(rows - 300, rows), torch.arange(0, 100)]).to(DEVICE)
    indices = pool[torch.randint(0, pool.numel(), (bags, bag), device=DEVICE)].to(index_dtype)
    out = embedding_bag_mean(table, indices, backend=backend)
    dout = torch.randn_like(out)
    (dtable,) = torch.autograd.grad(out, table, dout)
    assert_close("embedding_bag out", out, table.detach()[indices.long()].double().mean(1), RTOL[BF16])
    read, position = torch.unique(indices.long().flatten(), return_inverse=True)
    dread_ref = torch.zeros(read.numel(), dim, device=DEVICE, dtype=torch.float64)
    dread_ref.index_add_(0, position, (dout.double() / bag).repeat_interleave(bag, dim=0))
    assert_close("embedding_bag dtable", dtable[read], dread_ref, gradient_tolerance(BF16))
    assert torch.count_nonzero(dtable).item() == torch.count_nonzero(dtable[read]).item()  # zero elsewhere, no NaN


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attention(backend):
    """The first and the last batch rows against float64: output and dq/dk/dv."""
    q, k, v = big(*ATTENTION), big(*ATTENTION), big(*ATTENTION)
    out = flash_attention(q, k, v, backend=backend)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    n = 2
    q64, k64, v64 = (ends(t.detach(), n).double().requires_grad_() for t in (q, k, v))
    out_ref = attention_float64(q64, k64, v64)
    grads_ref = torch.autograd.grad(out_ref, (q64, k64, v64), ends(dout, n).double())
    assert_close("attention out", ends(out, n), out_ref, RTOL[BF16])
    for name, g, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref):
        assert_close(f"attention {name}", ends(g, n), ref, gradient_tolerance(BF16))
