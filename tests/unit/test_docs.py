"""The docs' house rules, checked on the files as they are: page lengths, links that resolve, no diary entries, issue
numbers or commit ids in prose, and DESIGN.md's layout naming files that exist."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK_PAGES = sorted((ROOT / "docs" / "benchmark").glob("*.md"))
TUNING_PAGES = sorted((ROOT / "docs" / "tuning").glob("*.md"))
MARKDOWN = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "examples").rglob("*.md")),
    *sorted((ROOT / "tools").rglob("*.md")),
]
# what the rules cover: source, tests, tools, examples, configs and docs (results JSON excluded: generated data)
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".sh", ".cpp", ".c", ".h", ".toml"}
SCANNED = [
    path
    for folder in ("src", "tests", "tools", "examples", "configs", "docs")
    for path in sorted((ROOT / folder).rglob("*"))
    if path.is_file()
    and path.suffix in TEXT_SUFFIXES
    and "results" not in path.relative_to(ROOT).parts
    and path != Path(__file__).resolve()  # its own patterns
] + [ROOT / "README.md"]

LIMITS = [(BENCHMARK_PAGES, 200), (TUNING_PAGES, 150), ([ROOT / "README.md"], 150)]

# numbered diary entries, issue numbers, names of whoever did the work
FORBIDDEN = {
    "numbered diary entry": re.compile(r"\b(?:[Ss]ession|[Ss]top)\s+\d+\b"),
    "issue number": re.compile(r"(?<![\w&/#])#\d{1,5}(?![\w])|\b[Ii]ssues?\s+#?\d+(?![\w-])"),
    "name of whoever did the work": re.compile(r"\b(?:Claude|ChatGPT|Copilot|[Ss]ub-?agents?|[Aa]gents?)\b"),
}
# a commit id: 7 to 40 hex digits with at least one letter and one digit
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
DATED_HEADING = re.compile(r"^#+ .*\b(?:20\d\d|\d{1,2} (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec))", re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The hand-written prose of a page: without the generated results section, fenced or indented code blocks and
    inline code (commands there may name a commit to check out)."""
    text = re.sub(r"<!-- results:.*?<!-- /results -->", "", text, flags=re.S)
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return re.sub(r"`[^`\n]*`", "", text)


@pytest.mark.parametrize(
    "path, limit", [(path, limit) for paths, limit in LIMITS for path in paths], ids=lambda v: getattr(v, "name", v)
)
def test_doc_page_line_limit(path, limit):
    lines = len(path.read_text().splitlines())
    assert lines <= limit, f"{_rel(path)}: {lines} lines, at most {limit}"


def test_doc_links_resolve():
    broken = []
    for page in MARKDOWN:
        text = page.read_text()
        for match in LINK.finditer(text):
            target = match.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{_rel(page)}:{text.count(chr(10), 0, match.start()) + 1}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_doc_benchmark_pages_one_plot_each():
    for page in BENCHMARK_PAGES:
        if page.name in ("index.md", "gpu-tests.md"):
            continue
        plots = re.findall(r"!\[[^\]]*\]\([^)]+\.png\)", page.read_text())
        assert len(plots) == 1, f"{_rel(page)}: {len(plots)} plots, one expected"


def test_doc_no_dated_sections_or_commit_ids_in_prose():
    found = []
    for page in [*BENCHMARK_PAGES, *TUNING_PAGES, ROOT / "README.md"]:
        text = page.read_text()
        found += [f"{_rel(page)}: dated heading {m.group(0)!r}" for m in DATED_HEADING.finditer(text)]
        found += [f"{_rel(page)}: commit id {m.group(0)} in prose" for m in COMMIT.finditer(_prose(text))]
    assert not found, "\n".join(found)


def test_doc_no_diary_entries_issue_numbers_or_names():
    found = []
    for path in SCANNED:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                match = pattern.search(line)
                if match:
                    found.append(f"{_rel(path)}:{number}: {what}: {match.group(0)!r}")
    assert not found, "\n".join(found)


def _layout_paths(design: str) -> list[str]:
    """The paths DESIGN.md's layout block names, each relative to the folder it sits in."""
    block = design.split("## Layout", 1)[1].split("\n\n", 2)[1]
    paths, folders = [], []  # folders: (indent, path) of the enclosing folders
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        names = re.match(r"\s*([\w./<>_-]+(?:, [\w./_-]+)*)\s{2,}", line + "  ")
        if not names:
            continue
        head = names.group(1)
        if not re.search(r"[./]", head) and not head.endswith("/"):
            continue  # a continuation line of a description
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else ""
        paths += [parent + name for name in head.split(", ") if "<" not in parent + name]
        if head.endswith("/") and "," not in head:
            folders.append((indent, parent + head))
    return paths


def test_doc_design_layout_names_existing_files():
    design = ROOT / "docs" / "DESIGN.md"
    if not design.exists():
        pytest.skip("no docs/DESIGN.md")
    text = design.read_text()
    paths = _layout_paths(text)
    assert len(paths) > 20, paths  # the parser found the layout
    missing = [path for path in paths if not (ROOT / path).exists()]
    # files named in the prose as folder/file.py under the accelerators package or the repository root
    for name in sorted(set(re.findall(r"(?<![\w./~-])(?:\w+/)+\w+\.(?:py|yaml|json)\b", text))):
        if "foo" in name:
            continue  # the "adding an op" walk-through
        candidates = [ROOT / name, ROOT / "src" / "runtime" / name, ROOT / "src" / "runtime" / "accelerators" / name]
        if not any(candidate.exists() for candidate in candidates):
            missing.append(name)
    assert not missing, f"DESIGN.md names files that do not exist: {missing}"


def test_doc_design_names_every_op_folder():
    design = ROOT / "docs" / "DESIGN.md"
    if not design.exists():
        pytest.skip("no docs/DESIGN.md")
    text = design.read_text()
    package = ROOT / "src" / "runtime" / "accelerators"
    folders = sorted(path.parent.name for path in package.glob("*/reference.py"))
    assert folders
    unnamed = [name for name in folders if not re.search(rf"\b{name}\b", text)]
    assert not unnamed, f"op folders DESIGN.md does not name: {unnamed}"
    for name in folders:  # the files the layout promises in every op folder
        missing = [
            f for f in ("__init__.py", "reference.py", "triton.py", "tilelang.py") if not (package / name / f).exists()
        ]
        assert not missing, f"accelerators/{name}/ lacks {missing}"
