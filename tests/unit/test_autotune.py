"""Measured "auto" (autotune.py): shape classes, trials, the decisions file, the switches, explain().

No GPU here: the timer is a fake passed to the measuring code (it runs each trial once, so the real kernels run under
TRITON_INTERPRET=1, and returns the times a test chooses), the device is the CPU, and "torch" stands in for a
second kernel backend where a measurement needs two that can run.
"""

import json
import logging
import tempfile
import threading

import pytest
import torch

import runtime.accelerators as acc
from runtime.accelerators import autotune, backends
from runtime.accelerators.__main__ import main as cli_main
from runtime.accelerators.autotune import DecisionFile, Tuned, describe_shape, shape_class
from runtime.accelerators.norms import norm_key
from runtime.accelerators.rms_norm import SPEC as RMS_SPEC

CPU = torch.device("cpu")


class FakeTimer:
    """Runs each trial once (so it must work) and answers the next of `times` (ms), one per candidate measured."""

    def __init__(self, *times: float):
        self.times = list(times)
        self.calls = 0

    def __call__(self, run) -> float:
        run()
        self.calls += 1
        return self.times[(self.calls - 1) % len(self.times)]


def _never_called(run) -> float:
    raise AssertionError("measured again: the decision should have come from the file or the table")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TAAC_CACHE", str(tmp_path))
    monkeypatch.delenv("TAAC_AUTOTUNE", raising=False)
    autotune.forget()
    return tmp_path


def _rms_inputs(rows=37, width=48, grad=True):
    x = torch.randn(rows, width, requires_grad=grad)
    w = (1 + 0.1 * torch.randn(width)).requires_grad_(grad)
    return {"x": x, "weight": w, "eps": 1e-6}


def _tuned(timer, file, candidates=("triton", "torch"), **kw):
    return Tuned(
        "rms_norm", norm_key(torch.empty(1, 1)), CPU, candidates, static="triton", timer=timer, file=file, **kw
    )


# --------------------------------------------------------------------------- shape classes


def test_shape_class_folds_leading_dims_and_rounds_sizes_up_to_powers_of_two():
    def cls(*shape, grad=False):
        return shape_class(acc.rms_norm, {"x": torch.empty(*shape, requires_grad=grad), "eps": 1e-6})

    assert cls(4, 1000, 128) == cls(2, 2000, 128) == cls(4096, 128) == cls(3000, 128)  # 4000, 4000, 4096, 3000 rows
    assert cls(4096, 100) == cls(4096, 128)  # widths 65..128 share one class
    assert cls(4097, 128) != cls(4096, 128)
    assert cls(4096, 129) != cls(4096, 128)
    assert cls(2048, 256) != cls(4096, 128)  # the same numel, another width
    assert cls(4096, 128, grad=True) != cls(4096, 128)  # training calls decide apart from inference ones
    with torch.no_grad():
        assert cls(4096, 128, grad=True) == cls(4096, 128)  # no gradient under no_grad: not training
    assert shape_class(acc.gelu, {"x": torch.empty(8, 8)}) != shape_class(acc.silu, {"x": torch.empty(8, 8)})
    assert cls(0, 128)[3] == -1  # an empty tensor has a class of its own (never measured)
    x, w = torch.empty(8000, 128, requires_grad=True), torch.empty(128)
    assert (
        describe_shape(shape_class(acc.rms_norm, {"x": x, "weight": w, "eps": 1e-6}))
        == "rms_norm(width 128, numel 2^20 2^7) fwd+bwd"
    )


# --------------------------------------------------------------------------- measuring and the table


def test_first_call_per_shape_class_measures_and_later_calls_reuse_the_decision(cache_dir):
    timer = FakeTimer(2.0, 1.0, 1.0, 3.0)  # first class: triton 2 ms, torch 1 ms; second: triton 1 ms, torch 3 ms
    tuned = _tuned(timer, DecisionFile(cache_dir / "autotune.json"))
    inputs = _rms_inputs()
    assert tuned.choose(acc.rms_norm, inputs) == "torch"
    assert timer.calls == 2  # one trial per candidate
    for rows in (37, 40, 42, 22):  # the same class (1025 to 2048 elements): no new measurement
        assert tuned.choose(acc.rms_norm, _rms_inputs(rows)) == "torch"
    assert timer.calls == 2
    assert tuned.choose(acc.rms_norm, _rms_inputs(65)) == "triton"  # a new class measures
    assert timer.calls == 4
    assert inputs["x"].grad is None and inputs["weight"].grad is None  # the trials left the caller's .grad alone


def test_trial_of_a_training_call_runs_forward_and_backward_on_detached_inputs():
    inputs = _rms_inputs()
    ran = []

    def call(x, weight, eps, backend):
        ran.append((backend, x is inputs["x"], x.requires_grad))
        return acc.rms_norm(x, weight, eps, backend=backend)

    run = autotune.trial(call, inputs, "triton", trains=True)
    run()
    run()
    assert ran == [("triton", False, True)] * 2
    assert inputs["x"].grad is None
    with torch.no_grad():
        autotune.trial(call, inputs, "triton", trains=False)()
    assert ran[-1] == ("triton", False, False)


def test_measure_excludes_a_backend_whose_trial_fails_and_logs_why(caplog):
    def call(x, backend):
        if backend == "triton":
            raise RuntimeError("the kernel failed to compile")
        return x * 2

    with caplog.at_level(logging.WARNING, logger="runtime.accelerators"):
        times, failed = autotune.measure(call, {"x": torch.randn(4)}, ("triton", "torch"), CPU, timer=FakeTimer(1.0))
    assert list(times) == ["torch"] and failed == {"triton": "RuntimeError: the kernel failed to compile"}
    assert "triton failed its trial and is excluded: RuntimeError: the kernel failed to compile" in caplog.text


def test_every_trial_failing_chooses_torch_without_raising(cache_dir):
    def call(x, weight, eps, backend):
        raise RuntimeError(f"{backend} is broken")

    path = cache_dir / "autotune.json"
    tuned = _tuned(FakeTimer(1.0), DecisionFile(path), candidates=("triton", "tilelang"))
    assert tuned.choose(call, _rms_inputs()) == "torch"
    assert not path.exists()  # not kept across processes: the next one measures again


def test_trials_leave_the_random_number_generator_where_it_was():
    x, residual = torch.randn(64, 32), torch.randn(64, 32)
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    times, failed = autotune.measure(
        acc.dropout_add, {"x": x, "residual": residual, "p": 0.5, "training": True}, ("triton", "torch"), CPU,
        timer=FakeTimer(1.0, 2.0),
    )  # fmt: skip
    assert not failed and len(times) == 2
    torch.testing.assert_close(torch.rand(3), expected)


# --------------------------------------------------------------------------- the decisions file


def test_decisions_round_trip_through_the_file_into_a_new_process(cache_dir):
    path = cache_dir / "autotune.json"
    inputs = _rms_inputs()
    assert _tuned(FakeTimer(2.0, 1.0), DecisionFile(path)).choose(acc.rms_norm, inputs) == "torch"
    data = json.loads(path.read_text())
    (entry,) = data["entries"].values()
    assert (
        entry["winner"] == "torch" and entry["times_ms"] == {"triton": 2.0, "torch": 1.0} and entry["op"] == "rms_norm"
    )
    assert entry["shape"] == "rms_norm(width 64, numel 2^11 2^6) fwd+bwd" and entry["device"] == "cpu"
    assert entry["torch"] == torch.__version__ and entry["failed"] == {}
    assert not list(cache_dir.glob("*.tmp"))  # written to a temporary file, then renamed over
    # a new process: nothing in memory, the file decides and nothing is measured
    assert _tuned(_never_called, DecisionFile(path)).choose(acc.rms_norm, inputs) == "torch"
    # the process-wide file ($TAAC_CACHE/autotune.json), read again after forget() (clear_decisions calls it)
    backends.clear_decisions()
    assert autotune.decision_file().path == path
    assert _tuned(_never_called, None).choose(acc.rms_norm, inputs) == "torch"


def test_a_file_from_another_gpu_or_library_version_does_not_decide(cache_dir):
    path = cache_dir / "autotune.json"
    _tuned(FakeTimer(2.0, 1.0), DecisionFile(path)).choose(acc.rms_norm, _rms_inputs())
    data = json.loads(path.read_text())
    ((key, entry),) = data["entries"].items()
    del data["entries"][key]
    data["entries"][key.replace(f"torch {torch.__version__}", "torch 0.0")] = {**entry, "torch": "0.0"}
    path.write_text(json.dumps(data))
    timer = FakeTimer(1.0, 2.0)
    assert _tuned(timer, DecisionFile(path)).choose(acc.rms_norm, _rms_inputs()) == "triton"
    assert timer.calls == 2


def test_a_corrupt_file_is_ignored_with_a_warning_and_rewritten(cache_dir):
    path = cache_dir / "autotune.json"
    path.write_text('{"format": 1, "entries": {')
    timer = FakeTimer(1.0, 2.0)
    with pytest.warns(RuntimeWarning, match="ignoring the corrupt decisions file .*autotune.json"):
        assert _tuned(timer, DecisionFile(path)).choose(acc.rms_norm, _rms_inputs()) == "triton"
    assert timer.calls == 2
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["winner"] == "triton"


@pytest.mark.parametrize(
    "content", [b"\xff\xfe\x00 not text", b"[" * 100_000], ids=["not utf-8", "nested past the recursion limit"]
)
def test_an_undecodable_file_is_ignored_with_a_warning(cache_dir, content):
    path = cache_dir / "autotune.json"
    path.write_bytes(content)
    timer = FakeTimer(1.0, 2.0)
    with pytest.warns(RuntimeWarning, match="ignoring the corrupt decisions file"):
        assert _tuned(timer, DecisionFile(path)).choose(acc.rms_norm, _rms_inputs()) == "triton"
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["winner"] == "triton"


def test_a_file_that_cannot_be_read_is_not_overwritten(cache_dir, monkeypatch, caplog):
    path = cache_dir / "autotune.json"
    _tuned(FakeTimer(2.0, 1.0), DecisionFile(path)).choose(acc.rms_norm, _rms_inputs(37))
    kept = path.read_bytes()
    read_bytes = type(path).read_bytes

    def unreadable(self):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self)

    monkeypatch.setattr(type(path), "read_bytes", unreadable)
    timer = FakeTimer(1.0, 2.0)
    with pytest.warns(RuntimeWarning, match="cannot read"), caplog.at_level(logging.WARNING, "runtime.accelerators"):
        assert _tuned(timer, DecisionFile(path)).choose(acc.rms_norm, _rms_inputs(300)) == "triton"
    assert timer.calls == 2  # measured, and the decision holds for this process
    assert "cannot read" in caplog.text and "left as it is" in caplog.text
    monkeypatch.undo()
    assert path.read_bytes() == kept  # the decisions another run measured are still there


def test_without_a_home_directory_the_file_lives_in_the_temporary_folder(monkeypatch):
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("TAAC_CACHE", raising=False)
    monkeypatch.setattr(autotune.Path, "home", staticmethod(no_home))
    with pytest.warns(RuntimeWarning, match="no home directory"):
        path = autotune.default_path()
    assert path == autotune.Path(tempfile.gettempdir()) / "taac-runtime" / "autotune.json"


def test_writes_merge_with_what_another_process_wrote(cache_dir):
    path = cache_dir / "autotune.json"
    first, second = DecisionFile(path), DecisionFile(path)
    first.entries(), second.entries()  # both read the empty file
    _tuned(FakeTimer(2.0, 1.0), first).choose(acc.rms_norm, _rms_inputs(37))
    _tuned(FakeTimer(1.0, 2.0), second).choose(acc.rms_norm, _rms_inputs(300))
    winners = sorted(e["winner"] for e in json.loads(path.read_text())["entries"].values())
    assert winners == ["torch", "triton"]


def test_two_writers_at_once_keep_both_decisions(cache_dir, monkeypatch):
    """The second writer reads and writes while the first is between its reading and its rename: without a lock
    around the read-merge-rename, the first renames over the second's decision."""
    path = cache_dir / "autotune.json"
    first, second = DecisionFile(path), DecisionFile(path)
    entry = {"winner": "torch", "times_ms": {"torch": 1.0}}
    replace, racer = autotune.os.replace, []

    def replace_after_the_other_writer(src, dst):
        if not racer:
            racer.append(threading.Thread(target=second.put, args=("b", entry)))
            racer[0].start()
            racer[0].join(timeout=0.5)  # with a lock it waits for this write to finish
        replace(src, dst)

    monkeypatch.setattr(autotune.os, "replace", replace_after_the_other_writer)
    first.put("a", entry)
    racer[0].join(timeout=10)
    assert not racer[0].is_alive()
    assert sorted(json.loads(path.read_text())["entries"]) == ["a", "b"]


# --------------------------------------------------------------------------- when "auto" does not measure


def test_autotune_off_by_config_or_environment(monkeypatch):
    monkeypatch.delenv("TAAC_AUTOTUNE", raising=False)
    assert autotune.off_reason(acc.AcceleratorConfig()) is None
    assert (
        autotune.off_reason(acc.AcceleratorConfig(autotune=False)) == "autotuning is off (accelerators.autotune=false)"
    )
    for value in ("0", "false", "OFF"):
        monkeypatch.setenv("TAAC_AUTOTUNE", value)
        assert autotune.off_reason(acc.AcceleratorConfig()) == f"autotuning is off (TAAC_AUTOTUNE={value})"
    monkeypatch.setenv("TAAC_AUTOTUNE", "1")
    assert autotune.off_reason(acc.AcceleratorConfig()) is None
    with pytest.raises(TypeError, match="accelerators.autotune: expected true or false, got 'no'"):
        acc.AcceleratorConfig(autotune="no")
    with acc.use_accelerators(autotune=False):
        assert acc.active_config().autotune is False
    assert acc.AcceleratorConfig.from_mapping({"autotune": False}).autotune is False


def test_autotune_is_a_key_of_the_hydra_accelerators_group():
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from runtime.training.config import accelerator_config, config_dir

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        assert accelerator_config(compose("train").accelerators).autotune is True
        assert (
            accelerator_config(compose("train", overrides=["accelerators.autotune=false"]).accelerators).autotune
            is False
        )
        with pytest.raises(ConfigCompositionException) as error:
            compose("train", overrides=["accelerators.autotune=maybe"])
    assert "autotune" in str(error.value.__cause__ or error.value)


def test_autotune_off_keeps_the_static_decision_on_cuda(monkeypatch):
    # a CUDA device where both kernel backends can run (its capability passed here): the decision is a table
    # of measurements with autotuning on, the static priority's choice with it off
    monkeypatch.delenv("TAAC_AUTOTUNE", raising=False)
    cuda, hopper = torch.device("cuda", 0), (9, 0)
    x = torch.empty(4, 8)
    decide = lambda config: backends._decide_or_tune(
        RMS_SPEC, "auto", config, cuda, norm_key(x), {"x": x, "weight": None}, hopper
    )  # noqa: E731
    assert isinstance(decide(acc.AcceleratorConfig()), Tuned)
    assert decide(acc.AcceleratorConfig(autotune=False)) == "triton"
    monkeypatch.setenv("TAAC_AUTOTUNE", "0")
    assert decide(acc.AcceleratorConfig()) == "triton"
    monkeypatch.delenv("TAAC_AUTOTUNE")
    assert (
        backends._decide_or_tune(RMS_SPEC, "tilelang", acc.AcceleratorConfig(), cuda, norm_key(x), {"x": x}, hopper)
        == "tilelang"
    )
    # an older GPU: the tilelang backend's reason names its capability
    turing = (7, 5)
    with pytest.raises(acc.BackendUnavailableError, match="compute capability 7.5 is below 8.0"):
        backends._decide_or_tune(
            RMS_SPEC, "tilelang", acc.AcceleratorConfig(fallback="error"), cuda, norm_key(x), {"x": x}, turing
        )
    assert backends._decide_or_tune(RMS_SPEC, "auto", acc.AcceleratorConfig(), CPU, norm_key(x), {"x": x}) == "triton"


def test_no_measurement_while_a_graph_is_captured(cache_dir):
    path = cache_dir / "autotune.json"
    capturing = [True]
    timer = FakeTimer(2.0, 1.0)
    tuned = _tuned(timer, DecisionFile(path), capturing=lambda: capturing[0])
    assert tuned.choose(acc.rms_norm, _rms_inputs()) == "triton"  # the static decision
    assert timer.calls == 0 and not path.exists()
    capturing[0] = False
    assert tuned.choose(acc.rms_norm, _rms_inputs()) == "torch"  # measured once out of capture
    capturing[0] = True
    assert tuned.choose(acc.rms_norm, _rms_inputs()) == "torch" and timer.calls == 2  # the table answers in capture
    # a new process capturing first takes the file's decision
    assert (
        _tuned(_never_called, DecisionFile(path), capturing=lambda: True).choose(acc.rms_norm, _rms_inputs()) == "torch"
    )


def test_no_measurement_while_compiling_and_the_table_serves_eager_calls(cache_dir):
    timer = FakeTimer(2.0, 1.0)
    x, w = torch.randn(37, 48), torch.randn(48)
    # the table select_backend keeps for a measured op (on CUDA), placed for this CPU key
    backends.place_decision("rms_norm", norm_key(x, w), CPU, _tuned(timer, DecisionFile(cache_dir / "autotune.json")))
    torch.testing.assert_close(acc.rms_norm(x, w), acc.rms_norm(x, w, backend="torch"))
    assert timer.calls == 2
    for rows in (40, 42):  # the same class
        acc.rms_norm(torch.randn(rows, 48), w)
    assert timer.calls == 2
    compiled = torch.compile(lambda x: acc.rms_norm(x, w), backend="aot_eager", fullgraph=True)
    y = torch.randn(300, 48)  # a class not measured yet
    torch.testing.assert_close(compiled(y), acc.rms_norm(y, w, backend="torch"), rtol=1e-5, atol=1e-5)
    assert timer.calls == 2


def test_a_call_that_runs_no_kernel_is_not_measured(cache_dir):
    timer = FakeTimer(1.0)
    tuned = Tuned(
        "dropout_add",
        None,
        CPU,
        ("triton", "torch"),
        static="triton",
        timer=timer,
        file=DecisionFile(cache_dir / "a.json"),
    )
    x = torch.randn(8, 8)
    assert (
        tuned.choose(None, {"x": x, "residual": x, "p": 0.0, "training": True}) == "triton"
    )  # dropout_add passes None
    assert tuned.choose(acc.rms_norm, _rms_inputs(rows=0)) == "triton"  # an empty tensor
    assert timer.calls == 0


# --------------------------------------------------------------------------- explain


def test_explain_shows_versions_measured_times_and_winners_else_the_static_reason(cache_dir):
    text = acc.explain("rms_norm")
    assert f"torch {torch.__version__}, triton " in text and "tilelang " in text and "GPU: none" in text
    assert "  auto: static priority (tensors on cpu; measuring needs CUDA)" in text
    assert "measured" not in text.replace("measuring", "")
    _tuned(FakeTimer(2.0, 1.0), None).choose(acc.rms_norm, _rms_inputs())  # into $TAAC_CACHE/autotune.json
    text = acc.explain("rms_norm")
    assert (
        "  measured rms_norm(width 64, numel 2^11 2^6) fwd+bwd (torch.float32, False, None, None): torch 1.0000 ms, triton 2.0000 ms -> torch"
        in text
    )
    assert "measured" not in acc.explain("layer_norm").replace("measuring", "")


def test_entries_of_the_wrong_shape_are_skipped_by_explain_and_auto(cache_dir):
    path = cache_dir / "autotune.json"
    _tuned(FakeTimer(2.0, 1.0), None).choose(acc.rms_norm, _rms_inputs())
    data = json.loads(path.read_text())
    (key, good), bad = next(iter(data["entries"].items())), {}
    for field, value in [("times_ms", {"torch": "fast"}), ("failed", ["triton"]), ("shape", 7), ("key", None)]:
        bad[f"{key} {field}"] = {**good, field: value}
    path.write_text(json.dumps({**data, "entries": {**data["entries"], **bad}}))
    autotune.forget()
    text = acc.explain("rms_norm")
    assert text.count("  measured ") == 1 and "torch 1.0000 ms, triton 2.0000 ms -> torch" in text
    assert list(autotune.decision_file().entries()) == [key]


def test_cli_prints_the_report(cache_dir, capsys):
    cli_main(["--op", "swiglu", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "swiglu: configured 'auto'" in out and "GPU: none" in out and "auto: static priority" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--op", "nope"], "argument --op: unknown op 'nope'; expected one of "),
        (["--device", "bogus"], "argument --device: 'bogus' is not a device"),
        (["--device", "cuda:x"], "argument --device: 'cuda:x' is not a device"),
    ],
)
def test_cli_names_the_bad_argument_without_a_traceback(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cli_on_a_cuda_device_without_cuda_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["--device", "cuda"])
    assert exit_.value.code == 2 and "argument --device: CUDA is not available here" in capsys.readouterr().err
