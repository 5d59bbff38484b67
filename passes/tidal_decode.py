"""TidalDecode: a few selection layers attend fully and pick the tokens the layers after
them attend to.

``TidalDecode(selection_layers=[2, 5], top_k=128)`` inserts, after each selection layer's
attention, ``rw.select_tokens`` on that layer's (rotated) q and k: the ``top_k`` earlier
positions each KV head's query group attends to most. Every later layer, up to the next
selection layer, gets that value as its attention's ``select`` input and attends to those
tokens and the current one; layers before the first selection layer stay dense. With
``recent=R`` the R tokens just before the query are always read as well (a local window;
the top-k is chosen among the keys before it). The selection is an IR value, so the IR and
dumps show which layer feeds which.

The KV-cache runtime keeps the whole cache and selects at decode only: a prompt is
attended densely (TidalDecode leaves prefill dense), so a decode step of a sparse layer
reads ``top_k + 1`` keys instead of the whole cache. The whole-sequence graph selects at
every position (it has no prompt/decode split), so it is the reference for decode steps
only. Windows, sink caches and speculative strategies are refused beside it.
"""
from __future__ import annotations

from typing import Sequence

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ops import MAX_INT, OPS, op_arguments
from rewriter.pass_manager import Pass
from rewriter.values import is_int


class TidalDecode(Pass):
    def __init__(self, selection_layers: Sequence[int] = (0,), top_k: int = 128, recent: int = 0):
        if (isinstance(selection_layers, (str, bytes)) or not isinstance(selection_layers, (list, tuple))
                or not selection_layers or not all(is_int(i) and i >= 0 for i in selection_layers)):
            raise ValueError(f"TidalDecode: selection_layers must be a non-empty list of layer "
                             f"indices, got {selection_layers!r}")
        if not is_int(top_k) or not 1 <= top_k <= MAX_INT:
            raise ValueError(f"TidalDecode: top_k must be an integer >= 1, got {top_k!r}")
        if not is_int(recent) or not 0 <= recent <= MAX_INT:
            raise ValueError(f"TidalDecode: recent must be an integer >= 0, got {recent!r}")
        self.selection_layers = sorted(set(int(i) for i in selection_layers))
        self.top_k, self.recent = int(top_k), int(recent)

    def run(self, ir: IR) -> IR:
        if ir.info.get("decoding") is not None:
            raise PassError(f"{self!r} cannot follow a speculative strategy: a verify step "
                            f"spans several tokens, which the runtime attends densely")
        nodes = sorted(ir.graph.find_nodes(op="call_function", target=OPS["attention"]),
                       key=lambda n: _args(n)["layer"])
        layers = [_args(n)["layer"] for n in nodes]
        missing = [i for i in self.selection_layers if i not in layers]
        if missing:
            raise PassError(f"{self!r}: no attention names cache {missing[0]}; the IR has {layers}")
        if max(self.selection_layers) >= max(layers):
            raise PassError(f"{self!r}: no layer follows selection layer {max(self.selection_layers)}, "
                            f"so its selection would be made and never read")
        selection = None
        for n in nodes:
            args = _args(n)
            if args["window"] is not None or args["sinks"] is not None or args["select"] is not None:
                raise PassError(f"{self!r}: {n.name} already limits what it sees (window="
                                f"{args['window']}, sinks={args['sinks']}); TidalDecode selects "
                                f"from a whole cache")
            if args["cos"] is not None:
                raise PassError(f"{self!r} must run before FuseRoPE: the selection reads the "
                                f"rotated q and k")
            if selection is not None and args["layer"] not in self.selection_layers:
                n.kwargs = {**n.kwargs, "select": selection}  # selection layers attend fully
                n.meta.pop("val", None)
            if args["layer"] in self.selection_layers:
                with ir.graph.inserting_after(n):
                    selection = ir.graph.call_function(OPS["select_tokens"], (args["q"], args["k"]), {
                        "layer": args["layer"], "num_heads": args["num_heads"],
                        "num_kv_heads": args["num_kv_heads"], "head_dim": args["head_dim"],
                        "top_k": self.top_k, **({"recent": self.recent} if self.recent else {})})
                # its layer's node (the IR shows it there); layer spans skip integer values
                selection.meta.update({k: n.meta[k] for k in ("layer", "role", "_scope") if k in n.meta})
        return ir


def _args(n) -> dict:
    return op_arguments("attention", tuple(n.args), dict(n.kwargs))
