"""silu_attention on the CPU: the reference against float64 loops written from the formulas, the Triton kernels
under the interpreter (forward and every gradient), dispatch, and every input error."""

import math

import pytest
import torch

from runtime.accelerators import BackendUnavailableError, explain, silu_attention, use_accelerators
from runtime.accelerators.flash_attention import dropout
from runtime.accelerators.silu_attention import SPEC, input_reasons
from runtime.accelerators.silu_attention.reference import silu_attention_reference, time_buckets
from runtime.accelerators.testing import RTOL, RTOL_ATTENTION_FP32, assert_close, gradient_tolerance


def float64_loop(q, k, v, lengths, max_seqlen, alpha=None, causal=True, targets=None, pos=None, time=None, ts=None,
                 keep=None, dropout_p=0.0):  # fmt: skip
    """The op's definition, element by element in float64 (Python loops over sequences, heads, i and j).
    keep(s, h, i, j) -> bool: the dropout draw. Differentiable in q, k, v, pos and time."""
    _, n_heads, d = q.shape
    alpha = 1 / math.sqrt(d) if alpha is None else alpha
    q, k, v = q.double(), k.double(), v.double()
    pos = None if pos is None else (pos.double() if pos.dim() == 2 else pos.double().expand(n_heads, -1))
    time = None if time is None else (time.double() if time.dim() == 2 else time.double().expand(n_heads, -1))
    rows = []
    start = 0
    for s, n in enumerate(lengths):
        n_targets = targets[s] if targets is not None else 0
        for i in range(n):
            per_head = []
            for h in range(n_heads):
                out = torch.zeros(d, dtype=torch.float64)
                for j in range(n):
                    if causal and j > i:
                        continue
                    if j >= n - n_targets and j != i:  # a candidate key: seen only by itself
                        continue
                    score = alpha * torch.dot(q[start + i, h], k[start + j, h])
                    if pos is not None:
                        score = score + pos[h, min(abs(i - j), pos.shape[1] - 1)]
                    if time is not None:
                        dt = abs(int(ts[start + i]) - int(ts[start + j]))
                        score = score + time[h, min((1 + dt).bit_length() - 1, time.shape[1] - 1)]
                    weight = score * torch.sigmoid(score) / max_seqlen
                    if keep is not None:
                        weight = weight * keep(s, h, i, j) / (1 - dropout_p)
                    out = out + weight * v[start + j, h]
                per_head.append(out)
            rows.append(torch.stack(per_head))
        start += n
    return torch.stack(rows) if rows else torch.zeros(0, n_heads, d, dtype=torch.float64)


def make(lengths, h, d, dtype=torch.float32, *, targets=None, pos=None, time=None, max_seqlen=None, grad=True):
    """Inputs of silu_attention: pos / time are None, "shared" ([P]) or "per-head" ([H, P])."""
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, dtype=dtype).requires_grad_(grad) for _ in range(3))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()) if lengths else [0], dtype=torch.int32)
    kwargs = dict(max_seqlen=max_seqlen if max_seqlen is not None else max(lengths + [1]))
    if targets is not None:
        kwargs["num_targets"] = torch.tensor(targets, dtype=torch.int32)
    if pos:
        shape = (7,) if pos == "shared" else (h, 7)
        kwargs["position_bias"] = torch.randn(shape).requires_grad_(grad)
    if time:
        shape = (5,) if time == "shared" else (h, 5)
        kwargs["time_bias"] = torch.randn(shape).requires_grad_(grad)
        # seconds: gaps from 0 to a few hours, so that every bucket below 5 and the clamped last are hit
        kwargs["timestamps"] = torch.randint(0, 40, (total,), dtype=torch.int64).cumsum(0) * torch.randint(
            1, 3, (total,)
        )
    return q, k, v, cu, kwargs


def oracle(q, k, v, cu, kwargs, causal=True, alpha=None, keep=None, dropout_p=0.0):
    lengths = (cu[1:] - cu[:-1]).tolist()
    targets = kwargs["num_targets"].tolist() if "num_targets" in kwargs else None
    return float64_loop(q, k, v, lengths, kwargs["max_seqlen"], alpha, causal, targets, kwargs.get("position_bias"),
                        kwargs.get("time_bias"), kwargs.get("timestamps"), keep, dropout_p)  # fmt: skip


def check_all(out, ref, q, k, v, kwargs, rtol, grad_rtol):
    """Output and every gradient (q, k, v and the biases given) against the float64 oracle."""
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close("o", out, ref, rtol)
    inputs = [("dq", q), ("dk", k), ("dv", v)]
    inputs += [(f"d{name}", kwargs[name]) for name in ("position_bias", "time_bias") if name in kwargs]
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x for _, x in inputs], do)
    grads_ref = torch.autograd.grad(ref, [x for _, x in inputs], do.double())
    for (name, x), g, g_ref in zip(inputs, grads, grads_ref):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_close(name, g, g_ref, grad_rtol)


# --------------------------------------------------------------------------- the reference

REF_CASES = {
    "causal": dict(),
    "not-causal": dict(causal=False),
    "targets": dict(targets=[0, 1, 2, 4]),
    "targets-not-causal": dict(targets=[0, 1, 5, 3], causal=False),
    "pos-shared": dict(pos="shared"),
    "pos-per-head-not-causal": dict(pos="per-head", causal=False),
    "time-shared": dict(time="shared"),
    "time-per-head-targets": dict(time="per-head", targets=[0, 0, 3, 2]),
    "everything-alpha": dict(pos="per-head", time="shared", targets=[0, 1, 1, 6], alpha=0.3, max_seqlen=20),
}


@pytest.mark.parametrize("name", list(REF_CASES))
def test_reference_against_float64_loop(name):
    case = dict(REF_CASES[name])
    causal, alpha = case.pop("causal", True), case.pop("alpha", None)
    q, k, v, cu, kwargs = make([0, 1, 5, 17][:4], 2, 8, **case)
    out = silu_attention(q, k, v, cu, **kwargs, causal=causal, alpha=alpha, backend="torch")
    ref = oracle(q, k, v, cu, kwargs, causal, alpha)
    check_all(out, ref, q, k, v, kwargs, 1e-6, 1e-6)


@pytest.mark.parametrize("group_scores", [1, 2 * 17 * 17, 1 << 25], ids=["one-each", "some", "all"])
def test_reference_pads_groups_of_sequences(group_scores):
    """The torch backend pads sequences of similar lengths together and computes each group at once, within a
    budget of score elements: every sequence alone, groups of some, all in one; with both biases, targets and a
    dropout keep mask per sequence, the float64 loop's output and gradients."""
    lengths = [0, 1, 5, 17, 3, 9]
    q, k, v, cu, kwargs = make(lengths, 2, 8, pos="per-head", time="shared", targets=[0, 1, 1, 6, 0, 2])
    gen = torch.Generator().manual_seed(1)
    keeps = [torch.rand(2, n, n, generator=gen) >= 0.3 for n in lengths]
    out = silu_attention_reference(
        q, k, v, cu, kwargs["max_seqlen"], None, True, kwargs["num_targets"], kwargs["position_bias"],
        kwargs["time_bias"], kwargs["timestamps"], 0.3, keeps, group_scores,
    )  # fmt: skip
    ref = oracle(q, k, v, cu, kwargs, keep=lambda s, h, i, j: keeps[s][h, i, j], dropout_p=0.3)
    check_all(out, ref, q, k, v, kwargs, 1e-6, 1e-6)


def test_time_buckets_exact_at_powers_of_two():
    dt = torch.tensor([0, 1, 2, 3, 6, 7, 8, 2**53 - 2, 2**53 - 1, 2**62 - 1, 2**62, 2**63 - 2], dtype=torch.int64)
    expected = [(int(x) + 1).bit_length() - 1 for x in dt.tolist()]
    assert time_buckets(dt, 100).tolist() == expected
    assert time_buckets(dt, 4).tolist() == [min(e, 3) for e in expected]


# int64 extremes: differences of opposite signs far apart do not fit in int64 (up to 2^64 - 1)
EXTREME_TIMES = [-(2**63), 2**63 - 1, 0, -1, 2**62, -(2**62) - 1, 2**63 - 2, -(2**63) + 1, 5]


@pytest.mark.parametrize("n_buckets", [5, 64])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_time_differences_past_int64_take_the_last_bucket(backend, n_buckets):
    """|t_i - t_j| wrapped around past int64: the torch backend indexed the time bias with a garbage bucket and the
    Triton kernel with another. Every backend saturates the difference at 2^63 - 2, so the buckets stop at
    min(T - 1, 62), the last bucket the kernels hold (what log2(1 + |dt|) >= 62 gives for T <= 63)."""
    ts = torch.tensor(EXTREME_TIMES, dtype=torch.int64)
    n = len(EXTREME_TIMES)
    q, k, v = (torch.randn(n, 2, 16, requires_grad=True) for _ in range(3))
    time_bias = torch.randn(2, n_buckets, requires_grad=True)
    cu = torch.tensor([0, n], dtype=torch.int32)
    kwargs = dict(max_seqlen=n, causal=False, time_bias=time_bias, timestamps=ts)
    with use_accelerators(fallback="error"):
        out = silu_attention(q, k, v, cu, **kwargs, backend=backend)
    ref = float64_loop(q, k, v, [n], n, causal=False, time=time_bias[:, :63], ts=ts)
    assert_close("o", out, ref, RTOL_ATTENTION_FP32)
    do = torch.randn_like(out)
    for name, g, g_ref in zip(
        ("dq", "dtime_bias"),
        torch.autograd.grad(out, (q, time_bias), do),
        torch.autograd.grad(ref, (q, time_bias), do.double()),
    ):
        assert_close(name, g, g_ref, gradient_tolerance(torch.float32, RTOL_ATTENTION_FP32))


def test_reference_dropout_keeps_expectation():
    q, k, v, cu, kwargs = make([9], 1, 8, grad=False)
    plain = silu_attention_reference(q, k, v, cu, kwargs["max_seqlen"])
    runs = [silu_attention_reference(q, k, v, cu, kwargs["max_seqlen"], dropout_p=0.5) for _ in range(600)]
    assert_close("dropout average", torch.stack(runs).mean(0), plain, 0.15)


def test_no_sequences_and_empty_sequences():
    q, k, v, cu, kwargs = make([], 2, 16)
    for backend in ("torch", "triton"):
        assert silu_attention(q, k, v, cu, **kwargs, backend=backend).shape == (0, 2, 16)
    q, k, v, cu, kwargs = make([0, 0], 2, 16)
    assert silu_attention(q, k, v, cu, **kwargs, backend="triton").shape == (0, 2, 16)


def test_autocast_runs_in_the_autocast_dtype():
    q, k, v, cu, kwargs = make([3, 4], 2, 16, pos="shared")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = silu_attention(q, k, v, cu, **kwargs, backend="torch")
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and kwargs["position_bias"].grad.dtype == torch.float32


def test_autocast_leaves_the_reference_math_alone():
    """Under autocast the torch path computes from the autocast-dtype inputs as the kernels do (fp32 scores and
    sums), not with autocast's half matmuls inside the reference."""
    q, k, v, cu, kwargs = make([120, 80], 2, 32, pos="per-head", time="shared")
    half = [t.detach().half() for t in (q, k, v)]
    expected = silu_attention(*half, cu, **kwargs, backend="torch")
    with torch.autocast("cpu", dtype=torch.float16):
        out = silu_attention(q, k, v, cu, **kwargs, backend="torch")
    assert out.dtype == torch.float16
    assert torch.equal(out, expected)


# --------------------------------------------------------------------------- Triton under the interpreter

LENGTHS = [0, 1, 5, 17]
KERNEL_CASES = {
    "causal-d16": dict(d=16),
    "not-causal-d24": dict(d=24, causal=False),
    "targets-d16": dict(d=16, targets=[0, 1, 2, 5]),
    "targets-not-causal-d24": dict(d=24, targets=[0, 1, 5, 3], causal=False),
    "pos-shared-d16": dict(d=16, pos="shared"),
    "pos-per-head-not-causal-d24": dict(d=24, pos="per-head", causal=False),
    "time-shared-not-causal-d16": dict(d=16, time="shared", causal=False),
    "time-per-head-d24": dict(d=24, time="per-head"),
    "everything-d24": dict(d=24, pos="per-head", time="shared", targets=[0, 0, 3, 4], alpha=0.4, max_seqlen=23),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_triton_against_float64(name):
    case = dict(KERNEL_CASES[name])
    d, causal, alpha = case.pop("d"), case.pop("causal", True), case.pop("alpha", None)
    q, k, v, cu, kwargs = make(LENGTHS, 2, d, **case)
    with use_accelerators(fallback="error"):
        out = silu_attention(q, k, v, cu, **kwargs, causal=causal, alpha=alpha, backend="triton")
    ref = oracle(q, k, v, cu, kwargs, causal, alpha)
    check_all(out, ref, q, k, v, kwargs, RTOL_ATTENTION_FP32, gradient_tolerance(torch.float32, RTOL_ATTENTION_FP32))


def test_triton_fp16_long_sequence_bias_bands():
    """Sequences over several 32-row bands of the bias kernel (and several 64-row blocks), fp16."""
    q, k, v, cu, kwargs = make([70, 3, 130], 1, 16, torch.float16, pos="per-head", time="per-head", targets=[0, 1, 9])
    kwargs["position_bias"] = torch.randn(1, 150).requires_grad_()
    for causal in (True, False):
        with use_accelerators(fallback="error"):
            out = silu_attention(q, k, v, cu, **kwargs, causal=causal, backend="triton")
        ref = silu_attention_reference(*(x.double() for x in (q, k, v)), cu, kwargs["max_seqlen"], None, causal,
                                       kwargs["num_targets"], kwargs["position_bias"].double(),
                                       kwargs["time_bias"].double(), kwargs["timestamps"])  # fmt: skip
        check_all(out, ref, q, k, v, kwargs, RTOL[torch.float16], gradient_tolerance(torch.float16))


def test_triton_dropout_matches_the_rebuilt_mask():
    from runtime.accelerators.silu_attention import triton as kernels

    q, k, v, cu, kwargs = make(LENGTHS, 2, 16, pos="shared", time="per-head")
    p, seed = 0.3, torch.tensor([1234])
    h = 2
    starts = cu.tolist()

    def keep(s, head, i, j):
        bits = dropout.random_bits(1234, torch.tensor(s * h + head), torch.tensor(i), torch.tensor(j))
        return bool(bits >= dropout.keep_threshold(p))

    args = (cu, None, kwargs["position_bias"].expand(h, -1), kwargs["time_bias"], kwargs["timestamps"], seed,
            kwargs["max_seqlen"], 0.25, True, p)  # fmt: skip
    out = kernels.forward(q, k, v, *args)
    rate = dropout.drop_rate(p)
    ref = oracle(q, k, v, cu, kwargs, True, 0.25, keep, rate)
    assert_close("o", out, ref, RTOL_ATTENTION_FP32)
    do = torch.randn_like(out)
    dq, dk, dv, _, _, dpos, dtime, *_ = kernels.backward(do, q, k, v, *args)
    grads_ref = torch.autograd.grad(ref, (q, k, v, kwargs["position_bias"], kwargs["time_bias"]), do.double())
    for name, g, g_ref in zip(("dq", "dk", "dv", "dpos", "dtime"), (dq, dk, dv, dpos.sum(0), dtime), grads_ref):
        assert_close(name, g, g_ref, gradient_tolerance(torch.float32, RTOL_ATTENTION_FP32))
    assert starts[-1] == q.shape[0]


def test_public_dropout_runs_on_triton():
    q, k, v, cu, kwargs = make(LENGTHS, 2, 16)
    with use_accelerators(fallback="error"):
        out = silu_attention(q, k, v, cu, **kwargs, dropout_p=0.2, backend="triton")
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()


def test_bias_gradients_are_repeatable():
    q, k, v, cu, kwargs = make([17, 9], 2, 16, pos="shared", time="shared")
    grads = []
    for _ in range(2):
        out = silu_attention(q, k, v, cu, **kwargs, backend="triton")
        grads.append(torch.autograd.grad(out.sum(), (kwargs["position_bias"], kwargs["time_bias"])))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# --------------------------------------------------------------------------- dispatch and errors


def test_reasons_per_backend():
    q = torch.randn(4, 2, 16)
    assert input_reasons("triton", q=q) == []
    assert any("head dim 8" in r for r in input_reasons("triton", q=torch.randn(4, 2, 8)))
    assert any("head dim 160" in r for r in input_reasons("triton", q=torch.randn(4, 2, 160)))
    assert any("interpreter" in r for r in input_reasons("triton", q=q.bfloat16()))
    assert any("float32" in r for r in input_reasons("tilelang", q=q))
    # both kernel backends differentiate: requiring grad is no reason
    for backend in ("triton", "tilelang"):
        assert not any("requires grad" in r for r in input_reasons(backend, q=q.half().requires_grad_()))
    assert input_reasons("tilelang", q=q.half().requires_grad_()) == []
    assert input_reasons("triton") == []


def test_explain_names_the_op_and_its_reasons():
    q, k, v, _, _ = make([3, 4], 2, 16)
    text = explain("silu_attention", q=q, k=k, v=v, position_bias=None, time_bias=None, dropout_p=0.0)
    assert "silu_attention: configured 'auto' -> runs triton" in text
    assert "q has dtype float32; the tilelang kernels take bfloat16, float16" in text
    assert "forward-only" not in text  # tilelang has a backward: q requiring grad is no reason
    assert "silu_attention" in explain()


def test_explicit_tilelang_follows_the_fallback_rule():
    q, k, v, cu, kwargs = make([3, 4], 2, 16)
    with pytest.warns(RuntimeWarning, match="silu_attention: the tilelang backend cannot run"):
        out = silu_attention(q, k, v, cu, **kwargs, backend="tilelang")
    assert_close("o", out, oracle(q, k, v, cu, kwargs), 1e-6)
    with use_accelerators(fallback="error"), pytest.raises(BackendUnavailableError, match="silu_attention"):
        silu_attention(q, k, v, cu, **kwargs, backend="tilelang")
    assert SPEC.priority == ("tilelang", "triton")  # TileLang ran 2.2x faster than Triton on an H200


def _call(**changes):
    q, k, v, cu, kwargs = make([3, 4], 2, 16, pos="shared", time="shared", targets=[1, 2], grad=False)
    args = dict(q=q, k=k, v=v, cu_seqlens=cu) | kwargs | changes
    return silu_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu_seqlens"), **args, backend="torch")


ERRORS = {
    "q-2d": (dict(q=torch.randn(7, 16)), ValueError, "q: expected a 3-D tensor"),
    "q-int": (dict(q=torch.ones(7, 2, 16, dtype=torch.int64)), TypeError, "q: expected a floating-point"),
    "k-shape": (dict(k=torch.randn(7, 2, 8)), ValueError, "k: expected the shape of q"),
    "v-dtype": (dict(v=torch.randn(7, 2, 16, dtype=torch.float64)), TypeError, "v: expected dtype float32"),
    "cu-float": (dict(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), TypeError, "cu_seqlens: expected dtype int32"),
    "cu-2d": (dict(cu_seqlens=torch.tensor([[0, 3, 7]])), ValueError, "cu_seqlens: expected a 1-D"),
    "cu-start": (dict(cu_seqlens=torch.tensor([1, 3, 7])), ValueError, "cu_seqlens: .*rising from 0.*the first is 1"),
    "cu-end": (
        dict(cu_seqlens=torch.tensor([0, 3, 6])),
        ValueError,
        "cu_seqlens: .*total = q.shape.0. = 7; the last is 6",
    ),
    "cu-falling": (
        dict(cu_seqlens=torch.tensor([0, 5, 4, 7]), num_targets=None),
        ValueError,
        "cu_seqlens: expected non-decreasing",
    ),
    "max-seqlen-small": (
        dict(max_seqlen=3),
        ValueError,
        r"max_seqlen: expected at least the longest sequence's length \(4\), got 3",
    ),
    "max-seqlen-float": (dict(max_seqlen=4.0), TypeError, "max_seqlen: expected a non-negative int"),
    "targets-too-many": (
        dict(num_targets=torch.tensor([1, 5])),
        ValueError,
        "num_targets: expected at most each sequence's length",
    ),
    "targets-negative": (dict(num_targets=torch.tensor([-1, 0])), ValueError, "num_targets: expected counts >= 0"),
    "targets-shape": (dict(num_targets=torch.tensor([1, 1, 1])), ValueError, r"num_targets: expected shape \(2,\)"),
    "targets-float": (
        dict(num_targets=torch.tensor([1.0, 1.0])),
        TypeError,
        "num_targets: expected dtype int32 or int64",
    ),
    "timestamps-length": (dict(timestamps=torch.arange(6)), ValueError, r"timestamps: expected shape \(7,\)"),
    "timestamps-float": (dict(timestamps=torch.rand(7)), TypeError, "timestamps: expected dtype int32 or int64"),
    "time-bias-alone": (dict(timestamps=None), ValueError, "time_bias: given without timestamps"),
    "timestamps-alone": (dict(time_bias=None), ValueError, "timestamps: given without time_bias"),
    "pos-heads": (
        dict(position_bias=torch.randn(3, 7)),
        ValueError,
        r"position_bias: expected shape \[P\] or \[H, P\] = \[2, P\]",
    ),
    "pos-empty": (dict(position_bias=torch.randn(0)), ValueError, "position_bias: expected shape"),
    "time-3d": (dict(time_bias=torch.randn(2, 2, 5)), ValueError, "time_bias: expected shape"),
    "time-int": (dict(time_bias=torch.ones(5, dtype=torch.int64)), TypeError, "time_bias: expected a floating-point"),
    "alpha-str": (dict(alpha="0.1"), TypeError, "alpha: expected a finite float"),
    "alpha-nan": (dict(alpha=float("nan")), ValueError, "alpha: expected a finite float, got nan"),
    "alpha-inf": (dict(alpha=float("inf")), ValueError, "alpha: expected a finite float, got inf"),
    "dropout-bool": (dict(dropout_p=True), TypeError, "dropout_p: expected a dropout probability"),
    "dropout": (dict(dropout_p=1.0), ValueError, r"dropout_p: expected a dropout probability in \[0, 1\)"),
    "causal-str": (dict(causal="no"), TypeError, r"causal: expected a bool \(True or False\), got str 'no'"),
    "causal-none": (dict(causal=None), TypeError, r"causal: expected a bool \(True or False\), got NoneType"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_argument(name):
    changes, error, message = ERRORS[name]
    with pytest.raises(error, match=message):
        _call(**changes)


def test_value_checks_run_again_after_an_in_place_change():
    q, k, v, cu, kwargs = make([3, 4], 2, 16, grad=False)
    silu_attention(q, k, v, cu, **kwargs, backend="torch")
    cu[1] = 5
    with pytest.raises(ValueError, match="max_seqlen"):
        silu_attention(q, k, v, cu, **kwargs, backend="torch")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_value_checks_under_inference_mode(backend):
    # inference tensors have no version counter: the offsets and targets are checked on every call
    with torch.inference_mode():
        q, k, v, cu, kwargs = make([3, 4], 2, 16, targets=[1, 2], grad=False)
        out = silu_attention(q, k, v, cu, **kwargs, backend=backend)
        assert_close("o", out, oracle(q, k, v, cu, kwargs), RTOL_ATTENTION_FP32)
        kwargs["num_targets"][1] = 5
        with pytest.raises(ValueError, match="num_targets: expected at most each sequence's length"):
            silu_attention(q, k, v, cu, **kwargs, backend=backend)


def test_compiles_fullgraph_with_gradients():
    q, k, v, cu, kwargs = make([5, 0, 9], 2, 16, pos="shared", time="per-head", targets=[1, 0, 2])

    def step(q, k, v, pos, tb):
        args = dict(kwargs, position_bias=pos, time_bias=tb)
        return silu_attention(q, k, v, cu, **args, backend="triton")

    out = torch.compile(step, fullgraph=True)(q, k, v, kwargs["position_bias"], kwargs["time_bias"])
    ref = oracle(q, k, v, cu, kwargs)
    check_all(out, ref, q, k, v, kwargs, RTOL_ATTENTION_FP32, gradient_tolerance(torch.float32, RTOL_ATTENTION_FP32))


def test_a_call_without_targets_after_one_whose_targets_were_freed():
    # the checked-values memo held a weak reference to the last num_targets; once that tensor was freed the weak
    # reference returned None, which matched num_targets=None and then crashed reading None._version
    q, k, v, cu, kwargs = make([3, 4], 2, 16, targets=[1, 2], grad=False)
    silu_attention(q, k, v, cu, **kwargs, backend="torch")
    del kwargs["num_targets"]  # the targets tensor of the first call is freed here
    out = silu_attention(q, k, v, cu, **kwargs, backend="torch")
    assert_close("o", out, oracle(q, k, v, cu, kwargs), RTOL_ATTENTION_FP32)
