"""Tokens a round of two drafts under the same trees, replayed on the model's own greedy
text: Hydra heads against an EAGLE draft layer, before building the second into the
runtime.

    python benchmarks/draft_rounds.py --eagle DRAFT.safetensors [--heads smollm2]
        [--nodes 8 16] [--expand 4] [--new 96]

The model answers the chat questions (``speculative.py --chat wide``) greedily with plain
decoding; that text is what a lossless round must reproduce. Then, for each draft and
tree budget, rounds are replayed over it as ``runtime.decoding.tree.rounds`` runs them: the
draft grows a tree of ``--nodes`` tokens from its own probabilities
(``runtime.decoding.tree.dynamic.grow``, EAGLE-2's dynamic tree, expanding ``--expand`` nodes a
level), the round accepts the longest path of the tree that the text follows, and the
next round starts after it and the model's own next token. The model's features are its
last hidden states over the whole text in one forward (what verification gives, without
a multi-token round's rounding). Nothing is timed: a round's cost is the runtime's
business (``speculative.py``); this compares what the drafts get right.

- Hydra: head ``d`` reads the feature at the round's last accepted position and the
  embeddings of the node's path (``rewriter.drafts.heads``), as the runtime's head programs do.
- EAGLE (``rewriter.drafts.eagle``): its own cache over the accepted text, caught up each round
  over the positions accepted (their true features); each level of the tree runs
  ``eagle.tree_step`` over the expanded nodes, each below its own path.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

from rewriter.drafts import eagle, eagle_file
from rewriter.drafts import heads as heads_file
from rewriter.models.checkpoints import cast
from rewriter.runtime.decoding.tree.dynamic import grow

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import CHAT_PROMPTS, WIDE_CHAT, load  # noqa: E402
from step_time import machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--eagle", default=None, help="an EAGLE draft file (rewriter.drafts.eagle_file)")
    ap.add_argument("--heads", default="smollm2", help="a Hydra heads file, or 'smollm2'; "
                                                       "'none' to skip")
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--expand", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="each draft's logits divided by T before its tree is grown (the runtime's "
                         "T is 1: a probe of whether softer or sharper scores grow better trees)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft from the N tokens each file counts most produced, as "
                         "draft_vocab=N does (0: the whole vocabulary)")
    ap.add_argument("--depth", type=int, default=4, help="the deepest draft level")
    ap.add_argument("--new", type=int, default=96, help="greedy tokens an answer runs to")
    ap.add_argument("--chat", default="wide", choices=["eval", "wide"])
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--texts", default=None,
                    help="a JSON file of the greedy answers: read if it exists (made with the "
                         "same --model, --chat, --questions and --new), else written")
    ap.add_argument("--json", default="benchmarks/results/draft_rounds.json")
    args = ap.parse_args()
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        ap.error(f"--temperature must be a positive number, got {args.temperature}")
    if min(args.nodes) < 2 or args.expand < 1 or args.depth < 1 or args.new < 1:
        ap.error("--nodes must be >= 2, --expand, --depth and --new >= 1")
    if args.draft_vocab < 0 or 0 < args.draft_vocab < 10:
        ap.error("--draft-vocab must be 0 (the whole vocabulary) or >= 10")
    import rewriter
    from rewriter.runtime.chat import chat_prompt
    model, tok = load(args.model)
    model = cast(model, torch.float32).eval()
    lm = model.lm_head.weight.detach()  # [V, H]
    embed = model.model.embed_tokens.weight.detach()  # [V, H]
    drafts = {}
    project = lambda counts: Projection(lm, counts, args.draft_vocab, args.temperature)  # noqa: E731
    try:  # checked before the answers are made: minutes
        if args.heads != "none":
            heads = heads_file.load(args.heads, "hydra")
            heads.fits(lm, str(args.heads))
            if args.depth > heads.num_heads:
                ap.error(f"--depth {args.depth}: the heads {args.heads} go {heads.num_heads} deep")
            drafts["Hydra heads"] = HydraDraft(heads, project(heads.counts), embed)
        if args.eagle is not None:
            d = eagle_file.load(args.eagle)
            d.fits(lm, args.eagle)
            drafts["EAGLE layer"] = EagleDraft(d, project(d.counts), embed)
    except (heads_file.HeadsFileError, eagle_file.DraftFileError) as e:
        ap.error(str(e))
    if not drafts:
        ap.error("nothing to compare: give --eagle, --heads or both")
    engine = rewriter.optimize(model, tokenizer=tok)
    pool = WIDE_CHAT if args.chat == "wide" else CHAT_PROMPTS
    texts = []
    began = time.perf_counter()
    key = {"model": args.model, "chat": args.chat, "questions": args.questions, "new": args.new}
    if args.texts and Path(args.texts).is_file():
        saved = json.loads(Path(args.texts).read_text())
        if saved.get("key") != key:
            ap.error(f"--texts {args.texts} holds answers made with {saved.get('key')}, not {key}")
        texts = [tuple(t) for t in saved["texts"]]
    for q in pool[:args.questions] if not texts else ():
        prompt = chat_prompt(engine.tokenizer, engine.text, q)
        out = engine.generate(torch.tensor([prompt]), max_new_tokens=args.new)[0].tolist()
        end = next((i + 1 for i in range(len(prompt), len(out))
                    if out[i] in engine.eos_token_ids), len(out))
        texts.append((len(prompt), out[:end]))
    if args.texts and not Path(args.texts).is_file():
        Path(args.texts).write_text(json.dumps({"key": key, "texts": texts}))
    print(f"{len(texts)} answers, {sum(len(t) - p for p, t in texts)} tokens "
          f"({time.perf_counter() - began:.0f} s)", flush=True)
    rows, results = [], []
    with torch.no_grad():
        features = [model.model(torch.tensor([t])).last_hidden_state[0] for _, t in texts]  # [L, H]
        for name, draft in drafts.items():
            for nodes in args.nodes:
                made, rounds, depths = 0, 0, [0] * (args.depth + 1)
                for (start, text), f in zip(texts, features):
                    got = replay(draft, text, f, start, nodes, args.depth, args.expand)
                    made += sum(m for _, m in got)
                    rounds += len(got)
                    for a, _ in got:
                        depths[a] += 1
                per = made / rounds
                results.append({"draft": name, "nodes": nodes, "expand": args.expand,
                                "tokens_per_round": round(per, 3), "rounds": rounds,
                                "accepted_depths": depths})
                rows.append([name, nodes, f"{per:.2f}", rounds, depths])
                print(results[-1], flush=True)
    print(tabulate(rows, headers=["draft", "tree nodes", "tokens a round", "rounds",
                                  "rounds by accepted depth"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "cpu": machine(),
                                           "torch": torch.__version__, "results": results},
                                          indent=1))


def replay(draft, text: list, f: torch.Tensor, start: int, nodes: int, depth: int,
           expand: int) -> list[tuple[int, int]]:
    """Each round's accepted depth over ``text`` from position ``start`` (the first answer
    token is the model's, after the prompt's prefill), and the tokens it made: the
    accepted drafts and the model's token after them, where the text has one."""
    n = start  # the root x_n: the model's own token, not yet in the cache
    draft.begin(text, f, n)
    got = []
    while n < len(text) - 1:
        root = torch.tensor([text[n]])
        tree, tokens, _ = grow(draft.call, root, nodes, depth, expand)
        accepted, node = 0, ()
        index = {p: i for i, p in enumerate(tree.paths, start=1)}
        while n + accepted + 1 < len(text):
            child = next((p for p in tree.paths if p[:-1] == node and len(p) == len(node) + 1
                          and int(tokens[0, index[p]]) == text[n + accepted + 1]), None)
            if child is None:
                break
            node, accepted = child, accepted + 1
        got.append((accepted, min(accepted + 1, len(text) - 1 - n)))  # no token after the text
        if n + accepted + 1 >= len(text) - 1:  # no root left to draft after
            break
        draft.advance(text, f, n, accepted + 1)
        n += accepted + 1
    return got


class Projection:
    """The LM head a draft guesses through: all of it, or (``n``) the rows of the ``n``
    tokens ``counts`` ranks most produced, as the runtime's ``draft_vocab=n``; the logits
    divided by ``temperature`` (the runtime's is 1)."""

    def __init__(self, lm: torch.Tensor, counts, n: int, temperature: float = 1.0):
        if n and counts is None:
            raise SystemExit("draft_rounds: --draft-vocab needs draft files that count their tokens")
        self.ids = eagle_file.draft_vocab(counts, n) if n else None
        self.w = lm if self.ids is None else lm[self.ids]  # [V or n, H]
        self.temperature = temperature

    def top(self, g: torch.Tensor):
        """The 8 likeliest tokens after each feature ``g`` ``[P, H]``: (log-probabilities,
        token ids), each ``[1, P, 8]``."""
        top = ((g @ self.w.t()) / self.temperature).log_softmax(-1).topk(8, dim=-1)
        ids = top.indices if self.ids is None else self.ids[top.indices]
        return top.values[None], ids[None]


class HydraDraft:
    def __init__(self, heads, lm, embed):
        f = lambda t: t.float()  # noqa: E731  (a file may hold bfloat16)
        self.w, self.b = [f(w) for w in heads.w], f(heads.b)
        self.deep = tuple(map(f, heads.deep)) if heads.deep is not None else None
        self.lm, self.embed = lm, embed

    def begin(self, text, f, n):
        self.h = f[n - 1]  # [H] the feature whose next token is the root

    def advance(self, text, f, n, k):
        self.h = f[n + k - 1]

    def call(self, d: int, chains: torch.Tensor):
        _, p, _ = chains.shape  # [1, P, d + 1]
        h = self.h.expand(p, -1)
        x = torch.cat([h, self.embed[chains[0]].flatten(1)], -1)  # [P, H (d + 2)]
        r = h + F.silu(x @ self.w[d].t() + self.b[d])
        if self.deep is not None:
            for v, c in zip(*self.deep):
                r = r + F.silu(r @ v[d].t() + c[d])
        return self.lm.top(r)


class EagleDraft:
    def __init__(self, d, lm, embed):
        self.p, self.shape, self.lm, self.embed = d.params, d.shape, lm, embed

    def begin(self, text, f, n):
        self.cache = eagle.empty_cache(self.shape, 1)
        self._catch_up(text, f, 0, n)

    def advance(self, text, f, n, k):
        self._catch_up(text, f, n, n + k)

    def _catch_up(self, text, f, a, b):
        """Positions ``a .. b - 1``: the model's feature there beside the next token's
        embedding (``x_b`` is the next round's root)."""
        out, self.cache = eagle.step(self.p, self.shape, f[None, a:b],
                                     self.embed[torch.tensor(text[a + 1:b + 1])][None], self.cache)
        self.g = out[0, -1]  # [H] guesses x_{b + 1}
        self.memo = {(): (self.g, None)}  # a drafted path -> (its feature, its keys, values)

    def call(self, d: int, chains: torch.Tensor):
        paths = [tuple(c[1:].tolist()) for c in chains[0]]  # [P] the drafted tokens
        if d == 0:
            g = self.g[None]
        else:
            parents = [self.memo[p[:-1]] for p in paths]
            feature = torch.stack([q[0] for q in parents])  # [P, H]
            path = None if d == 1 else tuple(torch.stack([q[1][i] for q in parents]) for i in (0, 1))
            g, k, v = eagle.tree_step(self.p, self.shape, feature,
                                      self.embed[chains[0, :, -1]], self.cache, path,
                                      self.cache[0].shape[2] + d - 1)
            for i, pth in enumerate(paths):
                own = (k[i:i + 1], v[i:i + 1]) if path is None else \
                    (torch.cat([path[0][i:i + 1], k[i:i + 1]], 2),
                     torch.cat([path[1][i:i + 1], v[i:i + 1]], 2))
                self.memo[pth] = (g[i], (own[0][0], own[1][0]))
        return self.lm.top(g)


if __name__ == "__main__":
    main()
