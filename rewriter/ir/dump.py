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

from ..ops import short_name
from .printer import format_call, format_type


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
    """Writes one set of files per pass into ``directory``; keeps the summary."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.steps: list[dict] = []
        self.prev: dict[str, int] = {}

    def write(self, name: str, ir) -> None:
        stem = f"{len(self.steps):02d}_{name}"
        counts = ir.op_counts()
        diff = op_diff(self.prev, counts)
        _write_text(self.dir / f"{stem}.txt", str(ir) + "\n")
        dot = nx.nx_pydot.to_pydot(to_networkx(ir.gm)).to_string()
        _write_text(self.dir / f"{stem}.dot", dot)
        lines = [f"{op}: {'+' if 'added' in d else '-'}{d.get('added', d.get('removed'))}"
                 for op, d in diff.items()]
        _write_text(self.dir / f"{stem}.diff.txt",
                    f"# {name}: nodes added/removed by op\n" + "\n".join(lines or ["(no change)"]) + "\n")
        self.steps.append({"pass": name, "file": stem, "ops": counts, "diff": diff,
                           "layers": [s["index"] for s in ir.layers]})
        self.prev = counts
        _write_text(self.dir / "summary.json", json.dumps(self.steps, indent=2) + "\n")

    def write_text(self, relpath: str, text: str) -> None:
        """Any other file of the dump (e.g. ``kernels/<name>.py``)."""
        path = self.dir / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_text(path, text)


def _write_text(path: Path, text: str) -> None:
    """Write through a temporary file so a reader never sees half a dump."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
