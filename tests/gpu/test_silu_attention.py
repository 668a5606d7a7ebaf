"""silu_attention's kernel backends on CUDA against float64: outputs and every gradient (q, k, v, both biases).

Lengths 0, 1, odd and long (up to 1000) in one packing; each feature (causal or not, targets, each bias in both
shapes, dropout, alpha) at least once, each dtype at least once; not the full product. Both backends, forward and
backward; the TileLang forward also alone under no_grad.
"""

import pytest
import torch

from runtime.accelerators import silu_attention, use_accelerators
from runtime.accelerators.flash_attention import dropout
from runtime.accelerators.silu_attention.reference import silu_attention_reference
from runtime.accelerators.testing import RTOL, RTOL_ATTENTION_FP32, assert_close, gradient_tolerance

CUDA = "cuda"
LENGTHS = [0, 1, 37, 200, 1000, 63]


def rtol_for(dtype):
    return RTOL_ATTENTION_FP32 if dtype == torch.float32 else RTOL[dtype]


def make(lengths, h, d, dtype, *, targets=False, pos=None, time=None, grad=True):
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, device=CUDA, dtype=dtype).requires_grad_(grad) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    kwargs = {"max_seqlen": max(lengths)}
    if targets:
        kwargs["num_targets"] = torch.tensor([min(n, t) for n, t in zip(lengths, (0, 1, 5, 0, 17, 63))], device=CUDA)
    if pos:
        shape = (1500,) if pos == "shared" else (h, 300)  # more buckets than distances, and fewer (clamped)
        kwargs["position_bias"] = (0.5 * torch.randn(shape, device=CUDA)).requires_grad_(grad)
    if time:
        shape = (16,) if time == "shared" else (h, 12)
        kwargs["time_bias"] = (0.5 * torch.randn(shape, device=CUDA)).requires_grad_(grad)
        gaps = torch.randint(0, 5000, (total,), device=CUDA) * torch.randint(0, 2, (total,), device=CUDA)
        kwargs["timestamps"] = 1_700_000_000 + gaps.cumsum(0)
    return q, k, v, cu, kwargs


def float64_reference(q, k, v, cu, kwargs, causal, alpha, keep=None, dropout_p=0.0):
    as64 = {name: (x.double() if name in ("position_bias", "time_bias") else x) for name, x in kwargs.items()}
    return silu_attention_reference(
        q.double(), k.double(), v.double(), cu, as64["max_seqlen"], alpha, causal, as64.get("num_targets"),
        as64.get("position_bias"), as64.get("time_bias"), as64.get("timestamps"), dropout_p, keep,
    )  # fmt: skip


def check(out, ref, q, k, v, kwargs, dtype):
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close("o", out, ref, rtol_for(dtype))
    inputs = [("dq", q), ("dk", k), ("dv", v)]
    inputs += [(f"d{name}", kwargs[name]) for name in ("position_bias", "time_bias") if name in kwargs]
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x for _, x in inputs], do)
    grads_ref = torch.autograd.grad(ref, [x for _, x in inputs], do.double())
    for (name, x), g, g_ref in zip(inputs, grads, grads_ref):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_close(name, g, g_ref, gradient_tolerance(dtype, rtol_for(dtype)))


# (head dim, dtype, causal, targets, position bias, time bias, alpha)
CASES = [
    (32, torch.bfloat16, True, False, None, None, None),
    (64, torch.bfloat16, True, True, "per-head", "shared", None),
    (48, torch.float16, False, False, "shared", None, 0.2),
    (16, torch.float16, True, True, None, "per-head", None),
    (128, torch.bfloat16, False, True, "per-head", "per-head", None),
    (24, torch.float32, True, False, "shared", "shared", None),
    (100, torch.float32, False, True, None, None, 0.05),
]


def _id(case):
    d, dtype, causal, targets, pos, time, alpha = case
    parts = [f"d{d}", str(dtype).removeprefix("torch."), "causal" if causal else "full"]
    parts += ["targets"] * targets + [f"pos-{pos}"] * bool(pos) + [f"time-{time}"] * bool(time)
    return "-".join(parts + ([f"alpha{alpha}"] if alpha else []))


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_triton_against_float64(case):
    d, dtype, causal, targets, pos, time, alpha = case
    q, k, v, cu, kwargs = make(LENGTHS, 2, d, dtype, targets=targets, pos=pos, time=time)
    with use_accelerators(fallback="error"):
        out = silu_attention(q, k, v, cu, **kwargs, causal=causal, alpha=alpha, backend="triton")
    check(out, float64_reference(q, k, v, cu, kwargs, causal, alpha), q, k, v, kwargs, dtype)


def _rebuilt_keep(lengths, h, p):
    """The kernels' keep masks per sequence [H, n, n] for the seed torch's CUDA generator gives next (the pair index
    of (sequence s, head h) being s * H + h)."""
    from runtime.accelerators.seeds import draw_seed_tensor

    seed = int(draw_seed_tensor(torch.device(CUDA)))
    keep = []
    for s, n in enumerate(lengths):
        index = torch.arange(n, device=CUDA)
        bh = (s * h + torch.arange(h, device=CUDA)).view(-1, 1, 1)
        keep.append(
            dropout.random_bits(seed, bh, index.view(1, -1, 1), index.view(1, 1, -1)) >= dropout.keep_threshold(p)
        )
    return keep


def test_triton_dropout_against_the_rebuilt_mask():
    p, h, lengths = 0.2, 2, [0, 1, 37, 200]
    q, k, v, cu, kwargs = make(lengths, h, 32, torch.bfloat16, targets=True, pos="shared", time="per-head")
    kwargs["num_targets"] = kwargs["num_targets"][: len(lengths)]
    torch.manual_seed(7)
    with use_accelerators(fallback="error"):
        out = silu_attention(q, k, v, cu, **kwargs, dropout_p=p, backend="triton")
    torch.manual_seed(7)
    ref = float64_reference(q, k, v, cu, kwargs, True, None, _rebuilt_keep(lengths, h, p), dropout.drop_rate(p))
    check(out, ref, q, k, v, kwargs, torch.bfloat16)


def test_triton_bias_gradients_are_deterministic():
    q, k, v, cu, kwargs = make(LENGTHS, 2, 32, torch.bfloat16, pos="shared", time="shared")
    grads = []
    for _ in range(3):
        out = silu_attention(q, k, v, cu, **kwargs, backend="triton")
        grads.append(torch.autograd.grad(out.float().square().sum(), (kwargs["position_bias"], kwargs["time_bias"])))
    assert all(torch.equal(a, b) for run in grads[1:] for a, b in zip(grads[0], run))


TILELANG_CASES = [
    (32, torch.bfloat16, True, False, None, None, None),
    (64, torch.bfloat16, True, True, "per-head", "shared", None),
    (48, torch.float16, False, True, "shared", "per-head", 0.2),
    (128, torch.float16, True, False, "per-head", None, None),
    (24, torch.bfloat16, False, False, None, "shared", None),
]


@pytest.mark.parametrize("case", TILELANG_CASES, ids=[_id(c) for c in TILELANG_CASES])
def test_tilelang_forward_against_float64(case):
    pytest.importorskip("runtime.accelerators.silu_attention.tilelang", exc_type=ImportError)
    d, dtype, causal, targets, pos, time, alpha = case
    q, k, v, cu, kwargs = make(LENGTHS, 2, d, dtype, targets=targets, pos=pos, time=time, grad=False)
    with use_accelerators(fallback="error"):
        out = silu_attention(q, k, v, cu, **kwargs, causal=causal, alpha=alpha, backend="tilelang")
    assert out.dtype == dtype
    assert_close("o", out, float64_reference(q, k, v, cu, kwargs, causal, alpha), rtol_for(dtype))


@pytest.mark.parametrize("case", TILELANG_CASES, ids=[_id(c) for c in TILELANG_CASES])
def test_tilelang_against_float64(case):
    """The TileLang forward and backward: the output and every gradient (q, k, v, both biases)."""
    pytest.importorskip("runtime.accelerators.silu_attention.tilelang", exc_type=ImportError)
    d, dtype, causal, targets, pos, time, alpha = case
    q, k, v, cu, kwargs = make(LENGTHS, 2, d, dtype, targets=targets, pos=pos, time=time)
    with use_accelerators(fallback="error"):
        out = silu_attention(q, k, v, cu, **kwargs, causal=causal, alpha=alpha, backend="tilelang")
    check(out, float64_reference(q, k, v, cu, kwargs, causal, alpha), q, k, v, kwargs, dtype)


def test_tilelang_dropout_against_the_rebuilt_mask():
    pytest.importorskip("runtime.accelerators.silu_attention.tilelang", exc_type=ImportError)
    p, h, lengths = 0.2, 2, [0, 1, 37, 200]
    q, k, v, cu, kwargs = make(lengths, h, 64, torch.bfloat16, targets=True, pos="per-head", time="shared")
    kwargs["num_targets"] = kwargs["num_targets"][: len(lengths)]
    torch.manual_seed(7)
    with use_accelerators(fallback="error"):
        out = silu_attention(q, k, v, cu, **kwargs, dropout_p=p, backend="tilelang")
    torch.manual_seed(7)
    ref = float64_reference(q, k, v, cu, kwargs, True, None, _rebuilt_keep(lengths, h, p), dropout.drop_rate(p))
    check(out, ref, q, k, v, kwargs, torch.bfloat16)


def test_tilelang_bias_gradients_are_deterministic():
    pytest.importorskip("runtime.accelerators.silu_attention.tilelang", exc_type=ImportError)
    for causal in (True, False):
        q, k, v, cu, kwargs = make(LENGTHS, 2, 32, torch.bfloat16, pos="shared", time="per-head")
        grads = []
        for _ in range(3):
            out = silu_attention(q, k, v, cu, **kwargs, causal=causal, backend="tilelang")
            loss = out.float().square().sum()
            grads.append(torch.autograd.grad(loss, (q, kwargs["position_bias"], kwargs["time_bias"])))
        assert all(torch.equal(a, b) for run in grads[1:] for a, b in zip(grads[0], run))
