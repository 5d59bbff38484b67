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

``TidalDecode(..., select_own=True)`` is a cheaper variant (not the paper's): a selection
layer also attends to its own selection, so it reads every key once, to choose, but the
values of the chosen tokens only; the selection is made before its attention instead of
after. On a model with few layers, where one layer attending fully is already a large
share of a step's reads, this is what lets more than one layer select.

``TidalDecode(calibrate=prompts, max_read=0.25)`` chooses the selection layers instead: the
ones whose selections keep the most of the later layers' attention on the prompts (token-id
lists), a decode step reading at most ``max_read`` of dense attention's KV bytes at their
length (``rewriter.measure.attention_recall``; what it measured is in ``report``).

The KV-cache runtime keeps the whole cache and selects at decode only: a prompt is
attended densely (TidalDecode leaves prefill dense), so a decode step of a sparse layer
reads ``top_k + 1`` keys instead of the whole cache. The whole-sequence graph selects at
every position (it has no prompt/decode split), so it is the reference for decode steps
only. A model's local layers (Gemma 3's sliding-window layers beside its global ones) are
left as they are: selection layers are global ones, and a selection carries over the local
layers to the next global layer (``whole_cache.local_layers``); calibration, which
measures every layer as a whole-context one, is refused on such a model. Other windows,
sink caches and speculative strategies are refused beside it. A selection
is ``top_k + recent`` tokens wide, at most the model's context length.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ops import OPS
from rewriter.ir.pass_manager import Pass
from rewriter.ir.nodes import attention_args
from rewriter.ir.sharing import sources
from rewriter.passes.whole_cache import (attention_nodes, check_not_speculative,
                                         check_whole, local_layers)
from rewriter.values import MAX_INT, context_length, is_int, within_context

CALIBRATION_QUERIES = 32  # the last positions of each calibration prompt, taken as decode steps
MAX_READ = 0.25  # with calibrate: a decode step reads at most this of dense attention's KV bytes


class TidalDecode(Pass):
    def __init__(self, selection_layers: Optional[Sequence[int]] = None, top_k: int = 128,
                 recent: int = 0, calibrate: Optional[Sequence[Sequence[int]]] = None,
                 max_read: Optional[float] = None, select_own: bool = False):
        if selection_layers is not None and calibrate is not None:
            raise ValueError("TidalDecode takes selection_layers or calibrate=prompts (which "
                             "chooses them), not both")
        if selection_layers is None and calibrate is None:
            selection_layers = [0]
        if selection_layers is not None and (
                isinstance(selection_layers, (str, bytes)) or not isinstance(selection_layers, (list, tuple))
                or not selection_layers or not all(is_int(i) and i >= 0 for i in selection_layers)):
            raise ValueError(f"TidalDecode: selection_layers must be a non-empty list of layer "
                             f"indices, got {selection_layers!r}")
        if not is_int(top_k) or not 1 <= top_k <= MAX_INT:
            raise ValueError(f"TidalDecode: top_k must be an integer >= 1, got {top_k!r}")
        if not is_int(recent) or not 0 <= recent <= MAX_INT:
            raise ValueError(f"TidalDecode: recent must be an integer >= 0, got {recent!r}")
        if calibrate is not None and (
                isinstance(calibrate, (str, bytes)) or not isinstance(calibrate, (list, tuple))
                or not calibrate or not all(
                    isinstance(p, (list, tuple)) and len(p) > CALIBRATION_QUERIES
                    and all(type(t) is int and t >= 0 for t in p) for p in calibrate)):
            raise ValueError(f"TidalDecode: calibrate must be a list of token-id lists (more "
                             f"than {CALIBRATION_QUERIES} ids each)")
        if max_read is not None and calibrate is None:
            raise ValueError("TidalDecode: max_read goes with calibrate=prompts (it bounds the "
                             "bytes of the layers calibration chooses)")
        if not isinstance(select_own, bool):
            raise ValueError(f"TidalDecode: select_own must be True or False, got {select_own!r}")
        if calibrate is not None and max_read is None:
            max_read = MAX_READ
        if max_read is not None and (isinstance(max_read, bool) or not isinstance(max_read, (int, float))
                                     or not math.isfinite(max_read) or not 0 < max_read <= 1):
            raise ValueError(f"TidalDecode: max_read must be a fraction in (0, 1], got {max_read!r}")
        self.selection_layers = (sorted(set(int(i) for i in selection_layers))
                                 if selection_layers is not None else None)
        self.top_k, self.recent = int(top_k), int(recent)
        self.calibrate = [list(p) for p in calibrate] if calibrate is not None else None
        self.max_read = float(max_read) if max_read is not None else None
        self.select_own = select_own
        self.report: Optional[dict] = None  # what calibration measured

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.params().items() if v is not None
                 and not (k == "select_own" and v is False)}  # the paper's TidalDecode: unsaid
        if self.calibrate is not None:
            shown["calibrate"] = f"<{len(self.calibrate)} prompts>"
        return f"TidalDecode({', '.join(f'{k}={v}' if k == 'calibrate' else f'{k}={v!r}' for k, v in shown.items())})"

    def run(self, ir: IR) -> IR:
        check_not_speculative(self, ir)
        if sources(ir.graph):
            raise PassError(f"{self!r} cannot follow ShareKV: a layer reusing a selection "
                            f"made on another layer's cache would read a third's")
        nodes = attention_nodes(ir)
        local = local_layers(nodes)
        self._check_local(local)
        nodes = [n for n in nodes if attention_args(n)["layer"] not in local]
        layers = [attention_args(n)["layer"] for n in nodes]
        # before any calibration: it would measure for minutes, then refuse
        check_whole(self, nodes, "TidalDecode")
        # a selection is top_k + recent tokens wide (rewriter.ops.select_tokens)
        within_context(self.name, context_length(ir.info.get("config", {})), top_k=self.top_k,
                       recent=self.recent)
        if self.calibrate is not None:
            self.selection_layers = self._choose(ir, layers)
        missing = [i for i in self.selection_layers if i not in layers]
        if missing:
            raise PassError(f"{self!r}: no attention names cache {missing[0]}; the IR has {layers}")
        if max(self.selection_layers) >= max(layers) and not self.select_own:
            raise PassError(f"{self!r}: no layer follows selection layer {max(self.selection_layers)}, "
                            f"so its selection would be made and never read")
        selection = None
        for n in nodes:
            args = attention_args(n)
            selects = args["layer"] in self.selection_layers
            if selects:  # before its attention when that reads it too, after it otherwise
                where = ir.graph.inserting_before(n) if self.select_own else ir.graph.inserting_after(n)
                with where:
                    selection = ir.graph.call_function(OPS["select_tokens"], (args["q"], args["k"]), {
                        "layer": args["layer"], "num_heads": args["num_heads"],
                        "num_kv_heads": args["num_kv_heads"], "head_dim": args["head_dim"],
                        "top_k": self.top_k, **({"recent": self.recent} if self.recent else {})})
                # its layer's node (the IR shows it there); layer spans skip integer values
                selection.meta.update({k: n.meta[k] for k in ("layer", "role", "_scope") if k in n.meta})
            if selection is not None and (self.select_own or not selects):  # TidalDecode's attend fully
                n.kwargs = {**n.kwargs, "select": selection}
                n.meta.pop("val", None)
        return ir


    def _check_local(self, local: set) -> None:
        """``PassError`` for what a model's local layers cannot take: a selection of their
        own, or calibration (it measures each layer as one that reads every key)."""
        if not local:
            return
        if self.calibrate is not None:
            raise PassError(f"{self!r}: calibration measures every layer as one reading the "
                            f"whole context, and layers {sorted(local)} are local layers with "
                            f"a sliding window of their own; name selection_layers among the "
                            f"global layers instead")
        named = sorted(local.intersection(self.selection_layers))
        if named:
            raise PassError(f"{self!r}: layer {named[0]} is a local layer of the model's "
                            f"local/global pattern (a sliding window of its own); selection "
                            f"layers are global ones, and local layers stay as they are")

    def _choose(self, ir: IR, layers: list) -> list:
        """The selection layers that keep the most of the model's attention on the
        calibration prompts, a decode step reading at most ``max_read`` of dense attention's
        KV bytes at their length (``rewriter.measure.attention_recall``)."""
        from rewriter.measure.attention_recall import attention_rows, best_selection_layers, kept_mass
        from rewriter.measure.calibrate import calibration_batch
        if len(layers) < 2 and not self.select_own:
            raise PassError(f"{self!r}: the IR has {len(layers)} attention layer(s); a selection "
                            f"needs a later layer to read it")
        try:
            batch = calibration_batch(ir, self.calibrate)  # [B, S]: vocabulary and context checked
        except ValueError as e:
            raise PassError(f"{self!r}: {e}") from None
        tokens = batch.shape[1]
        if tokens <= CALIBRATION_QUERIES:
            raise PassError(f"{self!r}: the calibration prompts are cut to the context length, "
                            f"{tokens} tokens; more than {CALIBRATION_QUERIES} are needed")
        kept = None
        for ids in batch.split(1):  # one at a time: rows are [Hq, queries, T] per layer
            try:
                m = kept_mass(attention_rows(ir, ids, CALIBRATION_QUERIES), self.top_k, self.recent)
            except ValueError as e:  # an attention that does not read every key, KV heads that differ
                raise PassError(f"{self!r}: {e}") from None
            kept = m if kept is None else kept + m
        kept = kept / len(self.calibrate)
        if kept.shape[0] != len(layers):  # rows are cache ids: two attentions on one cache
            raise PassError(f"{self!r}: measured {kept.shape[0]} attention layers, the IR has "
                            f"{len(layers)} ({layers}); each needs a cache of its own")
        choice = best_selection_layers(kept, tokens, self.top_k, self.recent, self.max_read,
                                       select_own=self.select_own)
        if choice is None:
            chooser = ("reads every key and the values of its selection" if self.select_own
                       else "reads every token")
            raise PassError(f"{self!r}: no selection fits: a sparse layer reads "
                            f"{self.top_k + self.recent + 1} of {tokens} tokens, a selection "
                            f"layer {chooser}, and the first layer must select; raise max_read "
                            f"or lower top_k")
        self.report = {"tokens": tokens, "layers": layers, "kept": kept.tolist(),  # rows, columns: layers
                       "selection_layers": [layers[i] for i in choice.selection_layers],
                       "read": choice.bytes_read, "mean_kept": choice.kept}
        return self.report["selection_layers"]
