"""Direct launches (accelerators/triton_launch.py): the signature key, the launch arguments and their rules.

The direct path itself only runs on a GPU (tests/gpu/test_triton_launch.py); here a stand-in for a compiled kernel
records what a direct launch hands Triton's launcher. Every kernel launch of the CPU tier checks the argument rules.
"""

from __future__ import annotations

import pytest
import torch

from runtime.accelerators import triton_launch
from runtime.accelerators.triton_launch import DirectLaunch, _arg_key, _int_key, _signature


def test_the_key_separates_everything_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(base) == _arg_key(torch.ones(64, dtype=torch.float32))
    assert _arg_key(base) != _arg_key(base[1:])  # 4 bytes off the 16-byte alignment
    assert _arg_key(base) != _arg_key(base.to(torch.bfloat16))
    assert _arg_key(base[4:]) == _arg_key(base)  # 16 bytes on: still aligned
    assert _arg_key(17) == _arg_key(33)
    for a, b in [(1, 17), (16, 17), (2**31 - 16, 2**31), (-(2**31), -(2**31) - 16), (2**63 - 16, 2**63), (True, 1)]:
        assert _arg_key(a) != _arg_key(b), (a, b)
    assert _arg_key(0.5) == _arg_key(2.0) != _arg_key(2)
    assert _arg_key(None) != _arg_key(0)


def test_the_inline_signature_agrees_with_the_key_of_each_argument():
    base = torch.zeros(64, dtype=torch.float32)
    args = (base, base[1:], base.to(torch.float16), torch.nn.Parameter(base), 0, 1, 17, 32, -16, 2**31 - 1, 2**31,
            -(2**31), -(2**31) - 1, 2**63 - 1, 2**63, True, False, 0.5, None)  # fmt: skip
    assert _signature(args) == [_arg_key(a) for a in args]
    assert _signature((1,)) != _signature((True,)) and _signature((16,)) != _signature((16.0,))


def test_int_keys_are_remembered_up_to_a_bound():
    ints = (1, 17, 32, 2**31, 2**31 + 1, 2**63, -16)
    known: dict[int, int] = {}
    first = [_int_key(a, known, 4) for a in ints]
    assert list(known) == list(ints[:4])
    assert [_int_key(a, known, 4) for a in ints] == first == [_arg_key(a) for a in ints] == _signature(ints)
    assert first[2] == first[6] and len(set(first)) == len(first) - 1  # 32 and -16 alike, the others not


class _Compiled:
    function, packed_metadata = "function", (4, 1, 0)

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid)


def _kernel_source(x, n, BLOCK: "tl.constexpr", FLAG: "tl.constexpr"):  # noqa: F821  (the text Triton reads)
    pass


class _Kernel:
    """Stands in for a JITFunction: kernel[grid](...) compiles, launches and returns the compiled kernel."""

    fn = staticmethod(_kernel_source)

    def __init__(self):
        self.compiled, self.calls = _Compiled(), []

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.calls.append((grid, args, constexprs))
            return self.compiled

        return launch


@pytest.fixture
def direct():
    kernel = _Kernel()
    launcher = DirectLaunch(kernel)
    launcher.direct = True  # what a JITFunction gets (this stand-in is not one)
    with triton_launch.stand_in_driver(device=0, stream=1234):
        yield kernel, launcher


def test_first_call_per_signature_goes_through_triton_then_launches_directly(direct):
    kernel, launcher = direct
    x = torch.zeros(32)
    launcher[(5,)](x, 100, BLOCK=64, FLAG=True, num_warps=4)
    assert len(kernel.calls) == 1 and kernel.compiled.launches == []
    launcher[(7, 2)](x, 200, BLOCK=64, FLAG=True, num_warps=4)
    assert len(kernel.calls) == 1
    # grid padded to 3-D, the current stream, no launch metadata without hooks, constexprs after the arguments
    (launch,) = kernel.compiled.launches
    assert launch[:9] == (7, 2, 1, 1234, "function", (4, 1, 0), None, None, None)  # no empty hook chains either
    assert launch[9] is x and launch[10:] == (200, 64, True)


def test_a_new_signature_or_constexpr_goes_through_triton_again(direct):
    kernel, launcher = direct
    x = torch.zeros(32)
    launcher[(1,)](x, 100, BLOCK=64, FLAG=True)
    launcher[(1,)](x[1:], 100, BLOCK=64, FLAG=True)  # misaligned
    launcher[(1,)](x, 100, BLOCK=128, FLAG=True)
    launcher[(1,)](x, 100, BLOCK=64, FLAG=True, num_warps=8)
    launcher[(1,)](x, 1, BLOCK=64, FLAG=True)
    assert len(kernel.calls) == 5 and kernel.compiled.launches == []


class CudaLauncher:
    """Stands in for Triton 3.6's launcher: a Python __call__ that adds four arguments and calls the C `launch`."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.launches, self.calls = [], 0

    def launch(self, *args):
        self.launches.append(args)

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *args):
        self.calls += 1
        flags = self.launch_cooperative_grid, self.launch_pdl
        self.launch(grid_x, grid_y, grid_z, stream, function, *flags, None, None, *args)


@pytest.mark.parametrize("version, scratch", [("3.6.0", 0), ("3.6.0", 128), ("3.9.0", 0)])
def test_triton_36_launcher_is_called_past_its_python_layer(direct, monkeypatch, version, scratch):
    """Only Triton 3.6.0's CudaLauncher without scratch memory is skipped to its C launch, with the same arguments."""
    kernel, launcher = direct
    monkeypatch.setattr(triton_launch.triton, "__version__", version)
    run = CudaLauncher()
    run.global_scratch_size = scratch
    monkeypatch.setattr(kernel.compiled, "run", run, raising=False)
    x = torch.zeros(32)
    for _ in range(2):
        launcher[(3,)](x, 100, BLOCK=64, FLAG=False)
    (launch,) = run.launches
    assert launch[:9] == (3, 1, 1, 1234, "function", False, True, None, None)  # the flags, no scratch memory
    assert launch[9:13] == ((4, 1, 0), None, None, None) and launch[13] is x and launch[14:] == (100, 64, False)
    assert run.calls == (0 if (version, scratch) == ("3.6.0", 0) else 1)


def test_launch_hooks_get_their_metadata(direct, monkeypatch):
    kernel, launcher = direct
    seen = []
    hooks = triton_launch.triton.knobs.runtime
    monkeypatch.setattr(hooks, "launch_enter_hook", seen.append)
    x = torch.zeros(32)
    for _ in range(2):
        launcher[(3,)](x, 100, BLOCK=64, FLAG=False)
    (launch,) = kernel.compiled.launches
    assert launch[6] == ("metadata", (3,)) and launch[7] == seen.append


@pytest.mark.parametrize("interpreted", [False, True])
def test_arguments_the_key_cannot_hold_are_refused_by_name(direct, interpreted):
    kernel, launcher = direct
    launcher.direct = not interpreted
    x = torch.zeros(32)
    with pytest.raises(TypeError, match=r"missing: \['FLAG'\]"):
        launcher[(1,)](x, 100, BLOCK=64)
    with pytest.raises(TypeError, match=r"constexprs \['BLOCK'\] by position"):
        launcher[(1,)](x, 100, 64, FLAG=True)
    with pytest.raises(TypeError, match=r"runtime arguments \['n'\] by name"):
        launcher[(1,)](x, n=100, BLOCK=64, FLAG=True)
    with pytest.raises(TypeError, match="BLCOK"):
        launcher[(1,)](x, 100, BLCOK=64, BLOCK=64, FLAG=True)
    assert kernel.calls == []


def test_stand_in_launches_take_the_direct_path_and_restore_the_launch_on_exit():
    kernel = _Kernel()
    launcher = DirectLaunch(kernel)
    launcher.direct = False  # as under TRITON_INTERPRET=1
    with triton_launch.stand_in_launches([launcher], stream=99):
        assert launcher.direct and launcher.kernel is not kernel
        x = torch.zeros(32)
        first = launcher[(3,)](x, 100, BLOCK=64, FLAG=True)
        assert launcher[(3,)](x, 200, BLOCK=64, FLAG=True) is first  # compiled once, then launched directly
        with pytest.raises(TypeError, match="constexprs missing"):  # the argument rules hold
            launcher[(3,)](x, 100, BLOCK=64)
    assert launcher.kernel is kernel and not launcher.direct and kernel.calls == []
    launcher[(3,)](x, 100, BLOCK=64, FLAG=True)
    assert len(kernel.calls) == 1
