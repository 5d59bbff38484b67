"""Model factories shared by the tests: small seeded Hugging Face decoders of each family."""
from __future__ import annotations

import copy
import functools
import os
import warnings

import pytest
import torch

# Without a GPU the Triton backend runs through Triton's interpreter, which is chosen when
# a kernel is defined: set it before anything imports rewriter.codegen.
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
import transformers as T

# Under pytest-xdist (``-n auto``: one worker per core) each worker gets its share of the
# cores, so the workers' torch thread pools do not fight over them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

warnings.filterwarnings("ignore", message=".*(bos|eos)_token_id.*")

# Two configs per family, covering GQA/MQA, head dims that are not powers of two, odd
# layer counts, biases, sliding windows and a head_dim that does not divide hidden_size.
CONFIGS = {
    "llama-gqa-3l": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)),
    "llama-hd24-2l": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        vocab_size=100, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        rope_theta=500.0)),
    "qwen2-mqa-3l": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128)),
    "qwen2-hd20-2l": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(
        vocab_size=128, hidden_size=80, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)),
    "mistral-window-3l": (T.MistralForCausalLM, T.MistralConfig, dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
        max_position_embeddings=128)),
    "mistral-hd12-2l": (T.MistralForCausalLM, T.MistralConfig, dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, sliding_window=None,
        max_position_embeddings=128)),
    "gpt2-3l": (T.GPT2LMHeadModel, T.GPT2Config, dict(
        vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=128)),
    "gpt2-hd12-2l": (T.GPT2LMHeadModel, T.GPT2Config, dict(
        vocab_size=128, n_embd=72, n_layer=2, n_head=6, n_positions=128)),
}

# (batch, sequence) pairs run through one trace.
SHAPES = [(1, 1), (2, 7), (3, 13), (1, 32)]


def make_model(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    cls, config_cls, kwargs = CONFIGS[name]
    torch.manual_seed(seed)
    config = config_cls(**{**kwargs, **overrides})
    return cls(config).eval()


def traced_model(name: str, **overrides):
    """(model, trace) of ``make_model(name, **overrides)``, made and traced once per test
    process: tests that only optimize the model build their pipelines from copies of the
    trace (``rewriter.optimize(trace, passes)``). The model is shared: leave it as it is.
    The global random state is left as ``make_model`` leaves it, as if it had run again."""
    model, traced, state = _traced(name, tuple(sorted(overrides.items())))
    torch.set_rng_state(state)
    return model, traced


@functools.cache
def _traced(name: str, overrides: tuple):
    import rewriter
    model = make_model(name, **dict(overrides))
    state = torch.get_rng_state()
    return model, rewriter.trace(model), state


def drop_layers(model: torch.nn.Module, skip: set[int]) -> torch.nn.Module:
    """The Hugging Face model with ``skip`` layers deleted and its config updated."""
    m = copy.deepcopy(model)
    body = m.transformer if hasattr(m, "transformer") else m.model
    name = "h" if hasattr(m, "transformer") else "layers"
    kept = [layer for i, layer in enumerate(getattr(body, name)) if i not in skip]
    setattr(body, name, torch.nn.ModuleList(kept))
    for i, layer in enumerate(kept):  # renumber the cache index HF generate uses
        for mod in layer.modules():
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = i
    m.config.num_hidden_layers = len(kept)
    if getattr(m.config, "layer_types", None) is not None:
        m.config.layer_types = [t for i, t in enumerate(m.config.layer_types) if i not in skip]
    return m


def hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def assert_close_rel(actual, expected, rel=1e-5):
    """Equal to ``rel`` relative to the largest magnitude of ``expected``."""
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max() / scale
    assert err <= rel, f"relative error {err:.3g} > {rel}"


def assert_positions_mean_hf(model, opt, ids, pos):
    """Explicit ``positions`` give Hugging Face's logits for the same ``position_ids``."""
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert_close_rel(opt(ids, positions=pos), ref)


def optimize_once(make):
    """``get(name)`` -> (hf model, OptimizedModel), each ``make(name)`` built and traced once."""
    import rewriter
    cache = {}

    def get(name):
        if name not in cache:
            model = make(name)
            cache[name] = (model, rewriter.optimize(model))
        return cache[name]
    return get


@pytest.fixture(scope="session")
def tp_ranks(tmp_path_factory) -> list[dict]:
    """Every tensor-parallel scenario (tests/tp_scenarios.py) run on two gloo ranks in one
    launch, per rank its results (tests/tp_tools.py). Tests using it carry
    ``pytest.mark.xdist_group("tp")``, so under ``--dist loadgroup`` one worker launches."""
    from tp_tools import launch_every_scenario
    return launch_every_scenario(tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="session")
def optimized_cache():
    """Trace each config once per session: ``get(name)`` -> (hf model, OptimizedModel)."""
    return optimize_once(make_model)


@pytest.fixture(scope="session")
def varied_cache():
    """Like ``optimized_cache`` but with ``initializer_range=0.2``: weights large enough that
    greedy continuations vary instead of repeating one token, so parity tests mean something."""
    import rewriter
    cache = {}

    def get(name):
        if name not in cache:
            model = make_model(name, initializer_range=varied_init(name))
            cache[name] = (model, rewriter.optimize(model))
        return cache[name]
    return get


def varied_init(name: str) -> float:
    """An ``initializer_range`` that gives varied greedy continuations (GPT-2's LayerNorm
    model needs larger weights than the RMSNorm families)."""
    return 0.5 if name.startswith("gpt2") else 0.2


def hf_greedy(model, ids, new_tokens, attention_mask=None):
    """Hugging Face greedy generation of exactly ``new_tokens`` tokens (no EOS stop)."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)


def oracle_drafts(monkeypatch, continuations, vocab: int) -> dict:
    """Make draft-head decoding draft the right answer: every tree node on the all-rank-0
    chain gets plain greedy's true next token (``continuations[r]``: row ``r``'s generated
    tokens), every other node a wrong one. Rounds then accept whole chains, so paths end
    at every depth, K/V rows move, EOS falls inside accepted paths. Returns a record of the
    accepted drafts (``accepted``: per round, per row, the drafted tokens kept)."""
    import torch
    from rewriter.runtime.decoding.tree import rounds as td
    seen = {"accepted": []}
    real_accept = td.TreeRounds.accept

    def accept(self, logits, tokens, lay):
        paths, bonus = real_accept(self, logits, tokens, lay)
        self._oracle_paths = paths
        seen["accepted"].append([tokens[r, p].tolist() for r, p in enumerate(paths)])
        return paths, bonus

    def draft_from(self, h, root):
        b = root.shape[0]
        if getattr(self, "_oracle_pos", None) is None:
            self._oracle_pos = [0] * b  # the root is each row's first generated token
        else:
            self._oracle_pos = [p + len(q) + 1 for p, q in zip(self._oracle_pos, self._oracle_paths)]
        nodes = torch.zeros(b, self.tree.size, dtype=torch.int64, device=root.device)
        nodes[:, 0] = root
        for i, path in enumerate(self.tree.paths, start=1):
            for r in range(b):
                j = self._oracle_pos[r] + len(path)
                true = int(continuations[r][j]) if j < len(continuations[r]) else 0
                nodes[r, i] = true if not any(path) else (true + 1 + path[-1]) % vocab
        self.nodes = nodes
        self.drafted = None  # what the adaptive tree counts: head d's rank 0 is the true token
        if not self.hydra and self.tree.size > 1:
            drafted = torch.zeros(b, len(self.ranks), max(self.ranks), dtype=torch.int64)
            for r in range(b):
                for d in range(len(self.ranks)):
                    j = self._oracle_pos[r] + d + 1
                    true = int(continuations[r][j]) if j < len(continuations[r]) else 0
                    drafted[r, d] = torch.tensor([true] + [(true + 1 + k) % vocab
                                                           for k in range(1, max(self.ranks))])
            self.drafted = drafted.to(root.device)

    monkeypatch.setattr(td.TreeRounds, "accept", accept)
    monkeypatch.setattr(td.TreeRounds, "draft_from", draft_from)
    return seen


def assert_same_distribution(a, b, columns, vocab: int) -> None:
    """Two-sample chi-square: each of ``columns`` of the samples ``a`` and ``b`` ``[N, S]``
    (rows drawn independently) has one distribution, to 5 standard deviations."""
    import torch
    for col in columns:
        ca, cb = (torch.bincount(x[:, col], minlength=vocab).float() for x in (a, b))
        seen = (ca + cb) > 0
        stat = (((ca[seen] - cb[seen]) ** 2) / (ca[seen] + cb[seen])).sum().item()
        dof = int(seen.sum()) - 1
        assert stat < dof + 5 * (2 * dof) ** 0.5, (col, stat, dof)


def reference_greedy(opt, row: list[int], new: int) -> torch.Tensor:
    """Greedy decoding through the whole-sequence graph (``opt(ids)``, no KV cache): the
    reference a runtime with a cache policy (a ring, a token selection) must equal."""
    ids = torch.tensor([row])
    for _ in range(new):
        ids = torch.cat([ids, opt(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0]


def fixed_round_work(monkeypatch, fixed: float = 0.0) -> list:
    """Make the runtime's measurer (``RuntimeMeasurer.round_times``) report a round's own
    work as ``fixed`` decode programs and a plain step as one (no timing): for tests of the
    pass's choices under costs they set. Returns the calls made, as (tree, batches)."""
    from rewriter.measure import round_cost
    from rewriter.runtime.measurer import RuntimeMeasurer
    calls = []

    def round_times(self, ir, strategy, batches, vocab=None, new=round_cost.NEW):
        calls.append((strategy.tree, tuple(batches)))
        return {b: {"decode": 1.0, "plain": 1.0, "round": 1.0 + fixed, "fixed": fixed}
                for b in batches}
    monkeypatch.setattr(RuntimeMeasurer, "round_times", round_times)
    return calls


def measured_costs(monkeypatch, slope=0.0, heads: float = 0.0) -> None:
    """Make the runtime's measurer report costs instead of timing them (``fixed_round_work``
    with none fixed): verifying ``s`` more tokens costs ``1 + slope * s`` decode steps
    (``slope`` a number, or a dict by batch size, read at each call), a heads call ``heads``."""
    from rewriter.runtime.measurer import RuntimeMeasurer
    fixed_round_work(monkeypatch)
    per = (lambda b: slope[b]) if isinstance(slope, dict) else (lambda b: slope)
    monkeypatch.setattr(RuntimeMeasurer, "verify_cost", lambda self, ir, most, runs=15, batch=1:
                        [0.0] + [1.0 + per(batch) * s for s in range(most)])
    monkeypatch.setattr(RuntimeMeasurer, "heads_cost", lambda *a, **k: heads)


class Clock:
    """A stand-in for ``time.perf_counter`` that moves ``tick`` seconds at every read: a
    deadline or time budget passes after a known number of reads."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def random_draft(model, path, seed=0, scale=1.0):
    """An EAGLE draft file for ``model`` with seeded random weights (``scale`` on its linears)."""
    from rewriter.drafts import eagle, eagle_file
    h = model.config.hidden_size
    heads = 4 if h % 8 == 0 else 2
    shape = eagle.Shape(h, heads, heads // 2 if (h // heads) % 2 == 0 else heads, 2 * h)
    p = eagle.init(shape, torch.Generator().manual_seed(seed))
    p = {k: v * scale if v.dim() == 2 else v for k, v in p.items()}
    eagle_file.made(p, shape, model.get_output_embeddings().weight.detach()).save(path)
    return path
