"""Check the package's layering with import-linter (the contracts in pyproject.toml).

The user's layout keeps ``passes/``, ``codegen/`` and ``runtime/`` beside ``rewriter/`` and maps
them into the ``rewriter`` namespace (pyproject.toml's package-dir). grimp finds a package's
modules by walking its directory, so it would not see those three: this script builds a view,
a temporary ``rewriter/`` whose entries are links to the real files plus links named
``passes``, ``codegen`` and ``runtime``, and runs ``lint-imports`` with the view first on
the path. Function-level imports count: grimp reads every import statement.

    python tools/lint_imports.py            # exit status 0 when every contract holds
    python tools/lint_imports.py --view DIR # build the view in DIR and keep it
    python tools/lint_imports.py --root DIR # check another checkout (its own pyproject.toml)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = ("passes", "codegen", "runtime")  # top-level folders imported as rewriter.<name>


def build_view(into: Path, root: Path = ROOT) -> Path:
    """``into``/rewriter: links to ``root``/rewriter/'s entries and to the mapped folders."""
    package = into / "rewriter"
    package.mkdir(parents=True)
    for entry in (root / "rewriter").iterdir():
        if entry.name in MAPPED:
            raise ValueError(f"rewriter/{entry.name} hides the top-level {entry.name}/ folder")
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in MAPPED:
        (package / name).symlink_to(root / name)
    return into


def lint(view: Path, root: Path = ROOT) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(view), os.environ.get("PYTHONPATH")])))
    # The contracts live in pyproject.toml; grimp's cache would be written into the view.
    command = ["lint-imports", str(root / "pyproject.toml"), "--no-cache"]
    return subprocess.run(command, env=env, cwd=view).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--view", type=Path, help="build the view here (an absent folder) and keep it")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to check (default: this one)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.view is not None:
        return lint(build_view(args.view, root), root)
    with tempfile.TemporaryDirectory(prefix="rewriter-lint-") as tmp:
        return lint(build_view(Path(tmp), root), root)


if __name__ == "__main__":
    sys.exit(main())
