"""Quest: at decode, each layer reads only the cache pages whose keys could score highest.

``Quest(page=16, budget=256, dense_layers=2)`` inserts, before every attention but the
first ``dense_layers`` ones, ``rw.select_pages`` on that layer's own (rotated) q and k:
the keys are cut into pages of ``page`` tokens, each bounded by its per-channel minimum and
maximum key, and a query keeps the ``budget // page`` pages with the largest upper bound
of ``q·k`` (the largest over its KV head's query group, so a group reads one set of pages).
With ``recent=R`` the R tokens just before the query are always read as well (a local
window beside the pages, which next-token prediction leans on; the pages are chosen among
the keys before it). The attention gets the selection as its ``select`` input, as
TidalDecode's later layers do, and attends to those tokens and the current one.

The KV-cache runtime keeps the whole cache and, beside it, each page's bounds, updated as
keys are written (``runtime.page_selection``); it selects at decode only (a prompt is
attended densely, as Quest does), so a decode step reads the bounds and ``budget`` tokens
per KV head instead of the whole cache. The whole-sequence graph selects at every position,
so it is the reference for decode steps. A layer reading another's cache (``ShareKV``)
selects its own pages, by its own queries, from its owner's pages and bounds, and stays
dense when its owner does. A model's local layers (Gemma 3's sliding-window layers beside
its global ones) are left as they are and do not count among ``dense_layers``: Quest
selects on the global layers (``whole_cache.local_layers``). Other windows, sink caches,
TidalDecode and speculative strategies are refused beside it, and it runs before
``FuseRoPE`` (it reads rotated keys).
A selection is ``budget + recent`` tokens wide, at most the model's context length.
"""
from __future__ import annotations

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ops import OPS
from rewriter.ir.pass_manager import Pass
from rewriter.ir.nodes import attention_args
from rewriter.ir.sharing import cache_of
from rewriter.passes.whole_cache import (attention_nodes, check_not_speculative,
                                         check_whole, local_layers)
from rewriter.values import MAX_INT, context_length, is_int, within_context


class Quest(Pass):
    def __init__(self, page: int = 16, budget: int = 256, dense_layers: int = 2, recent: int = 0):
        if not is_int(page) or not 1 <= page <= MAX_INT:
            raise ValueError(f"Quest: page must be an integer >= 1, got {page!r}")
        if not is_int(budget) or not page <= budget <= MAX_INT:
            raise ValueError(f"Quest: budget must be an integer of at least one page "
                             f"({page} tokens), got {budget!r}")
        if not is_int(dense_layers) or not 0 <= dense_layers <= MAX_INT:
            raise ValueError(f"Quest: dense_layers must be an integer >= 0, got {dense_layers!r}")
        if not is_int(recent) or not 0 <= recent <= MAX_INT:
            raise ValueError(f"Quest: recent must be an integer >= 0, got {recent!r}")
        self.page, self.budget, self.dense_layers = int(page), int(budget), int(dense_layers)
        self.recent = int(recent)

    def run(self, ir: IR) -> IR:
        check_not_speculative(self, ir)
        if any(ir.graph.find_nodes(op="call_function", target=OPS["select_tokens"])):
            raise PassError(f"{self!r} cannot follow TidalDecode: each layer selects once")
        nodes = attention_nodes(ir)
        local = local_layers(nodes)
        nodes = [n for n in nodes if attention_args(n)["layer"] not in local]
        if len(nodes) <= self.dense_layers:
            besides = f" besides its local layers {sorted(local)}" if local else ""
            raise PassError(f"{self!r}: the IR has {len(nodes)} attention layers{besides}, all "
                            f"kept dense; nothing would select")
        check_whole(self, nodes[self.dense_layers:], "Quest")  # before the graph changes
        # a selection is budget + recent tokens wide (rewriter.ops.select_pages)
        within_context(self.name, context_length(ir.info.get("config", {})), budget=self.budget,
                       recent=self.recent)
        for n in self._selecting(nodes):
            args = attention_args(n)
            with ir.graph.inserting_before(n):
                selection = ir.graph.call_function(OPS["select_pages"], (args["q"], args["k"]), {
                    "layer": cache_of(args), "num_heads": args["num_heads"],
                    "num_kv_heads": args["num_kv_heads"], "head_dim": args["head_dim"],
                    "page": self.page, "budget": self.budget,
                    **({"recent": self.recent} if self.recent else {})})
            selection.meta.update({k: n.meta[k] for k in ("layer", "role", "_scope") if k in n.meta})
            n.kwargs = {**n.kwargs, "select": selection}
            n.meta.pop("val", None)
        return ir

    def _selecting(self, nodes: list) -> list:
        """The attention ops that select: all but the first ``dense_layers``, and a layer
        reading another's cache (``ShareKV``) exactly when its owner does (it selects from
        the owner's pages and bounds)."""
        dense = {attention_args(n)["layer"] for n in nodes[:self.dense_layers]}
        return [n for n in nodes if cache_of(attention_args(n)) not in dense]
