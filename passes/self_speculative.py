"""``SelfSpeculative``: lossless decoding that drafts with the model's own layers skipped.

    SelfSpeculative(skip_layers=[...], skip_attention=[...], skip_mlp=[...], max_draft=4,
                    threshold=0.5)
    SelfSpeculative(speedup=1.6)   # the draft keeps round(L / 1.6) layers, spread as LayerSkip's
    SelfSpeculative(calibrate=[[ids...], ...], budget=20)   # searched (rewriter.measure.calibrate)
    SelfSpeculative(draft_weights="int4")   # the draft reads the same weights in 4 bits

The graph is left as it is (the full model verifies); the pass records the strategy in
``ir.info["decoding"]`` (``rewriter.decoding``), the runtime lowers the ``draft`` program
from it (``rewriter.ir.skip``) and decodes with ``runtime.decoding.speculative``. Attention and MLP
sub-layers are skippable separately. ``calibrate`` times verify steps with the measurer
``rewriter.optimize`` gives (the runtime, on the backend and device that will run the model;
``ir.info["measured_on"]`` says where). The output is exactly the model's: plain greedy
decoding's tokens, or its sampling distribution.

``draft_weights="int4"`` drafts with the model's own weights in 4 bits (``Int4Weights``'
group-wise codes, made when the programs are lowered; the verifying model keeps its
weights), with or without a skip set. A one-token step on a CPU is bound by the bytes of
the weights, and a 4-bit draft agrees with the model far more often than one with layers
skipped: on SmolLM2 (whose GGUF weights are 4-bit already) its argmax is the model's at
97% of positions. It is fast only where ``Int4Weights`` is (a CPU, bfloat16 activations);
elsewhere the draft multiplies dequantized copies, as slow as the model.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from rewriter.decoding import (DRAFT_WEIGHTS, MAX_DRAFT, SelfSpeculativeDecoding, check_record,
                               check_undecided)
from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.skip import check_skip_set
from rewriter.ir.pass_manager import Measurer, Pass
from rewriter.measure.calibrate import ShortContext, search
from rewriter.values import is_int
from rewriter.passes.layer_skip import kept_positions


class SelfSpeculative(Pass):
    measures = True  # with calibrate: verify costs, timed where the model will run

    def __init__(self, skip_layers: Optional[Sequence[int]] = None,
                 skip_attention: Optional[Sequence[int]] = None,
                 skip_mlp: Optional[Sequence[int]] = None, speedup: Optional[float] = None,
                 calibrate: Optional[Sequence[Sequence[int]]] = None, budget: Optional[int] = None,
                 max_draft: int = 4, threshold: float = 0.5, draft_weights: str = "dense"):
        if not isinstance(draft_weights, str) or draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"SelfSpeculative: draft_weights must be one of {DRAFT_WEIGHTS}, "
                             f"got {draft_weights!r}")
        named = any(v is not None for v in (skip_layers, skip_attention, skip_mlp))
        given = named + (speedup is not None) + (calibrate is not None)
        if given > 1 or (given == 0 and draft_weights == "dense"):
            raise ValueError("SelfSpeculative takes a skip set (skip_layers / skip_attention / "
                             "skip_mlp), speedup=s or calibrate=prompts: exactly one of them "
                             "(none with draft_weights='int4': the draft skips nothing)")
        if calibrate is not None and draft_weights != "dense":
            raise ValueError("SelfSpeculative: calibrate searches skip sets of a dense draft; "
                             "with draft_weights='int4' give the skip set, or none")
        self.draft_weights = draft_weights
        if calibrate is not None and (isinstance(calibrate, (str, bytes)) or not isinstance(calibrate, (list, tuple))
                                      or not calibrate or not all(
                                          isinstance(p, (list, tuple)) and len(p) >= 2
                                          and all(type(t) is int and t >= 0 for t in p) for p in calibrate)):
            raise ValueError("SelfSpeculative: calibrate must be a list of token-id lists "
                             "(at least 2 ids each)")
        if budget is not None and (type(budget) is not int or budget < 1):
            raise ValueError(f"SelfSpeculative: budget must be an int >= 1, got {budget!r}")
        if budget is not None and calibrate is None:
            raise ValueError("SelfSpeculative: budget goes with calibrate=prompts")
        self.calibrate = [list(p) for p in calibrate] if calibrate is not None else None
        self.budget = budget
        self.report: Optional[dict] = None  # what calibration measured
        self.skip_layers = _indices("skip_layers", skip_layers)
        self.skip_attention = _indices("skip_attention", skip_attention)
        self.skip_mlp = _indices("skip_mlp", skip_mlp)
        if speedup is not None and (isinstance(speedup, bool) or not isinstance(speedup, (int, float))
                                    or not math.isfinite(speedup) or speedup <= 1.0):
            raise ValueError(f"SelfSpeculative: speedup must be a finite number > 1, got {speedup!r}")
        if type(max_draft) is not int or not 1 <= max_draft <= MAX_DRAFT:
            raise ValueError(f"SelfSpeculative: max_draft must be an int in [1, {MAX_DRAFT}], "
                             f"got {max_draft!r}")
        if (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                or not 0.0 <= threshold < 1.0):
            raise ValueError(f"SelfSpeculative: threshold must be a number in [0, 1), got {threshold!r}")
        self.speedup = float(speedup) if speedup is not None else None
        self.max_draft, self.threshold = max_draft, float(threshold)

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.params().items()
                 if v not in (None, []) and (k, v) != ("draft_weights", "dense")}
        if self.calibrate is not None:
            shown["calibrate"] = f"<{len(self.calibrate)} prompts>"
        return f"SelfSpeculative({', '.join(f'{k}={v}' if k == 'calibrate' else f'{k}={v!r}' for k, v in shown.items())})"

    def run(self, ir: IR, measurer: Optional[Measurer] = None) -> IR:
        if not ir.layers:
            raise PassError(f"{self!r} needs a causal LM with decoder layers")
        check_undecided(ir, self)
        layers, attention, mlp, max_draft = (self.skip_layers, self.skip_attention, self.skip_mlp,
                                             self.max_draft)
        if self.calibrate is not None:
            try:
                self.report = search(ir, self.calibrate, self.max_draft, self.budget,
                                     self.measurer(ir, measurer))
            except ShortContext as e:
                raise PassError(f"{e}: give SelfSpeculative a smaller max_draft (max_draft="
                                f"{self.max_draft} now), or skip sets instead of calibrate") from None
            attention, mlp = self.report["skip_attention"], self.report["skip_mlp"]
            max_draft = self.report["max_draft"]
            if not attention and not mlp:
                raise PassError(f"{self!r}: calibration found no skip set predicted to be faster "
                                f"than plain decoding (verify cost {self.report['verify_cost']})")
        if self.speedup is not None:
            present = sorted(s["index"] for s in ir.layers)
            keep = kept_positions(len(present), self.speedup)
            layers = [idx for pos, idx in enumerate(present) if pos not in keep]
            if not layers:
                raise PassError(f"{self!r} keeps every one of the {len(present)} layers; "
                                f"a larger speedup skips some")
        int4 = self.draft_weights != "dense"
        check_skip_set(ir, layers, attention, mlp, empty_ok=int4)
        strategy = SelfSpeculativeDecoding(tuple(layers), tuple(attention), tuple(mlp), max_draft,
                                           self.threshold, draft_weights=self.draft_weights)
        why = check_record(strategy.record())  # what the artifact loader will check
        if why:
            raise PassError(f"{self!r}: the decoding record needs {why}")
        ir.info["decoding"] = strategy.record()
        return ir


def _indices(name: str, value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"SelfSpeculative: {name} must be a list of layer indices, got {value!r}")
    if not all(is_int(i) and i >= 0 for i in value):  # numpy integers too, as LayerSkip takes
        raise ValueError(f"SelfSpeculative: {name} must hold non-negative ints, got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"SelfSpeculative: {name} names a layer twice: {value!r}")
    return sorted(int(i) for i in value)
