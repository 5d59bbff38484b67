"""The layering in pyproject.toml's import-linter contracts holds, and breaks on an upward import."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = ROOT / "tools" / "lint_imports.py"

pytest.importorskip("importlinter")


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LINT), "--root", str(root)], capture_output=True, text=True)


def test_the_contracts_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]


def test_an_upward_import_inside_a_function_breaks_them(tmp_path):
    skip = shutil.ignore_patterns("__pycache__", "assets")
    for name in ("rewriter", "passes", "codegen", "runtime"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "passes" / "planted.py").write_text(
        "def run():\n    from rewriter.runtime import engine\n    return engine\n")
    result = lint(tmp_path)
    assert result.returncode == 1
    assert "rewriter.passes.planted -> rewriter.runtime.engine" in result.stdout
