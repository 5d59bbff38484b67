"""Could the draft's own confidence size each round's tree? Replayed rounds of the EAGLE
draft, a fixed tree size against one chosen every round, on the measured cost of verifying.

    python benchmarks/round_sizing.py --eagle DRAFT --costs benchmarks/results/verify_cost.json
        --texts T [--draft-cost 0.25] [--fixed 8 16 32] [--lambdas 1.4 1.6 1.8]

EAGLE-2 grows each round's tree from the draft's probabilities: a node's score is the
probability the draft gives its whole path, and were the draft calibrated, the sum of the
verified nodes' scores would be the round's expected accepted drafts. So a round could
verify as many of its best nodes as pay: ``n`` maximising ``E(n) - lambda * C(n)`` (a rate
``lambda`` of tokens per decode step; Dinkelbach's rule for the best long-run ratio), or
``E(n) / C(n)``, with ``E(n) = 1 + the n - 1 best scores`` and ``C(n)`` the measured cost of
verifying ``n`` tokens (``verify_cost.py``'s JSON, interpolated) plus ``--draft-cost`` decode
steps of drafting and the rest of a round.

The rounds are ``draft_rounds.py``'s (float32, the model's greedy answers to the wide chat
questions, ``--texts`` as there): each grows a tree of 63 nodes (4 levels, 8 expanded a
level, the 4096 most produced tokens) and verifies its ``n`` best nodes, a tree since a
child never scores above its parent. Printed per policy: tokens a round, tokens per decode
step of cost (the speed-up a round would give, prefill aside), and the mean ``E(n)`` the
draft predicted beside the drafts it got accepted plus one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tabulate import tabulate

from rewriter import eagle_file
from rewriter.checkpoints import cast
from rewriter.runtime import tree_dynamic

sys.path.insert(0, str(Path(__file__).resolve().parent))
import draft_rounds  # noqa: E402
from step_time import machine  # noqa: E402

SIZES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 63)  # the sizes a round may verify
GROWN = 63  # nodes a round grows; smaller trees are its best nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--eagle", required=True, help="an EAGLE draft file (rewriter.eagle_file)")
    ap.add_argument("--costs", required=True, help="verify_cost.py's JSON (this machine's curve)")
    ap.add_argument("--texts", required=True, help="draft_rounds.py --texts: the greedy answers")
    ap.add_argument("--draft-cost", type=float, default=0.25,
                    help="decode steps a round spends beside verifying (round_phases.py)")
    ap.add_argument("--fixed", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--lambdas", type=float, nargs="+", default=[1.4, 1.6, 1.8])
    ap.add_argument("--json", default="benchmarks/results/round_sizing.json")
    args = ap.parse_args()
    if any(n not in SIZES for n in args.fixed):
        ap.error(f"--fixed sizes must be among {SIZES}")
    if not args.draft_cost >= 0 or not all(lam > 0 for lam in args.lambdas):
        ap.error("--draft-cost must be >= 0 and --lambdas > 0")
    curve = {r["tokens"]: r["median"] for r in json.loads(Path(args.costs).read_text())["rows"]}
    if max(curve) < GROWN or 1 not in curve:
        ap.error(f"--costs must measure 1 to {GROWN} tokens (verify_cost.py --sizes ... 63)")
    cost = {n: _interpolate(curve, n) + args.draft_cost for n in SIZES}
    model, _ = draft_rounds.load(args.model)
    model = cast(model, torch.float32).eval()
    lm, embed = model.lm_head.weight.detach(), model.model.embed_tokens.weight.detach()
    try:
        d = eagle_file.load(args.eagle)
        d.fits(lm, args.eagle)
    except eagle_file.DraftFileError as e:
        ap.error(str(e))
    draft = draft_rounds.EagleDraft(d, draft_rounds.Projection(lm, d.counts, 4096), embed)
    saved = json.loads(Path(args.texts).read_text())
    if saved.get("key", {}).get("model") != args.model:
        ap.error(f"--texts {args.texts} holds answers of {saved.get('key')}, not of --model {args.model}")
    texts = [tuple(t) for t in saved["texts"]]
    with torch.no_grad():
        features = [model.model(torch.tensor([t])).last_hidden_state[0] for _, t in texts]  # [L, H]
    policies = [(f"fixed {n}", lambda E, n=n: n) for n in args.fixed]
    policies += [(f"E - {lam} C", lambda E, lam=lam: max(SIZES, key=lambda n: E[n] - lam * cost[n]))
                 for lam in args.lambdas]
    policies.append(("E / C", lambda E: max(SIZES, key=lambda n: E[n] / cost[n])))
    results = []
    for name, policy in policies:
        got = replay(draft, texts, features, policy, cost)
        results.append({"policy": name, **got})
        print(results[-1], flush=True)
    print(tabulate([[r["policy"], f"{r['tokens_per_round']:.3f}", f"{r['tokens_per_step']:.3f}",
                     f"{r['predicted']:.2f}", f"{r['accepted_plus_one']:.2f}", f"{r['mean_size']:.1f}"]
                    for r in results],
                   headers=["policy", "tokens a round", "tokens a decode step", "predicted E(n)",
                            "accepted + 1", "mean size"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "cpu": machine(), "torch": torch.__version__,
                                           "cost": cost, "results": results}, indent=1))


def _interpolate(curve: dict, n: int) -> float:
    below = max(s for s in curve if s <= n)
    above = min(s for s in curve if s >= n)
    if below == above:
        return curve[n]
    return curve[below] + (curve[above] - curve[below]) * (n - below) / (above - below)


def replay(draft, texts, features, policy, cost) -> dict:
    """Rounds over every text, each verifying ``policy(E)`` of its grown tree's best nodes."""
    made = rounds = got_plus_one = 0
    spent = predicted = size = 0.0
    with torch.no_grad():
        for (start, text), f in zip(texts, features):
            n = start
            draft.begin(text, f, n)
            while n < len(text) - 1:
                tree, tokens, scores = _grown(draft, text[n])
                grown = set(tree.paths)
                best = [p for p in tree_dynamic._ranked(scores) if p in grown]  # a tree at every cut
                E = {m: 1 + sum(scores[p] for p in best[:m - 1]) for m in SIZES}
                m = policy(E)
                accepted = _accepted(tree, tokens, set(best[:m - 1]), text, n)
                made += min(accepted + 1, len(text) - 1 - n)
                rounds += 1
                spent += cost[m]
                predicted += E[m]
                got_plus_one += accepted + 1
                size += m
                if n + accepted + 1 >= len(text) - 1:
                    break
                draft.advance(text, f, n, accepted + 1)
                n += accepted + 1
    return {"tokens_per_round": made / rounds, "tokens_per_step": made / spent, "rounds": rounds,
            "predicted": predicted / rounds, "accepted_plus_one": got_plus_one / rounds,
            "mean_size": size / rounds}


def _grown(draft, root: int):
    """``grow``'s tree, tokens and every candidate path's score (summed probability)."""
    seen = {}
    ranked = tree_dynamic._ranked

    def keep(scores):
        seen["scores"] = scores
        return ranked(scores)
    tree_dynamic._ranked = keep
    try:
        tree, tokens, _ = tree_dynamic.grow(draft.call, torch.tensor([root]), GROWN, 4, 8)
    finally:
        tree_dynamic._ranked = ranked
    return tree, tokens, seen["scores"]


def _accepted(tree, tokens, kept: set, text: list, n: int) -> int:
    """Drafts accepted: the longest path of ``kept`` nodes the text follows after ``n``."""
    index = {p: i for i, p in enumerate(tree.paths, start=1)}
    accepted, node = 0, ()
    while n + accepted + 1 < len(text):
        child = next((p for p in kept if p[:-1] == node
                      and int(tokens[0, index[p]]) == text[n + accepted + 1]), None)
        if child is None:
            break
        node, accepted = child, accepted + 1
    return accepted


if __name__ == "__main__":
    main()
