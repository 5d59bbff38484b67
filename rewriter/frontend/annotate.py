"""Layer structure: which decoder layer and role each node belongs to, and where the
residual stream enters and leaves every layer.

Per node, ``meta["layer"]`` (int, absent outside layers), ``meta["role"]`` (``embed``,
``rope_table``, ``norm``, ``attn``, ``mlp``, ``residual``, ``head``, ``other``) and
``meta["pass"]`` (the pass that made it: ``trace``, ``lift``, or a pass name).
The layer spans (``rewriter.ir.layers``) are derived from these marks.
"""
from __future__ import annotations

from torch import fx

from rewriter.frontend.regions import scope_classes, scope_of


def annotate(gm: fx.GraphModule, prefix: str, layer_container: str | None) -> None:
    for n in gm.graph.nodes:
        n.meta.setdefault("pass", "trace")
        if n.op != "call_function":
            continue
        path, cls = scope_of(n, prefix)
        layer = _layer_of(path, layer_container)
        if layer is not None:
            n.meta["layer"] = layer
        n.meta["role"] = _role(n, path, cls, layer, layer_container)


def _layer_of(path: str, container: str | None) -> int | None:
    if container and path.startswith(container + "."):
        head = path[len(container) + 1:].split(".")[0]
        if head.isdigit():
            return int(head)
    return None


def _role(n: fx.Node, path: str, cls: str, layer: int | None, container: str | None) -> str:
    classes = scope_classes(n)
    if any(c.endswith("RotaryEmbedding") for c in classes):
        return "rope_table"
    if "Norm" in cls:
        return "norm"
    if any(c.endswith("Attention") for c in classes):
        return "attn"
    if any("MLP" in c for c in classes):
        return "mlp"
    if layer is not None:
        return "residual" if path.count(".") == (container or "").count(".") + 1 else "other"
    if cls == "Embedding" or "embed" in path.rsplit(".", 1)[-1]:
        return "embed"
    if path.endswith("lm_head"):
        return "head"
    return "other"
