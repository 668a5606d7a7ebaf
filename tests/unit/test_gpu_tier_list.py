"""tools/gpu_tier.txt, the whole GPU tier as one process per line, names every test file of tests/gpu and nothing
else: a new file is not left out of the tier's run, a renamed one does not fail it."""

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tier_lines() -> list[str]:
    text = (ROOT / "tools" / "gpu_tier.txt").read_text()
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_every_gpu_test_file_is_in_the_tier_list():
    listed = {shlex.split(line)[0] for line in tier_lines()}
    files = {f"tests/gpu/{p.name}" for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert files - listed == set(), "files missing from tools/gpu_tier.txt"
    assert listed - files == set(), "tools/gpu_tier.txt names files that do not exist"


def test_a_split_file_covers_its_tests_once():
    """A file split with -k is run twice: with a selection X and with "not X" (or "not (X)"), so that every test
    runs exactly once."""
    parts: dict[str, list[str]] = {}
    for line in tier_lines():
        words = shlex.split(line)
        parts.setdefault(words[0], []).append(words[words.index("-k") + 1] if "-k" in words else "")
    for path, selections in parts.items():
        if len(selections) == 1:
            assert selections == [""], path
            continue
        assert len(selections) == 2, (path, selections)
        chosen, other = sorted(selections, key=lambda s: s.startswith("not "))
        assert other in (f"not {chosen}", f"not ({chosen})"), (path, selections)
