"""The Triton norms' backward launch, described once (backward_launch): the C++ node (native_forward) is handed the
launch the eager backward runs, with its stand-ins where the backward-time tensors go, and its positional arguments
are the kernel's non-constexpr parameters in order, as the node passes them."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from runtime.accelerators.launch_plan import LaunchPlan
from runtime.accelerators.native import GRAD, GRAD_OF, OUTPUT

WIDTH = 16


class Recorder:
    """Stands in for a module's NativeBackward: records the launch it is handed and attaches nothing."""

    def __init__(self) -> None:
        self.launches: list[LaunchPlan] = []

    def plan(self, output_dtype, inputs, launch: LaunchPlan):
        self.launches.append(launch)
        return None


def handed_and_run(monkeypatch, op: str, native_args: tuple, backward) -> tuple[LaunchPlan, LaunchPlan, tuple]:
    """(the launch native_forward hands its node, the launch backward runs, backward's results)."""
    module = importlib.import_module(f"runtime.accelerators.{op}.triton")
    recorder = Recorder()
    assert module.native_forward(*native_args, native=recorder) is None
    ran = []
    monkeypatch.setattr(LaunchPlan, "run", lambda launch: ran.append(launch))
    results = backward(module, recorder.launches[0])
    (handed,) = recorder.launches
    (run,) = ran
    return handed, run, results


def assert_same_launch(handed: LaunchPlan, run: LaunchPlan, stand_ins: list) -> None:
    """handed is run with each tensor of `stand_ins` ([(tensor or None, its stand-in)]) replaced by its stand-in."""
    by_id = {id(tensor): stand_in for tensor, stand_in in stand_ins if tensor is not None}
    expected = [by_id.get(id(arg), arg) for arg in run.args]
    assert len(handed.args) == len(expected)
    for got, want in zip(handed.args, expected):
        assert got is want or (not isinstance(want, torch.Tensor) and got == want), (got, want)
    assert (handed.kernel, handed.grid, handed.constexprs) == (run.kernel, run.grid, run.constexprs)
    assert [id(t) for t in handed.scratch] == [id(t) for t in run.scratch]
    assert handed.after == () == run.after
    parameters = inspect.signature(handed.kernel.kernel.fn).parameters.values()
    runtime_parameters = [p.name for p in parameters if p.annotation != "tl.constexpr"]
    assert len(handed.args) == len(runtime_parameters)
    assert set(handed.constexprs) - {"num_warps"} == {p.name for p in parameters} - set(runtime_parameters)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm(monkeypatch, with_weight):
    x, dy = torch.randn(6, WIDTH), torch.randn(6, WIDTH)
    weight = torch.randn(WIDTH) if with_weight else None
    handed, run, (dx, dweight, _) = handed_and_run(
        monkeypatch,
        "rms_norm",
        (x, weight, 1e-6),
        # args[4]: the rstd native_forward's forward writes and the node saves
        lambda module, handed: module.backward(dy, x, weight, 1e-6, None, handed.args[4]),
    )
    stand_ins = [(dy, GRAD), (dx, GRAD_OF[0]), (dweight, GRAD_OF[1])]
    assert_same_launch(handed, run, stand_ins)


@pytest.mark.parametrize("with_weight, with_bias", [(True, True), (True, False), (False, True), (False, False)])
def test_layer_norm(monkeypatch, with_weight, with_bias):
    x, dy = torch.randn(6, WIDTH), torch.randn(6, WIDTH)
    weight = torch.randn(WIDTH) if with_weight else None
    bias = torch.randn(WIDTH) if with_bias else None
    handed, run, (dx, dweight, dbias, _) = handed_and_run(
        monkeypatch,
        "layer_norm",
        (x, weight, bias, 1e-5),
        # args[3], args[4]: the mean and rstd native_forward's forward writes and the node saves
        lambda module, handed: module.backward(dy, x, weight, bias, 1e-5, None, handed.args[3], handed.args[4]),
    )
    stand_ins = [(dy, GRAD), (dx, GRAD_OF[0]), (dweight, GRAD_OF[1]), (dbias, GRAD_OF[2])]
    assert_same_launch(handed, run, stand_ins)


def test_l2norm(monkeypatch):
    x, dy, y = torch.randn(6, WIDTH), torch.randn(6, WIDTH), torch.randn(6, WIDTH)

    def backward(module, handed: LaunchPlan):
        rstd = handed.args[4]  # the buffer native_forward's forward writes and the node saves
        return module.backward(dy, x, 1e-6, y, rstd)

    handed, run, (dx, _) = handed_and_run(monkeypatch, "l2norm", (x, 1e-6), backward)
    assert_same_launch(handed, run, [(dy, GRAD), (y, OUTPUT), (dx, GRAD_OF[0])])


class Attacher(Recorder):
    """A Recorder whose plans attach: records each attach (output, inputs, launch) and attaches nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.attached: list = []

    def plan(self, output_dtype, inputs, launch: LaunchPlan):
        super().plan(output_dtype, inputs, launch)
        return "plan"

    def attach(self, plan, output, inputs, launch: LaunchPlan) -> bool:
        self.attached.append((output, inputs, launch))
        return True


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_the_node_holds_the_statistics_forward_wrote(op):
    """native_forward's launch reads the buffers its forward writes the statistics into (the node saves them with
    its other tensor arguments): fp32, one per row, the statistics forward returns, bit for bit; y is forward's."""
    module = importlib.import_module(f"runtime.accelerators.{op}.triton")
    x = torch.randn(3, 5, WIDTH).transpose(0, 1)  # rows that are not a view: the forward's copy is what both read
    args = (x, torch.randn(WIDTH), *((torch.randn(WIDTH),) if op == "layer_norm" else ()), 1e-5)
    attacher = Attacher()
    y = module.native_forward(*args, native=attacher)
    ((output, inputs, launch),) = attacher.attached
    assert output is y and launch is attacher.launches[0]
    assert all(a is b for a, b in zip(inputs, args[:-1], strict=True))
    y_forward, *stats = module.forward(*args)
    handed = launch.args[3:5] if op == "layer_norm" else launch.args[4:5]
    assert len(handed) == len(stats)
    for got, want in zip(handed, stats):
        assert got.dtype == torch.float32 and got.shape == (15,)
        assert torch.equal(got, want)
    assert torch.equal(y, y_forward)
