"""Fuzzing ``rewriter.load``: a tiny Llama's ``manifest.json`` or ``ir.json``, mutated at
random (deleted keys and items, changed types, deep nesting, renamed keys, injected
names, swapped node names, huge integers, NaN), checksums resealed so the mutation
reaches the parsers. Every case must either load and generate, or raise ArtifactError
(issue 10's acceptance). Seeded; the outcome counts are printed (``pytest -s``)."""
import json
import math
import re
import random
from collections import Counter

import pytest
import torch

import rewriter
from rewriter import ArtifactError

from artifact_tools import artifact_files, reseal
from test_artifact_contents import tiny_llama

SEED, CASES = 10, 300
PROMPT = torch.tensor([[1, 2, 3]])
INJECTED = ["x=__import__('os')", 'print("INJECTED")', "self", "__class__", "a.b", "\n",
            "torch", "", "ｘ", "model.norm.weight", "output", "aten.empty.memory_format"]


def paths(value):
    """Every path (a tuple of keys and indices) into a JSON value, at most 12 deep."""
    out, stack = [], [((), value)]
    while stack:
        prefix, v = stack.pop()
        out.append(prefix)
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        if len(prefix) < 12:
            stack.extend((prefix + (k,), c) for k, c in items)
    return out


def get(root, path):
    for key in path:
        root = root[key]
    return root


def nested(value, depth):
    for _ in range(depth):
        value = [value]
    return value


def replacement(value, rng):
    """A value of another type (or a hostile one) for ``value``."""
    choices = [_text(value), None, True, False, [value], {"x": value}, 1.5, 0, -1,
               10**30, 2**63, -2**63, math.nan, math.inf, -math.inf, rng.choice(INJECTED),
               nested(value, rng.choice([20, 200, 2000]))]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        choices += [value + 1, value - 1, value * 2, -value, float(value), int(value)]
    return rng.choice(choices)


def _text(value) -> str:
    try:
        return str(value)[:200]
    except RecursionError:  # a value an earlier mutation nested
        return "[[["


def mutate(data, rng, name):
    """One random edit of ``data`` in place (or a new root); its description."""
    top = rng.choice(sorted(data))  # a section first, so the big config is not most cases
    target = rng.choice(sorted(paths(data[top]), key=str))
    target = (top,) + target
    parent, key = get(data, target[:-1]), target[-1]
    kind = rng.choice(["delete", "replace", "replace", "rename", "inject", "nest", "swap",
                       "duplicate"])
    if kind == "delete":
        del parent[key]
    elif kind == "rename" and isinstance(parent, dict):
        new = rng.choice([key + "x", key.upper(), rng.choice(INJECTED)] + list(parent))
        parent[new] = parent.pop(key)
    elif kind == "inject" and isinstance(parent[key], str):
        parent[key] = rng.choice(INJECTED)
    elif kind == "nest":
        parent[key] = nested(parent[key], rng.choice([50, 500, 5000]))
    elif kind == "swap" and name == "ir.json" and "graph" in data:
        nodes = [n for n in data["graph"] if isinstance(n, dict) and "name" in n]
        if len(nodes) > 1:
            a, b = rng.sample(nodes, 2)
            a["name"], b["name"] = b["name"], a["name"]
    elif kind == "duplicate" and isinstance(parent, list):
        parent.insert(key, parent[key])
    else:
        kind = "replace"
        parent[key] = replacement(parent[key], rng)
    return f"{name} {kind} at {'/'.join(map(str, target))[:80]}"


def case(files, originals, rng):
    for name, data in originals.items():
        files[name].write_bytes(data)
    name = rng.choice(["manifest.json", "ir.json"])
    data = json.loads(originals[name])
    what = [mutate(data, rng, name) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    try:
        text = json.dumps(data)
    except (RecursionError, ValueError):  # nested past what json writes: write it by hand
        text = "[" * 100000 + "]" * 100000
    files[name].write_text(text)
    return "; ".join(what)


def outcome(directory) -> str:
    """'loaded' (and generated) or 'ArtifactError: <its problem, first words>'."""
    try:
        engine = rewriter.load(directory)
    except ArtifactError as e:
        file = re.search(r"(\w+\.\w+): ", str(e))
        problem = str(e).split(": ", 1)[-1]
        problem = problem.split(": ", 1)[-1] if problem.startswith("node ") else problem
        problem = re.sub(r"'[^']*'|\"[^\"]*\"|\[.*|\{.*|-?[0-9][\w.]*|/\S+", "_", problem)
        return f"ArtifactError ({file.group(1) if file else '?'}): {' '.join(problem.split()[:4])}"
    if not engine.ir.is_causal_lm:  # causal_lm flipped: a plain module, called for logits
        engine(PROMPT, torch.arange(3)[None])
        return "loaded (as a plain module)"
    steps = min(2, engine.max_len - PROMPT.shape[1])
    if steps < 1:
        return "loaded (context shorter than the prompt)"
    out = engine.generate(PROMPT, max_new_tokens=steps)
    assert out.shape[0] == 1 and out.shape[1] <= 3 + steps
    return "loaded"


@pytest.mark.slow
def test_mutated_artifacts_load_or_raise_artifact_error(tmp_path, capsys):
    directory = tmp_path / "a"
    rewriter.optimize(tiny_llama()).save(directory)
    files = artifact_files(directory)
    originals = {name: p.read_bytes() for name, p in files.items()
                 if name in ("manifest.json", "ir.json", "artifact.json")}
    rng = random.Random(SEED)
    counts, failures = Counter(), []
    for i in range(CASES):
        what = case(files, originals, rng)
        reseal(directory)
        try:
            counts[outcome(directory)] += 1
        except Exception as e:  # anything else is the bug this test exists to find
            failures.append(f"case {i} ({what}): {type(e).__name__}: {str(e)[:200]}")
    with capsys.disabled():
        print(f"\nfuzz: {CASES} mutated artifacts (seed {SEED})")
        for text, n in counts.most_common():
            print(f"{n:5d}  {text}")
    assert not failures, "\n".join(failures)
