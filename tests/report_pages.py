"""What the two report tools (runtime.benchmark.report, runtime.training.report) share in their tests."""

import pytest

from runtime.benchmark import pages


def assert_bad_result_keeps_page(main, generator: str, tmp_path, content: str, expected: str) -> None:
    """main(r.json --page page) with r.json holding `content` stops naming the file (`expected`) and leaves the
    page's figures as they were."""
    (tmp_path / "r.json").write_text(content)
    page = tmp_path / "page.md"
    page.write_text(f"# page\n\n{pages.begin_marker(generator)}\nold figures\n{pages.END}\n")
    with pytest.raises(SystemExit, match=expected):
        main([str(tmp_path / "r.json"), "--page", str(page)])
    assert "old figures" in page.read_text()
