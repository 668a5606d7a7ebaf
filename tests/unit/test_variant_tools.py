"""The GPU variant tools' parts that run on the CPU: the shared timing helper's failure rows, and each tool's
variants computing what they claim (the Triton ones under the interpreter) at small sizes."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import linear_backward_pieces  # noqa: E402
import sampling_select_filter  # noqa: E402
import variant_timing  # noqa: E402


def test_a_variant_that_fails_or_misses_its_check_is_a_row_not_a_stop(capsys):
    def broken():
        raise RuntimeError("no kernel image")

    assert variant_timing.time_variant("case", "broken", broken) is None
    assert variant_timing.time_variant("case", "wrong", lambda: 1, check=lambda result: f"got {result}") is None
    rows = capsys.readouterr().out.splitlines()
    assert rows == ["| case | broken | failed: RuntimeError: no kernel image | |", "| case | wrong | got 1 | |"]


def relative_rms(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((mine.float() - theirs.float()).norm() / theirs.float().norm()).item()


def test_linear_backward_pieces_agree_with_torch_autograd():
    pieces = linear_backward_pieces.pieces(96, 64, 256, torch.device("cpu"))
    ours = pieces["ours: whole backward"]()
    eager = pieces["torch: whole backward (autograd)"]()
    for name, mine, theirs in zip(("dx", "dweight", "dbias"), ours, eager):
        assert relative_rms(mine, theirs) < 1e-2, name
    torch_dz, torch_dbias = pieces["torch: gelu backward + dbias sum"]()
    for label, piece in pieces.items():
        if label.startswith("ours: elementwise pass"):
            dz, dbias = piece()
            assert relative_rms(dz, torch_dz) < 1e-2 and relative_rms(dbias, torch_dbias) < 1e-2, label


def test_sampling_filter_tool_triton_variants_give_torch_topk_values():
    x = torch.randn(2, 3000)
    expected = torch.topk(x, 20, dim=-1).values.sort(dim=-1).values
    triton_variants = {label: fn for label, fn in sampling_select_filter.variants().items() if "tilelang" not in label}
    assert len(triton_variants) == 10
    for label, fn in triton_variants.items():
        assert sampling_select_filter._check(expected, fn(x, 20)) is None, label
