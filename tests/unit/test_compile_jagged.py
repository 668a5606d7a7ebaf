"""Ops under torch.compile on jagged batches. A rank-1 input's length (values, offsets, timestamps, cu_seqlens) is a
count that changes from batch to batch: the backend decision made while tracing must not specialise the graph on it
(a new total costs one dynamic recompile at most), and it must be the decision the eager call makes."""

import contextlib
import warnings

import pytest
import torch
import torch._dynamo.testing

import runtime.accelerators as acc
from runtime.accelerators import backends
from runtime.accelerators.backends import KERNEL_BACKENDS, REGISTRY, environment_reasons

TOTALS = (23, 31, 40)  # packed tokens of three batches of three sequences
H, D = 2, 16


def _cu_seqlens(total: int) -> torch.Tensor:
    return torch.tensor([0, 7, 7, total], dtype=torch.int32)


# embedding_bag_mean and the gated delta rule run forward only: their interpreted backward takes seconds a call
def _bags(total):
    return torch.randn(40, 8), torch.randint(0, 40, (total,)), _cu_seqlens(total)[:-1].long()


def _packed_heads(total):
    q, k, v = (torch.randn(total, H, D, requires_grad=True) for _ in range(3))
    return q, k, v, _cu_seqlens(total), total - 7  # the longest sequence changes with the total


def _silu_attention(backend, q, k, v, cu_seqlens, max_seqlen):
    timestamps = torch.arange(q.shape[0]) * 37
    # the torch reference branches on num_targets' values (no full graph): targets on the kernel backend only
    num_targets = None if backend == "torch" else torch.tensor([1, 0, 2], dtype=torch.int32)
    return acc.silu_attention(
        q, k, v, cu_seqlens, max_seqlen=max_seqlen, time_bias=torch.linspace(-1, 1, 6), timestamps=timestamps,
        num_targets=num_targets, backend=backend,
    )  # fmt: skip


def _varlen_attention(backend, q, k, v, cu_seqlens, max_seqlen):
    return acc.flash_attention(
        q, k, v, causal=True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, backend=backend,
    )  # fmt: skip


def _gdr_inputs(total):
    q, k = (torch.nn.functional.normalize(torch.randn(1, total, H, D), dim=-1) for _ in range(2))
    v = torch.randn(1, total, H, D)
    g, beta = torch.nn.functional.logsigmoid(torch.randn(1, total, H)), torch.rand(1, total, H)
    return q, k, v, g, beta, _cu_seqlens(total)


# case -> (inputs for a total, fn(backend, *inputs)); every call passes rank-1 inputs whose length is the total
CASES = {
    "embedding_bag_mean": (
        _bags,
        lambda backend, w, values, offsets: acc.embedding_bag_mean(w, values, offsets, 0, backend=backend),
    ),
    "silu_attention": (_packed_heads, _silu_attention),
    "flash_attention-varlen": (_packed_heads, _varlen_attention),
    "chunk_gated_delta_rule": (
        _gdr_inputs,
        lambda backend, *x: acc.chunk_gated_delta_rule(*x[:5], cu_seqlens=x[5], backend=backend)[0],
    ),
    "binary_cross_entropy_with_logits": (
        lambda total: (torch.randn(total, requires_grad=True), torch.rand(total)),
        lambda backend, x, y: acc.binary_cross_entropy_with_logits(x, y, reduction="none", backend=backend),
    ),
    "gelu": (lambda total: (torch.randn(total, requires_grad=True),), lambda backend, x: acc.gelu(x, backend=backend)),
}
# the torch references of these loop over the sequences, reading cu_seqlens on the host: no full graph
KERNEL_ONLY = ("flash_attention-varlen", "chunk_gated_delta_rule")


def _outputs_and_gradients(fn, inputs):
    out = fn(*inputs)
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not leaves:
        return (out,)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return (out, *torch.autograd.grad((out * weights).sum(), leaves))


@pytest.mark.parametrize(
    "case, backend",
    [(case, "triton") for case in CASES] + [(case, "torch") for case in CASES if case not in KERNEL_ONLY],
)
def test_new_totals_take_one_dynamic_recompile(case, backend):
    make_inputs, op = CASES[case]

    def fn(*inputs):
        return op(backend, *inputs)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    with acc.use_accelerators(fallback="error"):
        for total in TOTALS:
            torch.manual_seed(total)
            inputs = make_inputs(total)
            results, expected = _outputs_and_gradients(compiled, inputs), _outputs_and_gradients(fn, inputs)
            for i, (got, want) in enumerate(zip(results, expected)):
                torch.testing.assert_close(got, want, msg=lambda m, i=i, total=total: f"total {total}, result {i}: {m}")
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for the totals {TOTALS}"


# --------------------------------------------------------------------------- the decision under compile is the eager one


def _wide_norm():
    x = torch.randn(16385)  # one row wider than the norm kernels take: 1-D, its length is the row width
    acc.layer_norm(x, torch.ones(16385), torch.zeros(16385), backend="torch")


def _huge_elementwise():
    # on the meta device: more elements than the tilelang kernels index (2^31 - 2^16), 1-D and 2-D
    for shape in ((2**31,), (2**20, 2**11)):
        x = torch.empty(shape, device="meta")
        acc.gelu(x, backend="torch")
        acc.swiglu(x, x, backend="torch")
        acc.dropout_add(x, x, 0.1, training=False, backend="torch")
        acc.binary_cross_entropy_with_logits(x, x, reduction="none", backend="torch")


def _linear_1d():
    # 1-D x: K = 12, then 16; the weight's rows (the bias's length) 12: 12 is not a multiple of 8
    acc.linear(torch.randn(12).half(), torch.randn(12, 12).half(), torch.randn(12).half(), backend="torch")
    acc.linear(torch.randn(16).half(), torch.randn(12, 16).half(), torch.randn(12).half(), backend="torch")


def _strided_table():
    weight = torch.randn(8, 40).t()  # column stride 40
    acc.embedding_bag_mean(weight, torch.randint(0, 40, (9,)), torch.tensor([0, 4]), backend="torch")
    acc.embedding_bag_mean(torch.randn(80, 8)[::2], torch.randint(0, 40, (9,)), torch.tensor([0, 4]), backend="torch")


def _top_k_1d():
    scores = torch.empty(2**31, device="meta")  # a 1-D row wider than the kernels index
    with contextlib.suppress(RuntimeError):  # decided first; the reference's tie order cannot size this row on meta
        acc.top_k(scores, 3, backend="torch")


def _bf16_attention():
    # the Triton interpreter's bfloat16 dot products are wrong: a reason on the CPU (the device is read)
    q, k, v = (torch.randn(1, 2, 5, 16, dtype=torch.bfloat16) for _ in range(3))
    acc.flash_attention(q, k, v, backend="torch")
    acc.flash_attention(*(t[0].transpose(0, 1) for t in (q, k, v)), cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
                        cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32), max_seqlen_q=5, max_seqlen_k=5,
                        backend="torch")  # fmt: skip
    acc.silu_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                       torch.tensor([0, 5], dtype=torch.int32), max_seqlen=5, backend="torch")  # fmt: skip


CALLS = {
    "norm-1d": _wide_norm,
    "elementwise-huge": _huge_elementwise,
    "linear-1d": _linear_1d,
    "embedding_bag_mean-strided": _strided_table,
    "top_k-1d": _top_k_1d,
    "attention-bf16-cpu": _bf16_attention,
}


@pytest.fixture
def decisions(monkeypatch):
    """Every (spec, device, inputs) a decision is made from, as select_backend hands them over."""
    made = []
    decide = backends._decide_or_tune

    def recording(spec, requested, config, device, key, inputs):
        made.append((spec, device, inputs))
        return decide(spec, requested, config, device, key, inputs)

    backends.clear_decisions()
    monkeypatch.setattr(backends, "_decide_or_tune", recording)
    yield made
    backends.clear_decisions()


@pytest.mark.parametrize("call", sorted(CALLS))
def test_what_compiling_describes_gives_the_eager_reasons(call, decisions):
    """The reasons read from what _describe keeps (the stand-ins a decision under torch.compile sees) are the eager
    ones, for calls whose reasons read a rank-1 input's length, numel(), strides or the device."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        CALLS[call]()
    assert decisions
    for spec, device, inputs in decisions:
        stand_ins = backends._stand_ins(backends._describe(spec, inputs), device)
        for backend in KERNEL_BACKENDS:
            eager = spec.not_supported_reasons(backend, device, **inputs)
            assert spec.not_supported_reasons(backend, device, **stand_ins) == eager, (spec.name, backend)
    input_reasons = [
        spec.not_supported_reasons(backend, device, **inputs)[len(environment_reasons(backend, device)) :]
        for spec, device, inputs in decisions
        for backend in KERNEL_BACKENDS
    ]
    assert any(input_reasons), "each group holds a call that an input reason refuses"


def test_every_width_is_a_tensor_its_reasons_read():
    for spec in REGISTRY.values():
        assert set(spec.widths) <= spec.read_inputs, spec.name


@pytest.mark.parametrize("width", [16385, 64], ids=["refused", "accepted"])
def test_compiled_decision_on_a_1d_row_is_the_eager_one(width):
    """A norm of a 1-D x reads its length, the row width: compiled, the decision reads it too."""
    x, weight = torch.randn(width), torch.randn(width)

    def norm(x, weight):
        return acc.rms_norm(x, weight, backend="triton")

    torch._dynamo.reset()
    for run in (norm, torch.compile(norm, backend="aot_eager", fullgraph=True)):
        backends.clear_decisions()  # the fallback warns once per process: each run must warn
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run(x, weight)
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, acc.BackendFallbackWarning)]
        assert len(fallbacks) == (width > 16384), fallbacks
        assert all("the row width 16385 exceeds 16384" in message for message in fallbacks)
        torch.testing.assert_close(out, acc.rms_norm(x, weight, backend="torch"))


def test_compiled_decision_reads_the_device():
    """Eagerly a bfloat16 attention on the CPU does not run on the interpreter's triton (its bf16 dot products are
    wrong): compiled, the decision reads the device too, and falls back with the same warning."""
    q, k, v = (torch.randn(1, 2, 5, 16, dtype=torch.bfloat16) for _ in range(3))

    def attention(q, k, v):
        return acc.flash_attention(q, k, v, backend="triton")

    torch._dynamo.reset()
    backends.clear_decisions()  # warned once per process: both calls must warn
    with pytest.warns(acc.BackendFallbackWarning, match="bfloat16 on the CPU"):
        expected = attention(q, k, v)
    backends.clear_decisions()
    with pytest.warns(acc.BackendFallbackWarning, match="bfloat16 on the CPU"):
        out = torch.compile(attention, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(out, expected)
