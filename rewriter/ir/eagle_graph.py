"""Where an EAGLE draft layer sits in a graph: the one ``rw.eagle_layer`` node that
``passes.eagle_draft`` inserts and ``runtime.decoding.tree.eagle_rows`` runs."""
from __future__ import annotations

from typing import Optional

import torch

from rewriter.errors import PassError
from rewriter.ir.core import IR


def eagle_node(ir: IR) -> Optional[torch.fx.Node]:
    """The graph's one ``rw.eagle_layer`` node (None: none; ``PassError``: more than one)."""
    found = list(ir.graph.find_nodes(op="call_function", target=torch.ops.rw.eagle_layer.default))
    if len(found) > 1:
        raise PassError(f"the graph has {len(found)} EAGLE draft layers; a model drafts with one")
    return found[0] if found else None
