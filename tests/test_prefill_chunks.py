"""A prompt run in several prefill steps (``prefill_chunk``) gives the tokens it gives in
one step, under every cache policy a step writes through: dense, a sink + window ring,
Quest's page bounds, TidalDecode, DuoAttention's split, and the decoding strategies that
run their own prompt (self-speculative, draft heads)."""
import pytest
import torch

import rewriter
from rewriter.passes import (DuoAttention, MedusaHeads, Quest, SelfSpeculative,
                             StreamingAttention, TidalDecode)
from rewriter.runtime.generate import run_prompt
from rewriter.runtime.kv_cache import KVCache, cache_table

from conftest import make_model

# rows of 70, 41 and 23 tokens: chunks of 16 cut every row, padding and all, several times
ROWS = [[(7 * i + 3) % 97 + 1 for i in range(n)] for n in (70, 41, 23)]
KW = dict(max_new_tokens=10, eos_token_id=[])


def _model(**overrides):
    return make_model("llama-gqa-3l", initializer_range=0.2, **overrides)


PIPELINES = {
    "dense": [],
    "ring": [StreamingAttention(sinks=2, window=12)],
    "quest": [Quest(page=4, budget=8, dense_layers=1, recent=4)],
    "tidal": [TidalDecode(selection_layers=[0], top_k=8, recent=4)],
    "duo": [DuoAttention([[0.9, 0.1], [0.1, 0.2], [0.9, 0.8]], sinks=2, window=12)],
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_chunked_prompt_gives_the_tokens_of_one_step(name):
    engine = rewriter.optimize(_model(), passes=PIPELINES[name])
    whole = engine.generate(ROWS, prefill_chunk=4096, **KW)
    engine.stats.clear()
    chunked = engine.generate(ROWS, prefill_chunk=16, **KW)
    assert engine.stats["forward_passes"] == 5 + KW["max_new_tokens"] - 1  # 70 tokens: 5 steps
    assert torch.equal(chunked, whole)


@pytest.mark.parametrize("strategy", [SelfSpeculative(skip_layers=[1], threshold=0.0),
                                      MedusaHeads(num_heads=2, tree=[[0], [1], [0, 0]])],
                         ids=["self_speculative", "medusa"])
def test_decoding_strategies_run_their_prompt_in_chunks(strategy):
    model = _model()
    traced = rewriter.trace(model)  # one trace, 2 pipelines
    engine = rewriter.optimize(traced, passes=[strategy])
    plain = rewriter.optimize(traced)
    assert torch.equal(engine.generate(ROWS, prefill_chunk=16, **KW),
                       plain.generate(ROWS, prefill_chunk=4096, **KW))
    assert engine.stats["forward_passes"] >= 5  # the 70-token prompt alone is 5 steps


def test_prompt_steps_are_near_equal_so_none_is_a_single_token():
    # A one-token step is a decode step to a selection (it would select, not attend
    # densely): a 33-token prompt in chunks of 16 must not run as 16 + 16 + 1.
    engine = rewriter.optimize(_model())
    table = cache_table(engine.ir.gm)
    cache = KVCache(table, 1, 64, torch.float32, torch.device("cpu"))
    lengths = []

    def program(step, ids, positions):
        lengths.append((step.start, step.length, ids.shape[1], positions[0, 0].item()))
        return ids

    ids = torch.arange(33)[None]
    _, steps = run_prompt(program, cache, ids, ids, None, 16)
    assert steps == 3
    assert lengths == [(0, 11, 11, 0), (11, 11, 11, 11), (22, 11, 11, 22)]
    lengths.clear()
    assert run_prompt(program, cache, ids[:, :16], ids[:, :16], None, 16)[1] == 1
    assert lengths == [(0, 16, 16, 0)]


@pytest.mark.parametrize("bad", [8, 0, -1, True, 16.0, "32"])
def test_a_bad_prefill_chunk_is_refused_by_name(bad):
    engine = rewriter.optimize(_model())
    with pytest.raises(ValueError, match="prefill_chunk"):
        engine.generate(ROWS, prefill_chunk=bad, **KW)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "ring", "quest"])
def test_triton_chunked_prompts_equal_torch_in_one_step(name):
    """The Triton prefill kernel at a later start, with left padding (a first step that is
    all padding for the short row); K rotated into the cache there. The interpreter's time
    grows with the prompts' tokens and the layers: 34 tokens still make three steps and a
    cache past one decode block (32); two layers keep one Quest layer beside a dense one."""
    pytest.importorskip("triton")
    from rewriter.passes import FuseQKV, FuseRoPE
    model = _model(num_hidden_layers=2)
    fused = [] if name == "quest" else [FuseQKV(), FuseRoPE()]  # Quest reads the unrotated q/k
    rows, kw = [ROWS[0][:34], ROWS[2]], dict(max_new_tokens=3, eos_token_id=[])
    traced = rewriter.trace(model)  # one trace, 2 pipelines
    torch_ = rewriter.optimize(traced, passes=[*PIPELINES[name], *fused])
    triton = rewriter.optimize(traced, passes=[*PIPELINES[name], *fused], backend="triton")
    assert torch.equal(triton.generate(rows, prefill_chunk=16, **kw),
                       torch_.generate(rows, prefill_chunk=4096, **kw))
