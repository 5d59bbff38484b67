"""The decoding strategy an IR asks for, recorded by a pass in ``ir.info["decoding"]``.

With no record the runtime decodes one token per step. ``SelfSpeculative`` records::

    {"strategy": "self_speculative", "skip_layers": [..], "skip_attention": [..],
     "skip_mlp": [..], "max_draft": 4, "threshold": 0.5}

(``draft_weights``, optional: ``"int4"``: the draft reads the same weights in 4 bits,
``Int4Weights``'s codes; the skip set may then be empty.)

and the runtime then lowers a ``draft`` program (the same IR with those layers and
sub-layers bypassed: ``rewriter.ir.skip``) beside ``prefill`` and ``decode``, and generates
with ``runtime.speculative``. ``MedusaHeads`` records::

    {"strategy": "medusa", "arch": "medusa" or "hydra", "num_heads": 4, "tree": [[0], [1], [0, 0], ..],
     "draft_vocab": 4096 or None, "acceptance": "exact" or "typical",
     "posterior_threshold": 0.09, "posterior_alpha": 0.3,
     "batch_trees": [[4, [[0], [1], [0, 0]]], [8, []]]}

(``batch_trees``, optional: from a batch of 4 rows on verify only those nodes of the tree,
from 8 on none, which decodes plainly (or, with ``lookup``, verifies copied chains alone);
a larger batch makes verifying many tokens dearer. ``[1, []]`` first: even one row
verifies no tree, where no tree pays on the machine.)

(``dynamic``, optional: an integer ``e``: every round the runtime re-grows a tree of as many
nodes from the heads' own probabilities, expanding the ``e`` likeliest nodes of each level:
``runtime.tree_dynamic``.)

(``EagleDraft`` records ``"arch": "eagle"`` the same way: ``num_heads`` the levels a round
drafts, ``tree`` only the size of the trees, which ``dynamic`` (required) re-grows every
round from the layer's guesses; no ``adapt`` or ``batch_trees``.)

(``lookup``, optional: an integer ``L``: every round also verifies a chain of up to ``L``
tokens copied from each row's own text after the latest earlier occurrence of its last
tokens; with ``adapt`` as many of them as pay on the text being decoded:
``runtime.tree_lookup``.)

(``adapt``, optional: ``{"accuracy": [[..], ..], "costs": [[1, 0.11, [1.0, 1.01, ..]], ..]}``,
the heads' held-out rank accuracies and, from each batch size on, one heads call's cost and
a round's cost verifying 1, 2, .. tokens (at one row as far as the tree and a chain; a
larger batch's may stop short of the tree: its sub-trees are cut to them) (its programs and its own work:
``rewriter.round_cost``), in plain decode steps. With it the runtime learns the heads'
accuracies on the text it decodes and re-chooses the sub-tree it verifies:
``runtime.tree_adapt``.)

and the runtime lowers ``tree_prefill``, ``verify`` (logits and hidden states) and
``heads`` and generates with ``runtime.tree_decoding``. ``PromptLookup`` records::

    {"strategy": "lookup", "lookup": 4, "costs": [[1, [1.0, 1.02, ..]], [2, [..]], ..]}

(``costs``, optional: from each batch size on, a round verifying 1, 2, .. tokens in plain
decode steps, the round's own work included) and the runtime verifies copied chains alone, with no heads, in the same rounds. Artifacts keep the record, so a
loaded model decodes the same way. ``check_record`` is what the artifact loader and the
passes apply.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_DRAFT = 16  # verifying more tokens than this costs more than it can save on any machine
MAX_EXPAND = 16  # a re-grown tree's nodes expanded a level: each costs a heads call's row
MAX_LOOKUP = 16  # tokens copied from a row's text a round (each is verified)
DRAFT_WEIGHTS = ("dense", "int4")  # what a self-speculative draft reads its weights as


@dataclass(frozen=True)
class Strategy:
    name: str = "plain"
    skip_layers: tuple[int, ...] = field(default=())
    skip_attention: tuple[int, ...] = field(default=())
    skip_mlp: tuple[int, ...] = field(default=())
    max_draft: int = 0
    threshold: float = 0.0
    draft_weights: str = "dense"  # self_speculative: "int4" drafts with the weights in 4 bits
    # medusa (draft heads: arch "medusa" or "hydra")
    arch: str = "medusa"
    num_heads: int = 0
    tree: tuple = ()  # paths of ranks (rewriter.tree)
    draft_vocab: int | None = None
    acceptance: str = "exact"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    batch_trees: tuple = ()  # ((batch, paths), ..): from that batch on, a sub-tree (or none)
    accuracy: tuple = ()  # the heads' rank accuracies [K][R]: the adaptive tree's prior
    costs: tuple = ()  # ((batch, heads call, (round of 1, 2, .. tokens)), ..) in plain steps
    dynamic: int = 0  # > 0: the tree re-grown every round, expanding this many nodes a level
    lookup: int = 0  # > 0: a chain of this many tokens copied from the row's text, verified too

    def tree_at(self, batch: int) -> tuple:
        """The paths a round verifies at ``batch`` rows: the tree, or a sub-tree of it."""
        paths = self.tree
        for b, sub in self.batch_trees:
            if batch >= b:
                paths = sub
        return paths

    def costs_at(self, batch: int) -> tuple | None:
        """(one heads call, a round verifying 1, 2, .. tokens) in plain steps at ``batch`` rows:
        measured at the largest batch size not above it; None without ``costs``."""
        chosen = None
        for b, heads, verify in self.costs:
            if batch >= b:
                chosen = (heads, verify)
        return chosen

    def cache_slack(self) -> int:
        """Cache positions a generation may need past prompt + new tokens: a row that is
        done keeps being drafted for and verified (its results dropped) at most one round
        past its end, and the last round may overshoot by one draft."""
        if self.name in ("medusa", "lookup"):
            return 2 * (len(self.tree) + 1 + self.lookup)
        return 2 * (self.max_draft + 1) if self.name == "self_speculative" else 0

    def record(self) -> dict:
        if self.name == "lookup":
            r = {"strategy": "lookup", "lookup": self.lookup}
            if self.costs:
                r["costs"] = [[b, list(c)] for b, _, c in self.costs]
            return r
        if self.name == "medusa":
            r = {"strategy": "medusa", "arch": self.arch, "num_heads": self.num_heads,
                 "tree": [list(p) for p in self.tree], "draft_vocab": self.draft_vocab,
                 "acceptance": self.acceptance, "posterior_threshold": self.posterior_threshold,
                 "posterior_alpha": self.posterior_alpha}
            if self.batch_trees:
                r["batch_trees"] = [[b, [list(p) for p in sub]] for b, sub in self.batch_trees]
            if self.costs:
                r["adapt"] = {"accuracy": [list(a) for a in self.accuracy],
                              "costs": [[b, h, list(c)] for b, h, c in self.costs]}
            if self.dynamic:
                r["dynamic"] = self.dynamic
            if self.lookup:
                r["lookup"] = self.lookup
            return r
        r = {"strategy": self.name, "skip_layers": list(self.skip_layers),
             "skip_attention": list(self.skip_attention), "skip_mlp": list(self.skip_mlp),
             "max_draft": self.max_draft, "threshold": self.threshold}
        if self.draft_weights != "dense":  # records from before the option keep their keys
            r["draft_weights"] = self.draft_weights
        return r


def check_undecided(ir, who) -> None:
    """``PassError`` unless ``ir`` is a causal LM with no decoding strategy recorded yet
    (``who``: the strategy's pass; a model decodes one way)."""
    from rewriter.errors import PassError
    if not ir.is_causal_lm:
        raise PassError(f"{who!r} needs a causal LM")
    if ir.info.get("decoding") is not None:
        raise PassError(f"{who!r}: the IR already has a decoding strategy "
                        f"({ir.info['decoding']['strategy']}); a model decodes one way")


def strategy_of(info: dict) -> Strategy:
    """The strategy ``info`` records (checked when it was recorded or loaded)."""
    r = info.get("decoding")
    if r is None:
        return Strategy()
    if r["strategy"] == "lookup":
        return Strategy("lookup", lookup=r["lookup"],
                        costs=tuple((b, 0.0, tuple(c)) for b, c in r.get("costs", ())))
    if r["strategy"] == "medusa":
        return Strategy("medusa", arch=r["arch"], num_heads=r["num_heads"], tree=tuple(map(tuple, r["tree"])),
                        draft_vocab=r["draft_vocab"], acceptance=r["acceptance"],
                        posterior_threshold=float(r["posterior_threshold"]),
                        posterior_alpha=float(r["posterior_alpha"]),
                        batch_trees=tuple((b, tuple(map(tuple, sub)))
                                          for b, sub in r.get("batch_trees", ())),
                        accuracy=tuple(tuple(a) for a in r.get("adapt", {}).get("accuracy", ())),
                        costs=tuple((b, float(h), tuple(c))
                                    for b, h, c in r.get("adapt", {}).get("costs", ())),
                        dynamic=r.get("dynamic", 0), lookup=r.get("lookup", 0))
    return Strategy(r["strategy"], tuple(r["skip_layers"]), tuple(r["skip_attention"]),
                    tuple(r["skip_mlp"]), r["max_draft"], float(r["threshold"]),
                    draft_weights=r.get("draft_weights", "dense"))


def check_record(r) -> str | None:
    """Why ``r`` is not a decoding record, or None."""
    if isinstance(r, dict) and r.get("strategy") == "medusa":
        return _check_medusa(r)
    if isinstance(r, dict) and r.get("strategy") == "lookup":
        return _check_lookup(r)
    keys = {"strategy", "skip_layers", "skip_attention", "skip_mlp", "max_draft", "threshold"}
    if not isinstance(r, dict) or set(r) - {"draft_weights"} != keys:
        return f"an object with exactly the keys {sorted(keys)} (and draft_weights)"
    if r.get("draft_weights", "int4") not in DRAFT_WEIGHTS[1:]:  # "dense" is no key at all
        return "draft_weights: 'int4' (a dense draft is written with no key)"
    if r["strategy"] != "self_speculative":  # "plain" is no record at all
        return "strategy 'self_speculative'"
    for k in ("skip_layers", "skip_attention", "skip_mlp"):
        v = r[k]
        if not isinstance(v, list) or not all(_is_int(i) and i >= 0 for i in v) or v != sorted(set(v)):
            return f"{k}: a sorted list of distinct layer indices"
    if not _is_int(r["max_draft"]) or not 1 <= r["max_draft"] <= MAX_DRAFT:
        return f"max_draft: an integer in [1, {MAX_DRAFT}]"
    t = r["threshold"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < 1.0:
        return "threshold: a number in [0, 1)"
    if not (r["skip_layers"] or r["skip_attention"] or r["skip_mlp"] or "draft_weights" in r):
        return "a skip set that skips something (or draft_weights)"
    return None


MEDUSA_KEYS = {"strategy", "arch", "num_heads", "tree", "draft_vocab", "acceptance",
               "posterior_threshold", "posterior_alpha"}


def _check_medusa(r: dict) -> str | None:
    from rewriter.heads import MAX_HEADS
    from rewriter.tree import check_paths
    if set(r) - {"batch_trees", "adapt", "dynamic", "lookup"} != MEDUSA_KEYS:
        return (f"an object with exactly the keys {sorted(MEDUSA_KEYS)} (and batch_trees, "
                f"adapt, dynamic, lookup)")
    if r["arch"] not in ("medusa", "hydra", "eagle"):
        return "arch: 'medusa', 'hydra' or 'eagle'"
    if r["arch"] == "eagle" and ("dynamic" not in r or "adapt" in r or "batch_trees" in r):
        # the EAGLE layer's rounds always grow their own tree
        return "arch 'eagle': dynamic, and no adapt or batch_trees"
    k = r["num_heads"]
    if not _is_int(k) or not 1 <= k <= MAX_HEADS:
        return f"num_heads: an integer in [1, {MAX_HEADS}]"
    why = check_paths(r["tree"], k)
    if why:
        return f"tree: {why}"
    if r["tree"] != sorted(r["tree"], key=lambda p: (len(p), p)):
        return "tree: paths ordered by depth, then ranks"
    v = r["draft_vocab"]
    if v is not None and (not _is_int(v) or v < 10):
        return "draft_vocab: null or an integer >= 10"
    if r["acceptance"] not in ("exact", "typical"):
        return "acceptance: 'exact' or 'typical'"
    if "dynamic" in r and not (_is_int(r["dynamic"]) and 1 <= r["dynamic"] <= MAX_EXPAND):
        return f"dynamic: an integer in [1, {MAX_EXPAND}] (nodes expanded a level)"
    if "lookup" in r and not (_is_int(r["lookup"]) and 1 <= r["lookup"] <= MAX_LOOKUP):
        return f"lookup: an integer in [1, {MAX_LOOKUP}] (tokens copied from the text)"
    for key in ("posterior_threshold", "posterior_alpha"):
        t = r[key]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t <= 1.0:
            return f"{key}: a number in (0, 1]"
    return (_check_batch_trees(r.get("batch_trees", []), r["tree"], k)
            or ("adapt" in r and _check_adapt(r["adapt"], len(r["tree"]), k)) or None)


def _check_lookup(r: dict) -> str | None:
    from rewriter.tree import MAX_NODES
    if set(r) - {"costs"} != {"strategy", "lookup"}:
        return "an object with exactly the keys ['lookup', 'strategy'] (and costs)"
    if not (_is_int(r["lookup"]) and 1 <= r["lookup"] <= MAX_LOOKUP):
        return f"lookup: an integer in [1, {MAX_LOOKUP}] (tokens copied from the text)"
    if "costs" not in r:
        return None
    costs = r["costs"]
    what = (f"costs: a list of [batch, [verify cost of 1 .. at least 2 and at most "
            f"{MAX_NODES + 1} tokens]], batches increasing from 1, costs positive numbers")
    if not isinstance(costs, list) or not costs or not all(
            isinstance(c, list) and len(c) == 2 and _is_int(c[0]) and isinstance(c[1], list)
            and 2 <= len(c[1]) <= MAX_NODES + 1 and all(_is_number(x, 1e-3, 1e3) for x in c[1])
            for c in costs):
        return what
    batches = [c[0] for c in costs]
    if batches[0] != 1 or batches != sorted(set(batches)):
        return what
    return None


def _check_batch_trees(v, tree: list, num_heads: int) -> str | None:
    from rewriter.tree import check_paths
    what = "batch_trees: a list of [batch, paths] pairs, batches increasing from 1"
    if not isinstance(v, list) or not all(isinstance(x, list) and len(x) == 2 and _is_int(x[0])
                                          for x in v):
        return what
    batches = [b for b, _ in v]
    if batches != sorted(set(batches)) or (batches and batches[0] < 1):
        return what
    for b, sub in v:
        if sub == []:  # plain decoding from this batch on
            continue
        why = check_paths(sub, num_heads)
        if why:
            return f"batch_trees: batch {b}: {why}"
        if sub != sorted(sub, key=lambda p: (len(p), p)) or not all(p in tree for p in sub):
            return f"batch_trees: batch {b}: paths of the tree, ordered by depth, then ranks"
    return None


def _check_adapt(v, nodes: int, num_heads: int) -> str | None:
    from rewriter.tree import MAX_NODES, MAX_RANK
    if not isinstance(v, dict) or set(v) != {"accuracy", "costs"}:
        return "adapt: an object with the keys accuracy and costs"
    acc = v["accuracy"]
    if not isinstance(acc, list) or len(acc) != num_heads or not all(
            isinstance(a, list) and 1 <= len(a) <= MAX_RANK and all(_is_number(x, 0, 1) for x in a)
            and sum(a) <= 1 + 1e-6 for a in acc):
        return (f"adapt: accuracy: {num_heads} lists (one a head) of at most {MAX_RANK} "
                f"rank accuracies in [0, 1], each summing to at most 1")
    costs = v["costs"]
    # (a batch's costs may stop short of the tree: its sub-trees are cut to them, and
    # where no tree pays only a copied chain's are measured)
    what = (f"adapt: costs: a list of [batch, heads cost, [verify cost of 1 .. at least "
            f"2 and at most {MAX_NODES + 1} tokens]], batches increasing from 1, the first "
            f"at least {nodes + 1} long, costs positive numbers")
    if not isinstance(costs, list) or not costs or not all(
            isinstance(c, list) and len(c) == 3 and _is_int(c[0]) and _is_number(c[1], 0, 1e3)
            and isinstance(c[2], list) and 2 <= len(c[2]) <= MAX_NODES + 1
            and all(_is_number(x, 1e-3, 1e3) for x in c[2]) for c in costs):
        return what
    batches = [c[0] for c in costs]
    if batches[0] != 1 or batches != sorted(set(batches)) or len(costs[0][2]) < nodes + 1:
        return what
    return None


def _is_number(v, low: float, high: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
