"""Measured "auto" on the GPU: one measurement per shape class, the decisions file, the caller's gradients and random
numbers untouched, and a choice within 5% of the fastest backend by the benchmark's GPU time."""

import json

import pytest
import torch

import runtime.accelerators as acc
from runtime.accelerators import autotune, backends
from runtime.accelerators.rms_norm import SPEC as RMS_SPEC
from runtime.accelerators.rms_norm.reference import rms_norm_reference
from runtime.accelerators.testing import relative_rms_error
from runtime.benchmark import timing
from runtime.benchmark.cli import all_cases

CUDA = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TAAC_CACHE", str(tmp_path))
    monkeypatch.delenv("TAAC_AUTOTUNE", raising=False)
    backends.clear_decisions()
    return tmp_path


def _tables(op: str) -> list[autotune.Tuned]:
    return [d for key, d in backends._decisions.items() if key[0] == op and isinstance(d, autotune.Tuned)]


def _never(run) -> float:
    raise AssertionError("measured again")


def _need_two_backends(spec, **inputs):
    candidates, skipped = spec.auto_candidates(CUDA, **inputs)
    if len(candidates) < 2:
        pytest.skip(f"fewer than two kernel backends can run here, nothing to measure: {skipped}")


def test_auto_measures_rms_norm_once_per_shape_class_and_writes_the_cache(cache_dir):
    x = torch.randn(8192, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(128, device=CUDA, dtype=torch.bfloat16)).requires_grad_()
    _need_two_backends(RMS_SPEC, x=x, weight=w)
    y = acc.rms_norm(x, w)
    assert x.grad is None and w.grad is None  # the trials' backward passes went to their own leaves
    (tuned,) = _tables("rms_norm")
    ((shape, chosen),) = tuned.table.items()
    path = cache_dir / "autotune.json"
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["shape"] == "rms_norm(width 128, numel 2^20 2^7) fwd+bwd" and entry["winner"] == chosen
    assert set(entry["times_ms"]) == set(tuned.candidates) and not entry["failed"], entry
    assert all(0 < ms < 10 for ms in entry["times_ms"].values()), entry
    print(entry["times_ms"], "->", chosen)

    # the caller's call ran once, on the chosen backend, with the right output and gradients
    dy = torch.randn_like(y)
    y.backward(dy)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = rms_norm_reference(xd, wd, 1e-6)
    ref.backward(dy.double())
    assert relative_rms_error(y, ref) < 1e-2
    assert relative_rms_error(x.grad, xd.grad) < 2e-2 and relative_rms_error(w.grad, wd.grad) < 2e-2

    tuned.timer = _never  # later calls of the class are a lookup
    for rows in (8192, 8000, 5000):
        acc.rms_norm(torch.randn(rows, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True), w).sum().backward()
    assert tuned.table == {shape: chosen}

    backends.clear_decisions()  # a new process: the file decides, nothing is measured or written
    written = path.stat().st_mtime_ns
    acc.rms_norm(x, w)
    (tuned,) = _tables("rms_norm")
    assert tuned.table == {shape: chosen} and path.stat().st_mtime_ns == written


def test_trials_leave_the_callers_random_numbers_alone(cache_dir):
    x, residual = (torch.randn(4096, 256, device=CUDA, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    from runtime.accelerators.dropout_add import SPEC

    _need_two_backends(SPEC, x=x, residual=residual)
    state = torch.cuda.get_rng_state(CUDA)
    measured = acc.dropout_add(x, residual, 0.25)  # measures, then runs the winner
    after = torch.cuda.get_rng_state(CUDA)
    ((_, winner),) = _tables("dropout_add")[0].table.items()
    torch.cuda.set_rng_state(state, CUDA)
    again = acc.dropout_add(x, residual, 0.25, backend=winner)  # the same draws as if nothing had been measured
    assert torch.equal(after, torch.cuda.get_rng_state(CUDA))
    assert torch.equal(measured, again)


ROWS = [("rms_norm", "8192x128"), ("layer_norm", "8192x128"), ("swiglu", "8192x4096")]


@pytest.mark.parametrize("op,shape", ROWS, ids=[f"{op}-{shape}" for op, shape in ROWS])
def test_auto_choice_is_within_5_percent_of_the_fastest_by_benchmark_gpu_time(cache_dir, op, shape):
    case = next(c for c in all_cases()[op] if c.shape == shape)
    inputs = case.make_inputs(CUDA, torch.bfloat16)
    grad_out = torch.randn_like(case.run("auto", inputs))  # fwd+bwd class: the inputs require gradients
    tables = _tables(op)
    if not tables:
        pytest.skip(f"{op}: fewer than two kernel backends can run here, nothing to measure")
    ((_, chosen),) = tables[0].table.items()
    times, captured = {}, {}
    for backend in tables[0].candidates:
        # leaves of its own per backend: a leaf whose gradient accumulator was made on another stream (by an earlier
        # call whose graph is still alive) made autograd break the capture, and eager host time was compared instead
        timed = {k: v.detach().requires_grad_(v.requires_grad) if torch.is_tensor(v) else v for k, v in inputs.items()}
        leaves = [v for v in timed.values() if torch.is_tensor(v) and v.requires_grad]
        run = lambda backend=backend, timed=timed, leaves=leaves: torch.autograd.grad(  # noqa: E731
            case.run(backend, timed), leaves, grad_out
        )
        stats, captured[backend] = timing.gpu_time_ms(run, CUDA)
        times[backend] = stats["median"]
    (entry,) = autotune.measured_entries(op, CUDA)
    print(op, shape, "benchmark GPU ms", times, "captured", captured, "auto measured", entry["times_ms"], "->", chosen)
    assert all(captured.values()), ("timed without a CUDA graph", captured, times)
    assert times[chosen] <= 1.05 * min(times.values()), (chosen, times, "captured", captured, entry["times_ms"])


def _bf16(*shape, scale=1.0):
    return (scale * torch.randn(*shape, device=CUDA)).to(torch.bfloat16).requires_grad_()


def _mhc_inputs():
    n, C, m = 4, 64, 4 * 4 + 2 * 4
    return {"x": _bf16(256, n, C), "phi": _bf16(n * C, m, scale=(n * C) ** -0.5),
            "alpha": torch.tensor([0.8, 1.1, 1.3], device=CUDA).to(torch.bfloat16).requires_grad_(), "bias": _bf16(m, scale=0.3)}  # fmt: skip


# op (config key) -> a training call of each public function through "auto", from the arguments the trials replay
CALLS = {
    "l2norm": lambda: acc.l2norm(_bf16(4096, 64)),
    "add_norm": lambda: acc.add_rms_norm(_bf16(4096, 64), _bf16(4096, 64), _bf16(64)),
    "activation": lambda: acc.gelu(_bf16(4096, 256), approximate="tanh"),
    "bce_with_logits": lambda: acc.binary_cross_entropy_with_logits(  # check_targets syncs: timed without a graph
        _bf16(65536), torch.rand(65536, device=CUDA, dtype=torch.bfloat16), check_targets=True
    ),
    "embedding_bag_mean": lambda: acc.embedding_bag_mean(
        _bf16(1000, 64), torch.randint(0, 1000, (256, 8), device=CUDA)
    ),
    "flash_attention": lambda: acc.flash_attention(
        _bf16(8, 4, 257, 64),
        _bf16(8, 4, 257, 64),
        _bf16(8, 4, 257, 64),
        causal=True,
        key_lengths=torch.randint(1, 258, (8,), device=CUDA),
    ),
    "gated_delta_rule": lambda: acc.chunk_gated_delta_rule(
        _bf16(4, 256, 4, 32),
        _bf16(4, 256, 4, 32),
        _bf16(4, 256, 4, 32),
        torch.nn.functional.logsigmoid(torch.randn(4, 256, 4, device=CUDA) + 2).to(torch.bfloat16).requires_grad_(),
        torch.rand(4, 256, 4, device=CUDA, dtype=torch.bfloat16).requires_grad_(),
        use_qk_l2norm_in_kernel=True,
    ),
    "mhc": lambda: acc.mhc_pre(**_mhc_inputs()),
}


@pytest.mark.parametrize("op", sorted(CALLS))
def test_every_op_replays_its_call_on_each_backend_without_a_failed_trial(cache_dir, op):
    """The arguments each op passes select_backend let the trials run the call on every candidate backend (a wrong or
    missing one would exclude backends, logged, and leave "auto" on torch)."""
    CALLS[op]()
    tables = _tables(op)
    if not tables:
        pytest.skip(f"{op}: fewer than two kernel backends can run here, nothing to measure")
    (entry,) = autotune.measured_entries(op, CUDA)
    print(op, entry["shape"], entry["times_ms"], "->", entry["winner"])
    assert not entry["failed"], entry["failed"]
    assert set(entry["times_ms"]) == set(tables[0].candidates) and entry["winner"] in tables[0].candidates
