"""IR dumps: after every pass, the IR as text, as Graphviz DOT, and what the pass changed.

    dumps/00_lift.txt   00_lift.dot   00_lift.diff.txt
    dumps/01_LayerSkip.txt ...
    dumps/summary.json  # per pass: node counts by op, added and removed
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import networkx as nx
from torch import fx

from rewriter.files import safe_files
from rewriter.errors import RewriterError
from rewriter.ir.printer import format_call, format_type
from rewriter.ops import short_name


def to_networkx(gm: fx.GraphModule) -> nx.DiGraph:
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            continue
        label = n.name if n.op != "call_function" else f"{n.name}\\n{short_name(n.target)}"
        typ = format_type(n.meta.get("val"), n.meta.get("shape"))
        g.add_node(n.name, label=f'"{label}\\n{typ}"', shape="box",
                   tooltip=f'"{format_call(n) if n.op == "call_function" else n.op}"'.replace("%", ""),
                   group=str(n.meta.get("layer", "")))
        for a in n.all_input_nodes:
            if a.op != "get_attr":
                g.add_edge(a.name, n.name)
    return g


def op_diff(before: dict[str, int], after: dict[str, int]) -> dict[str, dict[str, int]]:
    """Per op: ``{"added": n}`` or ``{"removed": n}`` where the count changed."""
    out = {}
    for op in sorted(set(before) | set(after)):
        delta = after.get(op, 0) - before.get(op, 0)
        if delta:
            out[op] = {"added": delta} if delta > 0 else {"removed": -delta}
    return out


class Dumper:
    """Writes one set of files per pass into ``directory``; keeps the summary.

    Files are written only inside ``directory``: each through a new temporary file
    (created exclusively, never through a link) renamed onto its name, so a symlink
    planted in the directory is replaced, not written through, and a reader never sees
    half a file. Subdirectories that are symlinks are refused.
    """

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RewriterError(f"{self.dir}: cannot create the dump directory ({e.strerror or e})") from e
        self.steps: list[dict] = []
        self.prev: dict[str, int] = {}

    def write(self, name: str, ir) -> None:
        stem = f"{len(self.steps):02d}_{name}"
        counts = ir.op_counts()
        diff = op_diff(self.prev, counts)
        self.write_text(f"{stem}.txt", str(ir) + "\n")
        dot = nx.nx_pydot.to_pydot(to_networkx(ir.gm)).to_string()
        self.write_text(f"{stem}.dot", dot)
        lines = [f"{op}: {'+' if 'added' in d else '-'}{d.get('added', d.get('removed'))}"
                 for op, d in diff.items()]
        self.write_text(f"{stem}.diff.txt",
                        f"# {name}: nodes added/removed by op\n" + "\n".join(lines or ["(no change)"]) + "\n")
        self.steps.append({"pass": name, "file": stem, "ops": counts, "diff": diff,
                           "layers": [s["index"] for s in ir.layers]})
        self.prev = counts
        self.write_text("summary.json", json.dumps(self.steps, indent=2) + "\n")

    def write_text(self, relpath: str, text: str) -> None:
        """Any file of the dump (e.g. ``kernels/<name>.py``): ``relpath`` is relative, with
        no ``..``; its subdirectories are created, and must not be symlinks."""
        parts = relpath.split("/")
        if relpath.startswith("/") or not all(safe_files.is_plain_name(p) for p in parts):
            raise ValueError(f"dump file {relpath!r}: must be a relative path without '..'")
        try:
            root = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                sub = safe_files.make_dirs(parts[:-1], root)
            finally:
                os.close(root)
            try:
                safe_files.replace_file(parts[-1], text.encode(), sub)
            finally:
                os.close(sub)
        except OSError as e:
            raise RewriterError(f"{self.dir / relpath}: cannot write the dump file "
                                f"({e.strerror or e}; a symlink or a file where a directory "
                                f"should be?)") from e
