"""The decoding strategies' records: each reads and writes its own ``ir.info["decoding"]``
form (the package's docstring) and checks it (``check``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from rewriter.decoding import checks

VERSION = 2  # the record's version: 1 had no version key (``version1``)


@dataclass(frozen=True)
class PlainDecoding:
    """One token per step: written as no record at all."""
    KIND: ClassVar[str] = "plain"

    def cache_slack(self) -> int:
        return 0

    def record(self) -> None:
        return None


@dataclass(frozen=True)
class SelfSpeculativeDecoding:
    """Drafts with the model's own layers, some skipped (or its weights in 4 bits)."""
    KIND: ClassVar[str] = "self_speculative"
    skip_layers: tuple[int, ...] = ()
    skip_attention: tuple[int, ...] = ()
    skip_mlp: tuple[int, ...] = ()
    max_draft: int = 1
    threshold: float = 0.0
    draft_weights: str = "dense"  # "int4": the draft reads the weights in 4 bits

    check = staticmethod(checks.check_self_speculative)

    def cache_slack(self) -> int:
        """A row that is done keeps being drafted for (its results dropped) at most one
        round past its end, and the last round may overshoot by one draft."""
        return 2 * (self.max_draft + 1)

    def record(self) -> dict:
        r = {"version": VERSION, "strategy": self.KIND, "skip_layers": list(self.skip_layers),
             "skip_attention": list(self.skip_attention), "skip_mlp": list(self.skip_mlp),
             "max_draft": self.max_draft, "threshold": self.threshold}
        if self.draft_weights != "dense":  # a dense draft is written with no key
            r["draft_weights"] = self.draft_weights
        return r

    @classmethod
    def from_record(cls, r: dict) -> SelfSpeculativeDecoding:
        return cls(tuple(r["skip_layers"]), tuple(r["skip_attention"]), tuple(r["skip_mlp"]),
                   r["max_draft"], float(r["threshold"]), r.get("draft_weights", "dense"))


@dataclass(frozen=True)
class TreeDecoding:
    """Rounds that verify a tree of drafted tokens (and copied chains); ``drafter``:
    "medusa", "hydra", "eagle", or "none" (copied chains alone)."""
    KIND: ClassVar[str] = "tree"
    drafter: str
    depth: int = 0  # the levels a round drafts: Medusa's and Hydra's heads, EAGLE's layer calls
    tree: tuple = ()  # paths of ranks (rewriter.drafts.tree)
    draft_vocab: Optional[int] = None  # the tokens the draft chooses among (None: all)
    acceptance: str = "exact"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    batch_trees: tuple = ()  # ((batch, paths), ..): from that batch on, a sub-tree (or none)
    accuracy: tuple = ()  # the heads' rank accuracies [K][R]: the adaptive tree's prior
    costs: tuple = ()  # ((batch, heads call, (round of 1, 2, .. tokens)), ..) in plain steps
    dynamic: int = 0  # > 0: the tree re-grown every round, expanding this many nodes a level
    lookup: int = 0  # > 0: a chain of this many tokens copied from the row's text, verified too

    check = staticmethod(checks.check_tree)

    @property
    def drafts(self) -> bool:
        """Whether a drafter guesses the tree (not copied chains alone)."""
        return self.drafter != "none"

    @property
    def level_by_level(self) -> bool:
        """Whether each level is drafted from its parents' paths (Hydra, EAGLE), not from
        the accepted position alone (Medusa)."""
        return self.drafter in ("hydra", "eagle")

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
        """A row that is done keeps being drafted for and verified (its results dropped) at
        most one round past its end, and the last round may overshoot by one draft."""
        return 2 * (len(self.tree) + 1 + self.lookup)

    def record(self) -> dict:
        if not self.drafts:
            r = {"version": VERSION, "strategy": self.KIND, "drafter": "none",
                 "lookup": self.lookup}
            if self.costs:
                r["costs"] = [[b, list(c)] for b, _, c in self.costs]
            return r
        r = {"version": VERSION, "strategy": self.KIND, "drafter": self.drafter,
             "depth": self.depth, "tree": [list(p) for p in self.tree],
             "draft_vocab": self.draft_vocab, "acceptance": self.acceptance,
             "posterior_threshold": self.posterior_threshold,
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

    @classmethod
    def from_record(cls, r: dict) -> TreeDecoding:
        if r["drafter"] == "none":
            return cls("none", lookup=r["lookup"],
                       costs=tuple((b, 0.0, tuple(c)) for b, c in r.get("costs", ())))
        adapt = r.get("adapt", {})
        return cls(r["drafter"], r["depth"], tuple(map(tuple, r["tree"])), r["draft_vocab"],
                   r["acceptance"], float(r["posterior_threshold"]),
                   float(r["posterior_alpha"]),
                   batch_trees=tuple((b, tuple(map(tuple, sub)))
                                     for b, sub in r.get("batch_trees", ())),
                   accuracy=tuple(tuple(a) for a in adapt.get("accuracy", ())),
                   costs=tuple((b, float(h), tuple(c)) for b, h, c in adapt.get("costs", ())),
                   dynamic=r.get("dynamic", 0), lookup=r.get("lookup", 0))
