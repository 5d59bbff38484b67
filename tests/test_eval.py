"""The evaluation harness on constructed cases: an identical pipeline scores 1.0, a model
without its middle layers scores measurably worse, the cost counters match hand counts."""
import pytest
import torch

import rewriter
from rewriter.models.checkpoints import load_hf_model, load_tokenizer
from rewriter.api.eval import EvalSettings, agreement, cost, evaluate, format_table
from rewriter.passes import LayerSkip

from conftest import traced_model

# one worker: its module fixtures are built once under --dist loadgroup
pytestmark = pytest.mark.xdist_group("eval")

SMALL = EvalSettings(ppl_chunks=2, ppl_length=128, prompts=3, prompt_length=24, new_tokens=12,
                     passkey_lengths=(256,), passkey_depths=(0.5,), passkey_trials=2,
                     timing_tokens=4)


@pytest.fixture(scope="module")
def default():
    """(tokenizer, trace, plain engine): the default model, traced once for every pipeline
    of this module."""
    traced = rewriter.trace(load_hf_model("default"))
    return load_tokenizer("default"), traced, rewriter.optimize(traced)


@pytest.fixture(scope="module")
def rows(default):
    """``evaluate``'s rows for the plain pipeline, the same model traced and optimized again
    (a second trace must agree with the first), and one without its middle layers: one
    evaluation, so the reference is measured once."""
    tok, traced, base = default
    gutted = rewriter.optimize(traced, passes=[LayerSkip(layers=[1, 2, 3, 4, 5, 6])])
    again = rewriter.optimize(load_hf_model("default"))
    return evaluate({"unoptimized": base, "again": again, "gutted": gutted}, tok, SMALL)


def test_identical_pipeline_agrees_fully(rows):
    again = rows[1]
    assert again["agreement"] == 1.0 and again["first_divergence"] == SMALL.new_tokens
    assert again["ppl_ratio"] == pytest.approx({"code": 1.0, "prose": 1.0}, abs=1e-6)
    assert again["exact_match"] == 1.0
    assert again["passkey"] == rows[0]["passkey"]
    assert "again" in format_table(rows)


def test_skipping_the_middle_layers_scores_worse(rows):
    ref, row = rows[0], rows[2]
    assert row["ppl_ratio"]["code"] > 1.5 and row["ppl_ratio"]["prose"] > 1.2
    assert row["agreement"] < 0.5 and row["first_divergence"] < SMALL.new_tokens
    assert row["layers_per_token"] == 2 and ref["layers_per_token"] == 8
    assert row["kv_bytes_per_token"] * 4 == ref["kv_bytes_per_token"]
    assert row["kv_read_per_step"] * 4 == ref["kv_read_per_step"]
    assert "KV read KiB" in format_table([ref, row])


def test_cost_counters_match_hand_counts():
    opt = rewriter.optimize(traced_model("llama-gqa-3l")[1], passes=[LayerSkip(layers=[1])])
    opt.generate(torch.zeros(3, 5, dtype=torch.long), max_new_tokens=10, eos_token_id=[])
    # one prefill + nine decode calls, each over the whole batch, two layers each
    assert dict(opt.stats) == {"forward_passes": 10, "layer_evals": 20, "tokens": 10}
    c = cost(opt, torch.zeros(1, 5, dtype=torch.long), 6)
    assert c["forward_per_token"] == 1.0 and c["layers_per_token"] == 2.0
    assert c["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # slots x (K, V) x kv heads x D x fp32
    assert c["kv_read_per_step"] == c["kv_bytes_per_token"] * opt.max_len  # dense: every token


def test_the_table_shows_what_a_decode_step_reads():
    from rewriter.passes import SelfSpeculative, TidalDecode
    _, traced = traced_model("llama-gqa-3l")
    prompt = torch.zeros(1, 5, dtype=torch.long)
    tidal = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0], top_k=9)])
    c = cost(tidal, prompt, 4, runs=1)
    # layer 0 reads the whole cache, layers 1 and 2 their top 9 and the query
    per_layer = c["kv_bytes_per_token"] // 3
    assert c["kv_read_per_step"] == per_layer * (tidal.max_len + 2 * 10)
    assert c["kv_read_per_step"] < c["kv_bytes_per_token"] * tidal.max_len
    spec = cost(rewriter.optimize(traced, passes=[SelfSpeculative(skip_layers=[1])]), prompt, 4, runs=1)
    assert spec["kv_read_per_step"] is None  # its verify steps read the whole cache
    rows = [{"pipeline": name, "layers": 3, "perplexity": {}, "ppl_ratio": {}, "agreement": 1.0,
             "first_divergence": 4.0, "exact_match": 1.0, "passkey": {}, **r}
            for name, r in (("tidal", c), ("spec", spec))]
    lines = format_table(rows, legend=False).splitlines()
    head = lines[0].split()
    assert "KiB" in head
    tidal_line, spec_line = lines[2].split(), lines[3].split()
    # the column after "KV B/tok": 2 words back from the end ("ms/tok" cell is 2 words)
    assert tidal_line[-3] == f"{c['kv_read_per_step'] / 2**10:.0f}" and spec_line[-3] == "-"


def test_agreement_and_first_divergence_by_hand():
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    out = torch.tensor([[1, 2, 9, 4], [5, 6, 7, 8]])
    assert agreement(out, ref) == {"agreement": 7 / 8, "first_divergence": (2 + 4) / 2,
                                   "exact_match": 0.5}


def test_perplexity_through_the_runtime_equals_the_irs_own(default):
    """The runtime scores (prefill + a decode step per token) what the IR's reference
    call computes over the whole chunk, position for position."""
    from rewriter.api.eval import heldout_chunks, perplexity
    tok, _, base = default
    chunks = heldout_chunks(tok, 2, 64, "prose")
    logp = base(chunks).float().log_softmax(-1)[:, 31:-1].gather(-1, chunks[:, 32:, None])
    assert perplexity(base, chunks) == pytest.approx(float(torch.exp(-logp.mean())), rel=1e-4)


def test_a_chat_tokenizer_gets_chat_prompts(default):
    from rewriter.api.eval import CHAT_PROMPTS, greedy_prompts
    from rewriter.runtime.chat import TextConfig
    _, tok = rewriter.default_model()  # a Hugging Face tokenizer, not the module's Tokenizer
    opt = rewriter.optimize(default[1], tokenizer=tok)  # the model's trace; its own engine
    assert isinstance(greedy_prompts(opt, tok, SMALL), torch.Tensor)  # no template: code
    opt.text = TextConfig("{% for m in messages %}Q: {{ m['content'] }}\nA:{% endfor %}")
    prompts = greedy_prompts(opt, tok, SMALL)
    assert tok.decode(prompts[0]) == f"Q: {CHAT_PROMPTS[0]}\nA:"
