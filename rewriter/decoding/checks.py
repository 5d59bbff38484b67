"""Why a dict is not a decoding record of this version (``records``), or None: every key
and value, as the passes write them and the artifact loader reads them."""
from __future__ import annotations

MAX_DRAFT = 16  # verifying more tokens than this costs more than it can save on any machine
MAX_EXPAND = 16  # a re-grown tree's nodes expanded a level: each costs a heads call's row
MAX_LOOKUP = 16  # tokens copied from a row's text a round (each is verified)
DRAFT_WEIGHTS = ("dense", "int4")  # what a self-speculative draft reads its weights as
DRAFTERS = ("medusa", "hydra", "eagle", "none")  # who drafts a tree ("none": copied chains)

SELF_SPECULATIVE_KEYS = {"version", "strategy", "skip_layers", "skip_attention", "skip_mlp",
                         "max_draft", "threshold"}
TREE_KEYS = {"version", "strategy", "drafter", "depth", "tree", "draft_vocab", "acceptance",
             "posterior_threshold", "posterior_alpha"}
TREE_OPTIONAL = {"batch_trees", "adapt", "dynamic", "lookup"}
CHAIN_KEYS = {"version", "strategy", "drafter", "lookup"}  # drafter "none" (and costs)


def check_self_speculative(r: dict) -> str | None:
    if set(r) - {"draft_weights"} != SELF_SPECULATIVE_KEYS:
        return f"an object with exactly the keys {sorted(SELF_SPECULATIVE_KEYS)} (and draft_weights)"
    if r.get("draft_weights", "int4") not in DRAFT_WEIGHTS[1:]:  # "dense" is no key at all
        return "draft_weights: 'int4' (a dense draft is written with no key)"
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


def check_tree(r: dict) -> str | None:
    if r.get("drafter") not in DRAFTERS:
        return f"drafter: one of {', '.join(map(repr, DRAFTERS))}"
    return _check_chains(r) if r["drafter"] == "none" else _check_drafted(r)


def _check_drafted(r: dict) -> str | None:
    from rewriter.drafts.heads import MAX_HEADS
    from rewriter.drafts.tree import check_paths
    if set(r) - TREE_OPTIONAL != TREE_KEYS:
        return (f"an object with exactly the keys {sorted(TREE_KEYS)} (and "
                f"{', '.join(sorted(TREE_OPTIONAL))})")
    if r["drafter"] == "eagle" and ("dynamic" not in r or "adapt" in r or "batch_trees" in r):
        # the EAGLE layer's rounds always grow their own tree
        return "drafter 'eagle': dynamic, and no adapt or batch_trees"
    k = r["depth"]
    if not _is_int(k) or not 1 <= k <= MAX_HEADS:
        return f"depth: an integer in [1, {MAX_HEADS}]"
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
    if "lookup" in r and not _is_lookup(r["lookup"]):
        return f"lookup: an integer in [1, {MAX_LOOKUP}] (tokens copied from the text)"
    for key in ("posterior_threshold", "posterior_alpha"):
        t = r[key]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t <= 1.0:
            return f"{key}: a number in (0, 1]"
    return (_check_batch_trees(r.get("batch_trees", []), r["tree"], k)
            or ("adapt" in r and _check_adapt(r["adapt"], len(r["tree"]), k)) or None)


def _check_chains(r: dict) -> str | None:
    from rewriter.drafts.tree import MAX_NODES
    if set(r) - {"costs"} != CHAIN_KEYS:
        return f"drafter 'none': an object with exactly the keys {sorted(CHAIN_KEYS)} (and costs)"
    if not _is_lookup(r["lookup"]):
        return f"lookup: an integer in [1, {MAX_LOOKUP}] (tokens copied from the text)"
    if "costs" not in r:
        return None
    costs = r["costs"]
    what = (f"costs: a list of [batch, [verify cost of 1 .. at least 2 and at most "
            f"{MAX_NODES + 1} tokens]], batches increasing from 1, costs positive numbers")
    if not isinstance(costs, list) or not costs or not all(
            isinstance(c, list) and len(c) == 2 and _is_int(c[0]) and _is_curve(c[1])
            for c in costs):
        return what
    batches = [c[0] for c in costs]
    if batches[0] != 1 or batches != sorted(set(batches)):
        return what
    return None


def _check_batch_trees(v, tree: list, depth: int) -> str | None:
    from rewriter.drafts.tree import check_paths
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
        why = check_paths(sub, depth)
        if why:
            return f"batch_trees: batch {b}: {why}"
        if sub != sorted(sub, key=lambda p: (len(p), p)) or not all(p in tree for p in sub):
            return f"batch_trees: batch {b}: paths of the tree, ordered by depth, then ranks"
    return None


def _check_adapt(v, nodes: int, depth: int) -> str | None:
    from rewriter.drafts.tree import MAX_NODES, MAX_RANK
    if not isinstance(v, dict) or set(v) != {"accuracy", "costs"}:
        return "adapt: an object with the keys accuracy and costs"
    acc = v["accuracy"]
    if not isinstance(acc, list) or len(acc) != depth or not all(
            isinstance(a, list) and 1 <= len(a) <= MAX_RANK and all(_is_number(x, 0, 1) for x in a)
            and sum(a) <= 1 + 1e-6 for a in acc):
        return (f"adapt: accuracy: {depth} lists (one a head) of at most {MAX_RANK} "
                f"rank accuracies in [0, 1], each summing to at most 1")
    costs = v["costs"]
    # (a batch's costs may stop short of the tree: its sub-trees are cut to them, and
    # where no tree pays only a copied chain's are measured)
    what = (f"adapt: costs: a list of [batch, heads cost, [verify cost of 1 .. at least "
            f"2 and at most {MAX_NODES + 1} tokens]], batches increasing from 1, the first "
            f"at least {nodes + 1} long, costs positive numbers")
    if not isinstance(costs, list) or not costs or not all(
            isinstance(c, list) and len(c) == 3 and _is_int(c[0]) and _is_number(c[1], 0, 1e3)
            and _is_curve(c[2]) for c in costs):
        return what
    batches = [c[0] for c in costs]
    if batches[0] != 1 or batches != sorted(set(batches)) or len(costs[0][2]) < nodes + 1:
        return what
    return None


def _is_curve(v) -> bool:
    """A round's cost verifying 1, 2, .. tokens: 2 to MAX_NODES + 1 positive numbers."""
    from rewriter.drafts.tree import MAX_NODES
    return (isinstance(v, list) and 2 <= len(v) <= MAX_NODES + 1
            and all(_is_number(x, 1e-3, 1e3) for x in v))


def _is_lookup(v) -> bool:
    return _is_int(v) and 1 <= v <= MAX_LOOKUP


def _is_number(v, low: float, high: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
