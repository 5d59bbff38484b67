"""Greedy tokens of every decoding strategy and sparse pass, recorded before issue 58's
restructuring of the decoding strategies, to show that it changes no output.

    python tests/golden/behaviour/record.py --model default --out tests/golden/behaviour/default.json
    python tests/golden/behaviour/record.py --model smollm2 --out tests/golden/behaviour/smollm2.json
    python tests/golden/behaviour/record.py --model smollm2 --check tests/golden/behaviour/smollm2.json
    python tests/golden/behaviour/record.py --model default --check F --cases plain,quest
    python tests/golden/behaviour/record.py --make-artifacts tests/golden/artifacts  # made once

Each case is a list of passes run on the model (traced once; each case's passes run on a
copy of the traced IR, as ``rewriter.optimize`` runs them), in float32, greedy, with the
model's own end-of-sequence token, on one torch thread (``--threads``; the recordings
checked the same with 2), ``engine.fallback = False`` (the speed guard would otherwise pick
plain steps or rounds by timing). Its tokens are generated for each prompt
alone (``batch1``) and for all prompts as one left-padded batch of different lengths
(``ragged``: a list of id lists, as ``generate`` pads them); only the new tokens are kept
(a row that ended holds the pad id after its end).

Nothing is timed. Where a pass would measure costs on this machine (``tree="auto"``,
``adapt=True``, ``calibrate=``), the case gives the tree, the skip set and the chain length
itself, and the costs an adaptive tree or chain decides by are written into the decoding
record by the ``Pin`` pass (the record's documented form, ``rewriter.decoding``, which
artifacts store), so the output depends on nothing but the code.

Output: ``{case: {"params": spec, "batch1": [[ids]..], "ragged": [[ids]..], "stats": ..}}``
and ``"_meta"`` (the prompts as text and ids, max_new_tokens, torch version, threads).
``--check`` re-generates from the stored prompt ids and prints every case whose tokens
differ (exit status 1); ``params`` (each pass as its spec) and ``stats`` (the engine's
counters: forward passes, rounds, accepted tokens, ..) are informational, and differences
in them are printed as notes only (a restructuring that keeps the tokens may still change
how many rounds a strategy takes: worth a look, not a failure).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import rewriter
from rewriter.decoding import check_record
from rewriter.api.optimized import OptimizedModel
from rewriter.ir.pass_manager import Pass, run_pipeline
from rewriter.passes import (DuoAttention, EagleDraft, FuseAddRMSNorm, FuseQKV, FuseRoPE,
                             FuseSwiGLU, HydraHeads, Int4Weights, LayerSkip, MedusaHeads,
                             PromptLookup, Quest, SelfSpeculative, StreamingAttention,
                             TidalDecode, to_spec)

MAX_NEW = 32

# The default model is a code model (trained on CPython's standard library).
DEFAULT_PROMPTS = [
    {"kind": "text", "text": "def fibonacci(n):\n"},
    {"kind": "text", "text": "import os\nimport sys\n\n\ndef main(argv):\n    "},
    {"kind": "text", "text": "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
                             "    def push(self, item):\n        self.items.append(item)\n\n"
                             "    def pop(self):\n"},
    {"kind": "text", "text": "for i in range(10):\n    print(i)\nfor j in range(10):\n"},
]
SMOLLM2_PROMPTS = [
    {"kind": "chat", "text": "What is the capital of France?"},
    {"kind": "chat", "text": "Write a Python function that reverses a string."},
    {"kind": "chat", "text": "Name three primary colors and say why they are primary."},
    {"kind": "text", "text": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
]

# A fixed tree for 4 heads (paths of ranks, by depth then ranks) and sub-trees of it.
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
TREE_2 = [[0], [1], [0, 0], [0, 0, 0]]
TREE_4 = [[0], [0, 0]]
FUSIONS = (FuseQKV, FuseSwiGLU, FuseAddRMSNorm, FuseRoPE)


class Pin(Pass):
    """Write what a pass would have measured (an adaptive tree's costs, a chain's costs, the
    sub-trees of larger batches) into the decoding record the passes before it wrote."""

    def __init__(self, record: dict):
        self.record = record

    def run(self, ir):
        r = {**ir.info["decoding"], **self.record}
        why = check_record(r)
        if why:
            raise ValueError(f"Pin: the record needs {why}")
        ir.info["decoding"] = r
        return ir


def _verify_costs(n: int, slope: float) -> list:
    """A round verifying 1 .. n tokens, in plain decode steps (a made-up, fixed curve)."""
    return [round(1.0 + slope * s, 4) for s in range(n)]


def heads_costs(nodes: int, batches=(1, 2, 4, 8)) -> list:
    """``adapt`` costs for a tree of ``nodes`` tokens (root included) and a chain of 4."""
    slopes = {1: 0.02, 2: 0.05, 4: 0.1, 8: 0.2}
    return [[b, round(0.03 * b ** 0.5, 4), _verify_costs(nodes + 4, slopes[b])] for b in batches]


def accuracy(weights: str, arch: str) -> list:
    """The shipped heads' held-out rank accuracies, as the pass records them (4 decimals)."""
    from rewriter.drafts import heads
    from rewriter.drafts.tree import MAX_RANK
    return [[round(x, 4) for x in a[:MAX_RANK]] for a in heads.load(weights, arch).accuracy]


def cases(model: str, draft: str) -> dict:
    """Case name -> the list of passes (built afresh on each call). ``draft``: an EAGLE
    draft file (the shipped one for SmolLM2, a seeded random one for the default model)."""
    small = model == "default"
    heads = model  # the shipped heads: rewriter/assets/heads/<model>-{medusa,hydra}
    vocab = 1024 if small else 4096  # a trimmed draft vocabulary
    skip = [3, 5] if small else [8, 12, 16, 20]
    att, mlp = ([2, 4], [3, 5]) if small else ([10, 14, 18], [12, 16, 20])
    drop = [2, 5] if small else [12, 18]
    n = len(TREE) + 1
    hydra_acc, medusa_acc = accuracy(heads, "hydra"), accuracy(heads, "medusa")
    adaptive = lambda acc: {  # noqa: E731 (the record tree="auto", adapt=True would write)
        "batch_trees": [[2, TREE_2], [4, TREE_4], [8, []]],
        "adapt": {"accuracy": acc, "costs": heads_costs(n)}}
    sparse_layers = [1, 3, 5] if small else [4, 10, 20]
    tidal = [0, 4] if small else [2, 14]
    eagle_vocab = None if small else 4096
    table = {
        "plain": lambda: [],
        "fusions": lambda: [f() for f in FUSIONS],
        "layer_skip": lambda: [LayerSkip(layers=drop)],
        "int4_weights": lambda: [Int4Weights()],
        "fusions_int4_weights": lambda: [*(f() for f in FUSIONS), Int4Weights()],
        # self-speculative: a skip set, sub-layers, a 4-bit draft
        "self_speculative": lambda: [SelfSpeculative(skip_layers=skip)],
        "self_speculative_sublayers": lambda: [SelfSpeculative(skip_attention=att, skip_mlp=mlp,
                                                               max_draft=6, threshold=0.3)],
        "self_speculative_int4": lambda: [SelfSpeculative(draft_weights="int4")],
        "self_speculative_int4_long": lambda: [SelfSpeculative(draft_weights="int4", max_draft=8,
                                                               threshold=0.0)],
        "self_speculative_int4_skip": lambda: [SelfSpeculative(draft_weights="int4",
                                                               skip_layers=skip[:1])],
        # draft heads: a fixed tree; trimmed vocabulary; typical acceptance (lossy: its tokens
        # depend on the tree); re-grown trees; copied chains; the adaptive tree
        "medusa_tree": lambda: [MedusaHeads(weights=heads, tree=TREE, adapt=False, lookup=0)],
        "medusa_tree_vocab": lambda: [MedusaHeads(weights=heads, draft_vocab=vocab, tree=TREE,
                                                  adapt=False, lookup=0)],
        "medusa_typical": lambda: [MedusaHeads(weights=heads, tree=TREE, adapt=False, lookup=0,
                                               acceptance="typical")],
        "medusa_dynamic": lambda: [MedusaHeads(weights=heads, tree=TREE, adapt=False, lookup=0,
                                               dynamic=4)],
        "medusa_adaptive_lookup": lambda: [MedusaHeads(weights=heads, tree=TREE, lookup=4),
                                           Pin(adaptive(medusa_acc))],
        "hydra_tree": lambda: [HydraHeads(weights=heads, draft_vocab=vocab, tree=TREE,
                                          adapt=False, lookup=0)],
        "hydra_tree_full_vocab": lambda: [HydraHeads(weights=heads, tree=TREE, adapt=False,
                                                     lookup=0)],
        "hydra_typical": lambda: [HydraHeads(weights=heads, draft_vocab=vocab, tree=TREE,
                                             adapt=False, lookup=0, acceptance="typical",
                                             posterior_threshold=0.2, posterior_alpha=0.4)],
        "hydra_dynamic": lambda: [HydraHeads(weights=heads, draft_vocab=vocab, tree=TREE,
                                             adapt=False, lookup=0, dynamic=4)],
        "hydra_dynamic_lookup": lambda: [HydraHeads(weights=heads, draft_vocab=vocab, tree=TREE,
                                                    adapt=False, lookup=4, dynamic=2)],
        "hydra_lookup": lambda: [HydraHeads(weights=heads, draft_vocab=vocab, tree=TREE,
                                            adapt=False, lookup=4)],
        # what HydraHeads(weights, draft_vocab) records with tree="auto" (its default)
        "hydra_adaptive_lookup": lambda: [HydraHeads(weights=heads, draft_vocab=vocab, tree=TREE,
                                                     lookup=4), Pin(adaptive(hydra_acc))],
        "hydra_adaptive": lambda: [HydraHeads(weights=heads, draft_vocab=vocab, tree=TREE,
                                              lookup=0), Pin(adaptive(hydra_acc))],
        # no tree pays at any batch size: rounds of a copied chain alone
        "hydra_chains_only": lambda: [HydraHeads(weights=heads, draft_vocab=vocab, tree=TREE,
                                                 lookup=4),
                                      Pin({"batch_trees": [[1, []]],
                                           "adapt": {"accuracy": hydra_acc,
                                                     "costs": heads_costs(n, (1,))}})],
        # EAGLE: a dynamic tree from a draft layer with its own cache
        "eagle": lambda: [EagleDraft(weights=draft, draft_vocab=eagle_vocab)],
        "eagle_lookup": lambda: [EagleDraft(weights=draft, draft_vocab=eagle_vocab, lookup=4)],
        "eagle_wide": lambda: [EagleDraft(weights=draft, draft_vocab=eagle_vocab, nodes=16,
                                          expand=3, depth=5)],
        "eagle_typical": lambda: [EagleDraft(weights=draft, draft_vocab=eagle_vocab,
                                             acceptance="typical")],
        # prompt lookup: every chain whole; as many copies as the (pinned) costs pay for
        "prompt_lookup": lambda: [PromptLookup(tokens=4, adapt=False)],
        "prompt_lookup_long": lambda: [PromptLookup(tokens=8, adapt=False)],
        "prompt_lookup_adaptive": lambda: [
            PromptLookup(tokens=4, adapt=False),
            Pin({"costs": [[b, _verify_costs(5, s)] for b, s in ((1, 0.03), (2, 0.06),
                                                                  (4, 0.12), (8, 0.25))]})],
        # sparse attention, small enough to bite at these lengths
        "streaming": lambda: [StreamingAttention(sinks=2, window=8)],
        "streaming_original_layers": lambda: [StreamingAttention(sinks=1, window=6,
                                                                 layers=sparse_layers,
                                                                 positions="original")],
        "duo_attention": lambda: [DuoAttention(heads, sinks=2, window=8)],
        "duo_attention_sparsity": lambda: [DuoAttention(heads, sparsity=0.5, sinks=2, window=6)],
        "quest": lambda: [Quest(page=4, budget=8, dense_layers=1, recent=2)],
        "quest_no_recent": lambda: [Quest(page=2, budget=6, dense_layers=0)],
        "tidal_decode": lambda: [TidalDecode(selection_layers=[0], top_k=8, recent=2)],
        "tidal_decode_own": lambda: [TidalDecode(selection_layers=tidal, top_k=6, recent=2,
                                                 select_own=True)],
        # combinations: fused ops under the strategies' programs
        # (a skip set goes without FuseAddRMSNorm: a fused add + norm joins two layers)
        "fusions_self_speculative": lambda: [FuseQKV(), FuseSwiGLU(), FuseRoPE(),
                                             SelfSpeculative(skip_layers=skip)],
        "fusions_self_speculative_int4": lambda: [*(f() for f in FUSIONS),
                                                  SelfSpeculative(draft_weights="int4")],
        "fusions_hydra_lookup": lambda: [*(f() for f in FUSIONS),
                                         HydraHeads(weights=heads, draft_vocab=vocab, tree=TREE,
                                                    adapt=False, lookup=4)],
        "fusions_eagle": lambda: [*(f() for f in FUSIONS),
                                  EagleDraft(weights=draft, draft_vocab=eagle_vocab)],
        "fusions_streaming": lambda: [*(f() for f in FUSIONS), StreamingAttention(sinks=2, window=8)],
        # (Quest reads the rotated q and k: before FuseRoPE)
        "quest_fusions": lambda: [Quest(page=4, budget=8, dense_layers=1, recent=2),
                                  *(f() for f in FUSIONS)],
    }
    return table


# ---------------------------------------------------------------- the model and prompts

def load_model(model: str):
    """(hf model, tokenizer) in float32."""
    if model == "default":
        return rewriter.default_model()
    from rewriter.models import gguf
    return gguf.load_gguf_model("smollm2"), gguf.load_gguf_tokenizer("smollm2")


def prompt_ids(base, prompts: list) -> list:
    from rewriter.runtime.chat import chat_prompt
    out = []
    for p in prompts:
        if p["kind"] == "chat":
            out.append(chat_prompt(base.tokenizer, base.text, p["text"]))
        else:
            out.append(base.tokenizer.encode(p["text"]).ids)
    return out


def random_draft(hf, path, seed: int = 0) -> str:
    """A seeded random EAGLE draft for ``hf`` (as ``tests/conftest.py``'s ``random_draft``)."""
    from rewriter.drafts import eagle, eagle_file
    h = hf.config.hidden_size
    heads = 4 if h % 8 == 0 else 2
    shape = eagle.Shape(h, heads, heads // 2 if (h // heads) % 2 == 0 else heads, 2 * h)
    p = eagle.init(shape, torch.Generator().manual_seed(seed))
    eagle_file.made(p, shape, hf.get_output_embeddings().weight.detach()).save(path)
    return str(path)


def weights_digest(path: str) -> str:
    """SHA-256 of a draft file's tensors (names, dtypes, shapes, values): what the draft is,
    whatever the file's metadata."""
    from safetensors.torch import load_file
    h = hashlib.sha256()
    for name, t in sorted(load_file(path).items()):
        h.update(f"{name}{t.dtype}{list(t.shape)}".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def with_passes(base: OptimizedModel, passes: list) -> OptimizedModel:
    """``base`` with ``passes`` run on a copy of its IR, as ``rewriter.optimize`` runs them
    (each verified after it), without tracing again."""
    ir = copy.deepcopy(base.ir)
    opt = OptimizedModel(ir, passes, run_pipeline(ir, passes), "torch", tokenizer=base.tokenizer)
    opt.lower()
    return opt


def generate(opt, ids: list, max_new: int) -> dict:
    """The new tokens of each prompt alone, then of all as one ragged batch, and the
    engine's counters over both."""
    opt.fallback = False  # no timing decides between rounds and plain steps
    out = {"batch1": []}
    for p in ids:
        out["batch1"].append(opt.generate([p], max_new_tokens=max_new)[0, len(p):].tolist())
    batch1 = dict(opt.stats)
    opt.stats.clear()
    width = max(len(p) for p in ids)
    out["ragged"] = opt.generate(ids, max_new_tokens=max_new)[:, width:].tolist()
    out["stats"] = {"batch1": _ints(batch1), "ragged": _ints(opt.stats)}
    return out


def _ints(stats) -> dict:
    return {k: (int(v) if float(v).is_integer() else round(float(v), 6)) for k, v in sorted(stats.items())}


def spec_of(passes: list, draft: str, draft_name: str) -> list:
    """Each pass as a ``--pass`` spec (the draft's temporary path named instead)."""
    out = []
    for p in passes:
        if isinstance(p, Pin):
            out.append({"pin": p.record})
            continue
        s = to_spec(p)
        out.append(s.replace(json.dumps(draft), json.dumps(draft_name)))
    return out


# ---------------------------------------------------------------- recording and checking

def setup(model: str, tmp: str, log=print):
    """(the traced model, the EAGLE draft's path or name, what the draft is) for ``model``
    (the default model's random draft written into ``tmp``; its tensors' digest is recorded,
    so a change in how it is made shows as such, not as a change in decoding)."""
    torch.manual_seed(0)
    start = time.perf_counter()
    hf, tok = load_model(model)
    base = rewriter.optimize(hf, tokenizer=tok)
    log(f"{model}: loaded and traced in {time.perf_counter() - start:.1f}s "
        f"({torch.get_num_threads()} threads, torch {torch.__version__})")
    if model == "default":
        draft = random_draft(hf, Path(tmp) / "draft.safetensors", seed=0)
        about = {"draft": "random EAGLE draft, seed 0 (tests/conftest.py random_draft)",
                 "sha256_tensors": weights_digest(draft)}
    else:
        draft, about = "smollm2", {"draft": "the shipped draft (rewriter/assets/eagle)"}
    return base, draft, about


def run_cases(model: str, base, draft: str, about: dict, ids: list, names: list, max_new: int,
              log=print) -> dict:
    table = cases(model, draft)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(table)}")
    out = {}
    for i, name in enumerate(names, 1):
        start = time.perf_counter()
        passes = table[name]()
        opt = with_passes(base, passes)
        result = generate(opt, ids, max_new)
        params = {"passes": spec_of(passes, draft, "<draft>" if model == "default" else "smollm2")}
        if any(isinstance(p, EagleDraft) for p in passes):
            params["eagle"] = about
        out[name] = {"params": params, **result}
        log(f"[{i}/{len(names)}] {name}: {time.perf_counter() - start:.1f}s  "
            f"batch1 {[len(r) for r in result['batch1']]}  ragged {len(result['ragged'])}x"
            f"{len(result['ragged'][0])}")
        del opt
    return out


def compare(expected: dict, got: dict) -> tuple[list, list]:
    """(differences, notes) between two recordings of the same cases."""
    diffs, notes = [], []
    for name, g in got.items():
        e = expected[name]
        if e["params"] != g["params"]:  # the same case, its parameters written otherwise now
            notes.append(f"{name}: params recorded {e['params']}, now {g['params']}")
        for part in ("batch1", "ragged"):
            if e[part] == g[part]:
                continue
            for row, (a, b) in enumerate(zip(e[part], g[part])):
                if a != b:
                    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    diffs.append(f"{name}: {part} row {row}: first difference at new token {at}: "
                                 f"recorded {a[at:at + 6]}, now {b[at:at + 6]} "
                                 f"(lengths {len(a)}, {len(b)})")
            if len(e[part]) != len(g[part]):
                diffs.append(f"{name}: {part}: {len(e[part])} rows recorded, {len(g[part])} now")
        if e.get("stats") != g.get("stats"):
            notes.append(f"{name}: stats recorded {e.get('stats')}, now {g.get('stats')}")
    return diffs, notes


ROWS = ("batch1", "ragged", "ids", "plain")  # lists of token rows: one row a line


def _fields(d: dict, pad: str) -> list:
    """``d``'s fields as JSON lines, each list of token rows one row a line."""
    lines, items = [], list(d.items())
    for j, (k, v) in enumerate(items):
        end = "," if j < len(items) - 1 else ""
        if k in ROWS and isinstance(v, list) and all(isinstance(r, list) for r in v):
            rows = ",\n".join(f"{pad} {json.dumps(r, separators=(',', ':'))}" for r in v)
            lines.append(f"{pad}{json.dumps(k)}: [\n{rows}\n{pad}]{end}")
        elif k in ROWS and isinstance(v, dict):
            lines += [f"{pad}{json.dumps(k)}: {{", *_fields(v, pad + " "), f"{pad}}}{end}"]
        else:
            lines.append(f"{pad}{json.dumps(k)}: {json.dumps(v)}{end}")
    return lines


def dumps(data: dict, cases: bool = True) -> str:
    """JSON with one line per token row (``cases``: a dict of such dicts)."""
    if not cases:
        return "\n".join(["{", *_fields(data, " "), "}"]) + "\n"
    lines, items = ["{"], list(data.items())
    for i, (name, case) in enumerate(items):
        lines += [f" {json.dumps(name)}: {{", *_fields(case, "  "),
                  " }" + ("," if i < len(items) - 1 else "")]
    return "\n".join([*lines, "}"]) + "\n"


# ---------------------------------------------------------------- artifact fixtures

ARTIFACT_IDS = [[3, 17, 42, 5, 9, 8, 60, 7, 9, 3, 17, 42], [1, 2, 3], [50, 51, 52, 50, 51, 52, 50]]
ARTIFACT_NEW = 24
ARTIFACT_GENERATE = {"max_new_tokens": ARTIFACT_NEW, "eos_token_id": []}  # every row full length
TINY_TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def tiny_model():
    """A seeded random 2-layer Llama (GQA, tied embeddings, vocabulary 128), weights large
    enough that greedy text varies (``initializer_range=0.2``)."""
    import transformers as T
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128, initializer_range=0.2,
                           tie_word_embeddings=True)
    return T.LlamaForCausalLM(config).eval()


def artifact_tokens(engine, stats: bool = False) -> dict:
    engine.fallback = False
    engine.stats.clear()
    out = {"batch1": [engine.generate([p], **ARTIFACT_GENERATE)[0, len(p):].tolist()
                      for p in ARTIFACT_IDS]}
    width = max(map(len, ARTIFACT_IDS))
    out["ragged"] = engine.generate(ARTIFACT_IDS, **ARTIFACT_GENERATE)[:, width:].tolist()
    if stats:  # informational: what the rounds did (the test compares tokens only)
        out["stats"] = _ints(engine.stats)
    return out


def make_artifacts(directory: str, log=print) -> None:
    """Save the artifact fixtures (``tests/golden/artifacts``) with the code as it is now,
    each with ``<name>.json`` beside it: the ids, the generate arguments and the tokens the
    loaded artifact decodes (checked equal to the model's before saving). Run once, before
    issue 58's restructuring; running it later would record the new code's artifacts."""
    from rewriter.runtime.engine_load import load
    root = Path(directory)
    hf = tiny_model()
    plain = artifact_tokens(rewriter.optimize(hf))
    with tempfile.TemporaryDirectory() as tmp:
        draft = random_draft(hf, Path(tmp) / "random-draft-seed0.safetensors", seed=0)
        made = {}
        # Hydra heads with a fixed tree, seeded random head weights, copied chains and the
        # adaptive tree's record (accuracies, costs, a sub-tree from 2 rows on)
        opt = rewriter.optimize(hf, [HydraHeads(num_heads=3, tree=TINY_TREE, lookup=2)])
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, w in sorted(opt.ir.weights().items()):
                if name.startswith("hydra."):
                    w.copy_(torch.randn(w.shape, generator=g) * 0.3)
        record = {**opt.ir.info["decoding"], "batch_trees": [[2, [[0], [0, 0]]]],
                  "adapt": {"accuracy": [[0.5, 0.2], [0.4, 0.2], [0.3, 0.1]],
                            "costs": [[1, 0.05, _verify_costs(8, 0.03)],
                                      [2, 0.08, _verify_costs(8, 0.08)]]}}
        assert check_record(record) is None, check_record(record)
        opt.ir.info["decoding"] = record
        made["hydra_adaptive"] = opt
        # an EAGLE draft layer (seeded random weights) growing a dynamic tree, with chains
        # (the file named relative to its directory: the artifact records the name)
        with contextlib.chdir(tmp):
            made["eagle"] = rewriter.optimize(hf, [EagleDraft(weights=Path(draft).name, nodes=6,
                                                              expand=2, depth=3, lookup=2)])
        for name, opt in made.items():
            before = artifact_tokens(opt)
            opt.save(root / name)
            engine = load(root / name)
            after = artifact_tokens(engine, stats=True)
            assert {k: after[k] for k in before} == before, (name, before, after)
            data = {"made": "by tests/golden/behaviour/record.py --make-artifacts, before issue "
                            "58's restructuring of the decoding strategies",
                    "passes": engine.pass_specs, "decoding": engine.ir.info["decoding"],
                    "ids": ARTIFACT_IDS, "generate": ARTIFACT_GENERATE, **after,
                    "plain": plain}
            (root / f"{name}.json").write_text(dumps(data, cases=False))
            log(f"{name}: saved {root / name}; same tokens as plain decoding: "
                f"{before == plain}; {after['stats']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("default", "smollm2"), default="default")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="write the recording here")
    what.add_argument("--check", help="re-generate and compare with this recording")
    what.add_argument("--list", action="store_true", help="print the case names")
    what.add_argument("--make-artifacts", metavar="DIR",
                      help="save the artifact fixtures into DIR (tests/golden/artifacts)")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine more threads "
                         "spin against other work; the tokens were the same with 2)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    if args.make_artifacts:
        make_artifacts(args.make_artifacts, log)
        return 0
    if args.list:
        print("\n".join(cases(args.model, "<draft>")))
        return 0
    prompts = DEFAULT_PROMPTS if args.model == "default" else SMOLLM2_PROMPTS
    expected = None
    if args.check:
        expected = json.loads(Path(args.check).read_text())
        if expected["_meta"]["model"] != args.model:
            raise SystemExit(f"{args.check} records model {expected['_meta']['model']!r}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base, draft, about = setup(args.model, tmp, log)
        ids = prompt_ids(base, prompts)
        max_new = MAX_NEW
        if expected is not None:  # the recorded prompts, whatever the tokenizer says now
            meta = expected["_meta"]
            if meta["ids"] != ids:
                log("note: the prompts tokenize differently now; using the recorded ids")
            ids, max_new = meta["ids"], meta["max_new_tokens"]
            names = args.cases.split(",") if args.cases else [k for k in expected if k != "_meta"]
        else:
            names = args.cases.split(",") if args.cases else list(cases(args.model, draft))
        got = run_cases(args.model, base, draft, about, ids, names, max_new, log)
    seconds = time.perf_counter() - start
    log(f"{len(got)} cases in {seconds:.0f}s")
    if expected is not None:
        missing = [n for n in names if n not in expected]
        if missing:
            raise SystemExit(f"cases not in {args.check}: {missing}")
        diffs, notes = compare(expected, got)
        for n in notes:
            print("note:", n)
        for d in diffs:
            print("DIFFERENT:", d)
        print(f"{len(got)} cases checked against {args.check}: "
              f"{'identical' if not diffs else f'{len(diffs)} differences'}")
        return 1 if diffs else 0
    meta = {"model": args.model, "max_new_tokens": max_new, "dtype": "float32", "greedy": True,
            "prompts": prompts, "ids": ids, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "seconds": round(seconds),
            "made": "before issue 58's restructuring of the decoding strategies"}
    Path(args.out).write_text(dumps({"_meta": meta, **got}))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
