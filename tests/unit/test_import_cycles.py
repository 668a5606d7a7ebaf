"""No import cycles among the modules of src/runtime (tools/import_cycles.py), and the tool finds one where it is."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
import_cycles = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_cycles)


def test_src_runtime_has_no_import_cycles(capsys):
    assert import_cycles.main([str(ROOT / "src" / "runtime")]) == 0, capsys.readouterr().out


def test_a_cycle_through_a_deferred_import_is_found(tmp_path, capsys):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (package / "c.py").write_text("from . import a\n")  # imports into the cycle, not part of it
    assert import_cycles.main([str(package)]) == 1
    assert "import cycle: pkg.a, pkg.sub.b" in capsys.readouterr().out
