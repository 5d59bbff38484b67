"""Self-speculative decoding and the runtime seam under it: lossless greedy on every family,
ragged batches, EOS mid-draft, the end of the cache, the sampling distribution, caches
addressed by layer id, rollback by length, artifacts, bad parameters."""
import pytest
import torch

import rewriter
from rewriter.errors import PassError
from rewriter.passes import FuseAddRMSNorm, FuseQKV, LayerSkip, SelfSpeculative, from_spec
from rewriter.runtime.attention import Step
from rewriter.runtime.kv_cache import KVCache, cache_table

from conftest import CONFIGS, make_model, traced_model, varied_init

IDS = torch.tensor([[3, 17, 42, 5, 99, 8, 64], [1, 2, 3, 4, 5, 6, 7]])
RAGGED = [[3, 17, 42, 5, 99, 8, 64, 11, 12], [1, 2, 3], [50, 51, 52, 53, 54]]
KW = dict(max_new_tokens=24, eos_token_id=[])


def pair(config: str, **spec):
    """(plain, self-speculative) optimized models of one seeded model."""
    _, traced = traced_model(config, initializer_range=varied_init(config))
    spec = {"skip_layers": [1], "threshold": 0.0, **spec}
    return rewriter.optimize(traced), rewriter.optimize(traced, passes=[SelfSpeculative(**spec)])


def refuses_records(artifact, cases) -> None:
    """Each ``(record, match)``: the saved ``artifact`` with that decoding record (resealed,
    as an editor with the tools would) fails to load with an error matching ``match``."""
    import json
    from artifact_tools import artifact_files, reseal
    from rewriter.errors import ArtifactError
    path = artifact_files(artifact)["ir.json"]
    for record, match in cases:
        data = json.loads(path.read_text())
        data["info"]["decoding"] = record
        path.write_text(json.dumps(data))
        reseal(artifact)
        with pytest.raises(ArtifactError, match=match):
            rewriter.load(artifact)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_tokens_equal_plain_greedy_on_every_family(config):
    plain, spec = pair(config, max_draft=3)
    assert torch.equal(spec.generate(IDS, **KW), plain.generate(IDS, **KW))
    s = spec.stats  # drafts were accepted, and rejected: both paths ran
    assert 0 < s["accepted"] < s["drafted"] and s["forward_passes"] < s["tokens"] * 2


@pytest.mark.parametrize("config", ["llama-gqa-3l", "mistral-window-3l", "gpt2-3l"])
def test_ragged_batches_equal_each_row_alone(config):
    plain, spec = pair(config)
    together = spec.generate(RAGGED, **KW)
    for i, row in enumerate(RAGGED):
        alone = plain.generate([row], **KW)[0, len(row):]
        assert torch.equal(together[i, -KW["max_new_tokens"]:], alone), i


def test_sub_layers_are_skipped_separately():
    plain, spec = pair("llama-gqa-3l", skip_layers=None, skip_attention=[1, 2], skip_mlp=[0])
    code = spec.programs()
    assert code["draft"].count("cached_attention") == 1 and code["decode"].count("cached_attention") == 3
    assert torch.equal(spec.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))


def test_speedup_picks_layer_skips_spread_set_and_the_default_model_accepts_drafts():
    plain = rewriter.from_pretrained("default")
    spec = rewriter.from_pretrained("default", passes=[SelfSpeculative(speedup=1.6)])
    assert spec.ir.info["decoding"]["skip_layers"] == [1, 3, 6]  # LayerSkip(speedup=1.6)'s
    ids = [plain.tokenizer.encode("def main(").ids]
    assert torch.equal(spec.generate(ids, max_new_tokens=48), plain.generate(ids, max_new_tokens=48))
    s = spec.stats
    assert s["accepted"] > 0 and s["forward_passes"] < s["tokens"]


def test_eos_in_the_middle_of_a_draft_ends_the_row_as_plain_decoding_does():
    plain, spec = pair("llama-gqa-3l", max_draft=4)
    free = plain.generate(IDS, **KW)
    eos = int(free[0, IDS.shape[1] + 5])  # a token row 0 makes mid-way
    kw = dict(max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(spec.generate(IDS, **kw), plain.generate(IDS, **kw))
    streamed = torch.stack(list(spec.stream(IDS, **kw)), dim=1)
    assert torch.equal(streamed, plain.generate(IDS, **kw)[:, IDS.shape[1]:])


def test_drafts_that_reach_the_end_of_the_cache_are_cut_short():
    plain, spec = pair("llama-gqa-3l", max_draft=6)  # context: 128 positions
    ids = torch.stack([torch.arange(1, 101) % 120, torch.arange(100, 0, -1) % 97])  # 2 rows
    kw = dict(max_new_tokens=28, eos_token_id=[])  # 100 + 28 = the whole context
    assert torch.equal(spec.generate(ids, **kw), plain.generate(ids, **kw))
    assert spec._cache.max_len == 128
    for r in range(2):  # and each row alone
        assert torch.equal(spec.generate(ids[r:r + 1], **kw), plain.generate(ids[r:r + 1], **kw))


def test_sampling_follows_the_models_distribution():
    """Two-sample chi-square test on the second sampled token (the first the acceptance
    rule decides), 3000 independent rows each way, a 48-token vocabulary."""
    _, traced = traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)
    plain = rewriter.optimize(traced)
    spec = rewriter.optimize(traced, passes=[SelfSpeculative(skip_layers=[1, 2], threshold=0.0)])
    ids = torch.tensor([[5, 9, 2]]).expand(3000, 3)
    kw = dict(max_new_tokens=3, do_sample=True, top_k=0, eos_token_id=[])
    a = plain.generate(ids, seed=1, **kw)[:, 4]
    b = spec.generate(ids, seed=2, **kw)[:, 4]
    assert spec.stats["accepted"] > 0 and spec.stats["row_rounds"] > spec.stats["accepted"]
    ca, cb = torch.bincount(a, minlength=48).float(), torch.bincount(b, minlength=48).float()
    seen = (ca + cb) > 0
    ca, cb = ca[seen], cb[seen]
    stat = (((ca - cb) ** 2) / (ca + cb)).sum().item()  # chi-square, equal sample sizes
    dof = int(seen.sum()) - 1
    assert stat < dof + 5 * (2 * dof) ** 0.5, (stat, dof)  # ~5 sigma: fails on a biased rule
    greedy_rows = spec.generate(ids[:4], max_new_tokens=3, eos_token_id=[])
    assert torch.equal(greedy_rows, plain.generate(ids[:4], max_new_tokens=3, eos_token_id=[]))


@pytest.mark.parametrize("n_draft", [1, 3])
def test_acceptance_rule_alone_is_unbiased(n_draft):
    """The rule on synthetic p and q, the same at every position: each emitted token (the
    accepted drafts, then the residual or bonus sample) is distributed as p."""
    from rewriter.runtime.decoding.speculative import Rounds
    from rewriter.runtime.settings import GenerationSettings
    torch.manual_seed(0)
    b, v = 40000, 6
    p_logits = torch.randn(v) * 1.5
    q = torch.softmax(torch.randn(v) * 1.5, -1)
    logits = p_logits.expand(b, n_draft + 1, v).clone()  # [B, n + 1, V]
    drafts = torch.multinomial(q.expand(b, v), n_draft, replacement=True)  # [B, n]
    rounds = Rounds.__new__(Rounds)
    rounds.s = GenerationSettings(do_sample=True, top_k=0)
    rounds.generator, rounds.device = torch.Generator().manual_seed(0), torch.device("cpu")
    n, bonus = rounds.accept(logits, drafts, [q.expand(b, v)] * n_draft)
    p = torch.softmax(p_logits, -1)
    assert 0 < n.float().mean() < n_draft  # some accepted, some rejected
    for j in range(n_draft + 1):  # the token emitted at position j, where rows emit one
        emitted = n >= j
        token = torch.where(n > j, drafts[:, min(j, n_draft - 1)], bonus)[emitted]
        freq = torch.bincount(token, minlength=v).float() / len(token)
        sigma = (p * (1 - p) / len(token)).sqrt()  # binomial noise of each frequency
        assert ((freq - p).abs() <= 5 * sigma + 1e-3).all(), (j, freq, p)


def test_a_draft_program_writes_exactly_the_caches_of_the_layers_it_runs():
    _, spec = pair("llama-gqa-3l", skip_layers=[1], skip_attention=[2])
    programs = spec._lowered()
    table = cache_table(spec.ir.gm)
    assert sorted(table) == [0, 1, 2]  # cache ids are layer indices
    cache = KVCache(table, 1, 16, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        programs["draft"](Step(cache, 3, 1, None), torch.tensor([[7]]), torch.tensor([[3]]))
    written = {i: bool(cache.k[i].abs().sum() > 0) for i in table}
    assert written == {0: True, 1: False, 2: False}
    assert cache.k[0][:, :, 3].abs().sum() > 0 and cache.k[0][:, :, :3].abs().sum() == 0


def test_after_layer_skip_the_caches_keep_their_layer_ids():
    opt = rewriter.optimize(traced_model("llama-gqa-3l")[1], passes=[LayerSkip(layers=[1])])
    assert sorted(cache_table(opt.ir.gm)) == [0, 2]
    assert opt.kv_bytes_per_token() == 2 * 2 * (2 * 16) * 4  # 2 layers, K and V, 2 heads x 16, f32


def test_rolling_back_is_setting_a_length():
    """Logits after 3 rejected tokens were written and rolled back equal those of a cache
    that never held them, through the per-row step path."""
    plain, _ = pair("llama-gqa-3l")
    decode = plain._lowered()["decode"]
    table = cache_table(plain.ir.gm)
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])

    def run(cache, start, tokens, end):
        s = tokens.shape[1]
        positions = (start[:, None] if isinstance(start, torch.Tensor) else start) + torch.arange(s)
        with torch.inference_mode():
            return decode(Step(cache, start, s, None, end=end), tokens, positions.expand(2, s))

    rolled, clean = (KVCache(table, 2, 16, torch.float32, torch.device("cpu")) for _ in range(2))
    for cache in (rolled, clean):
        run(cache, 0, prompt, 4)
    for cache in (rolled, clean):  # one accepted token each (a 1-token step: same rounding)
        run(cache, 4, torch.tensor([[1], [5]]), 5)
    run(rolled, torch.tensor([5, 5]), torch.tensor([[2, 3, 4], [6, 7, 8]]), 8)  # then rejected
    starts = torch.tensor([5, 5])  # both rows roll back to 5
    a = run(rolled, starts, torch.tensor([[20, 21], [22, 23]]), 7)
    b = run(clean, starts, torch.tensor([[20, 21], [22, 23]]), 7)
    assert torch.equal(a, b)
    assert not torch.equal(rolled.k[0][:, :, 7], clean.k[0][:, :, 7])  # stale, never copied


def test_a_tampered_or_stale_decoding_record_is_refused(tmp_path):
    _, spec = pair("llama-gqa-3l")
    spec.save(tmp_path / "a")
    refuses_records(tmp_path / "a", (
        ({**spec.ir.info["decoding"], "skip_layers": [99]}, "layer 99"),
        ({**spec.ir.info["decoding"], "strategy": "plain"}, "self_speculative"),
        ({**spec.ir.info["decoding"], "max_draft": 99}, "max_draft")))
    _, traced = traced_model("llama-gqa-3l")
    with pytest.raises(PassError, match="layer 1 is not in the model"):  # a later pass removed it
        rewriter.optimize(traced, passes=[SelfSpeculative(skip_layers=[1]), LayerSkip(layers=[1])])


def test_artifact_round_trip_keeps_the_strategy(tmp_path):
    plain, spec = pair("qwen2-mqa-3l", skip_layers=[0], skip_mlp=[2], max_draft=2)
    spec.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert loaded.ir.info["decoding"] == spec.ir.info["decoding"]
    assert set(loaded.programs()) == {"prefill", "decode", "draft"}
    assert torch.equal(loaded.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))


def test_the_triton_backend_gives_the_same_tokens():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2, num_hidden_layers=2)
    plain = rewriter.optimize(traced)
    spec = rewriter.optimize(traced, passes=[SelfSpeculative(skip_layers=[1], threshold=0.0)],
                             backend="triton")
    kw = dict(max_new_tokens=6, eos_token_id=[])
    assert torch.equal(spec.generate(RAGGED[:2], **kw), plain.generate(RAGGED[:2], **kw))


def test_bad_parameters_and_skip_sets_are_refused():
    for kwargs in ({}, {"skip_layers": [1], "speedup": 1.5}, {"skip_layers": "1"},
                   {"skip_layers": [1, 1]}, {"skip_layers": [-1]}, {"skip_layers": [True]},
                   {"speedup": 1.0}, {"speedup": float("nan")}, {"skip_layers": [1], "max_draft": 0},
                   {"skip_layers": [1], "max_draft": 17}, {"skip_layers": [1], "threshold": 1.0},
                   {"skip_layers": [1], "threshold": True}, {"skip_layers": [1], "budget": 3},
                   {"calibrate": [[1]]}, {"calibrate": "text"}):
        with pytest.raises(ValueError):
            SelfSpeculative(**kwargs)
    _, traced = traced_model("llama-gqa-3l")  # one trace, seven pipelines
    for passes, match in (([SelfSpeculative(skip_layers=[3])], "layer 3 is not in the model"),
                          ([SelfSpeculative(skip_layers=[0, 1, 2])], "skips every layer"),
                          ([SelfSpeculative(skip_layers=[1], skip_mlp=[1])], "also has a sub-layer"),
                          ([SelfSpeculative(skip_layers=[])], "skip set is empty"),
                          ([SelfSpeculative(skip_layers=[0], skip_attention=[1, 2], skip_mlp=[1, 2])],
                           "skips every layer"),
                          ([FuseAddRMSNorm(), SelfSpeculative(skip_layers=[1])], "before FuseAddRMSNorm"),
                          ([SelfSpeculative(skip_layers=[1]), SelfSpeculative(skip_layers=[2])],
                           "already has a decoding strategy")):
        with pytest.raises(PassError, match=match):
            rewriter.optimize(traced, passes=passes)
    assert from_spec("self_speculative:skip_layers=[1],max_draft=3").params()["max_draft"] == 3


def test_parallel_blocks_refuse_sub_layer_skips_but_take_whole_layers():
    import transformers as T
    torch.manual_seed(0)
    config = T.GPTNeoXConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, max_position_embeddings=64, use_parallel_residual=True)
    model = T.GPTNeoXForCausalLM(config).eval()
    traced = rewriter.trace(model)  # one trace, 3 pipelines
    with pytest.raises(PassError, match="cannot be skipped alone"):
        rewriter.optimize(traced, passes=[SelfSpeculative(skip_attention=[1])])
    spec = rewriter.optimize(traced, passes=[FuseQKV(), SelfSpeculative(skip_layers=[1])])
    assert torch.equal(spec.generate(IDS % 96, **KW), rewriter.optimize(traced).generate(IDS % 96, **KW))


def test_drafting_stops_when_no_running_row_is_confident():
    """The confidence stop looks at running rows only: a finished row whose drafts stay
    confident (it repeats itself) must not keep the others drafting."""
    from collections import Counter
    from types import SimpleNamespace

    from rewriter.runtime.decoding.speculative import Rounds
    confident = torch.tensor([20.0, 0.0, 0.0, 0.0])  # row 0: one token, probability ~1
    unsure = torch.zeros(4)  # row 1: 4 tokens alike, 0.25 each
    rounds = object.__new__(Rounds)
    rounds.strategy = SimpleNamespace(threshold=0.5)
    rounds.s = SimpleNamespace(do_sample=False)
    rounds.stats, rounds.draft_layers, rounds.device = Counter(), 1, torch.device("cpu")
    rounds.pad0, rounds._on_device = torch.zeros(2, dtype=torch.int64), {}
    rounds.step = lambda *a, **k: torch.stack([confident, unsure])[:, None]  # [B, 1, V]
    last = torch.zeros(2, dtype=torch.int64)
    assert len(rounds.draft(last, [5, 5], 4, [True, False])[0]) == 1  # row 0 is done
    assert len(rounds.draft(last, [5, 5], 4, [False, False])[0]) == 4  # row 0 drafts on
    assert len(rounds.draft(last, [5, 5], 4)[0]) == 4


def test_a_4_bit_draft_gives_plain_greedy_tokens_and_reads_4_bit_weights():
    """``draft_weights="int4"``: the draft multiplies ``Int4Weights``' copies of the same
    weights (here dequantized: float32), the verifying programs the model's own; with no
    skip set and with one."""
    import copy
    for skip in ({}, {"skip_mlp": [2]}):  # untraced on purpose: optimize leaves the model alone
        model = make_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
        before = copy.deepcopy(model.state_dict())
        plain = rewriter.optimize(copy.deepcopy(model))  # weights of its own
        spec = rewriter.optimize(model, passes=[SelfSpeculative(
            draft_weights="int4", threshold=0.0, **skip)])
        assert torch.equal(spec.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))
        s = spec.stats  # the 4-bit draft differs from the model: both paths ran
        assert 0 < s["accepted"] < s["drafted"]
        code = spec.programs()
        assert "int4_codes" in code["draft"] and code["draft"].count("cached_attention") == 3
        assert not any("int4" in code[p] for p in ("prefill", "decode"))
        # the draft's copy of the IR took nothing from the model's, nor wrote into it
        assert set(spec.ir.weights()) == set(plain.ir.weights())
        assert not any("int4" in name for name, _ in spec.ir.gm.named_buffers())
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_4_bit_draft_goes_with_fused_adds_and_norms_when_it_skips_nothing():
    _, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    spec = rewriter.optimize(traced, passes=[FuseQKV(), FuseAddRMSNorm(), SelfSpeculative(
        draft_weights="int4", threshold=0.0)])
    assert torch.equal(spec.generate(RAGGED, **KW), rewriter.optimize(traced).generate(RAGGED, **KW))
    with pytest.raises(PassError, match="before FuseAddRMSNorm"):
        rewriter.optimize(traced, passes=[FuseAddRMSNorm(), SelfSpeculative(
            draft_weights="int4", skip_mlp=[1])])


def test_a_4_bit_draft_runs_the_4_bit_kernel_in_bfloat16_and_accepts_most_drafts():
    plain = rewriter.from_pretrained("default", dtype="bfloat16")
    spec = rewriter.from_pretrained("default", dtype="bfloat16",
                                    passes=[SelfSpeculative(draft_weights="int4", threshold=0.0)])
    assert "linear_int4_cpu" in spec.programs()["draft"]
    ids = [plain.tokenizer.encode("def main(").ids]
    spec.generate(ids, max_new_tokens=32)
    s = spec.stats
    assert s["accepted"] > s["drafted"] / 2 and s["forward_passes"] < s["tokens"] / 2


def test_a_4_bit_draft_survives_an_artifact_and_bad_settings_are_refused(tmp_path):
    from rewriter.errors import RewriterError
    from rewriter.passes import Int4Weights
    plain, spec = pair("qwen2-mqa-3l", skip_layers=None, draft_weights="int4", max_draft=3)
    spec.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert loaded.ir.info["decoding"] == spec.ir.info["decoding"]
    assert loaded.ir.info["decoding"]["draft_weights"] == "int4"
    assert "int4_codes" in loaded.programs()["draft"]
    assert torch.equal(loaded.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))
    no_key = {k: v for k, v in spec.ir.info["decoding"].items() if k != "draft_weights"}
    refuses_records(tmp_path / "a", (
        ({**spec.ir.info["decoding"], "draft_weights": "int8"}, "draft_weights"),
        ({**spec.ir.info["decoding"], "draft_weights": None}, "draft_weights"),
        ({**spec.ir.info["decoding"], "draft_weights": "dense"}, "no key"),
        (no_key, "skips something")))  # an empty skip set needs the 4 bits
    for kwargs in ({"draft_weights": "int8"}, {"draft_weights": True}, {"draft_weights": None},
                   {"calibrate": [[1, 2, 3]], "draft_weights": "int4"},
                   {"skip_layers": [1], "speedup": 1.5, "draft_weights": "int4"}):
        with pytest.raises(ValueError):
            SelfSpeculative(**kwargs)
    with pytest.raises(RewriterError, match="draft_weights='int4'.*nothing to quantize"):
        rewriter.optimize(traced_model("llama-gqa-3l")[1],  # the linears are 4-bit already
                          passes=[Int4Weights(), SelfSpeculative(draft_weights="int4")])
    assert from_spec("self_speculative:draft_weights=int4").params()["draft_weights"] == "int4"


def test_a_4_bit_draft_of_weights_it_cannot_name_is_a_clear_error():
    """An artifact may name a weight without a dot; its 4-bit copies would then be
    registered on the tensor itself: refused with the strategy named, not AttributeError."""
    from rewriter.errors import RewriterError
    from rewriter.ir.skip import skipped
    from rewriter.runtime.decoding.self_spec import int4_draft
    ir = rewriter.optimize(traced_model("llama-gqa-3l")[1]).ir
    node = next(n for n in ir.graph.find_nodes(op="get_attr") if n.target.endswith("q_proj.weight"))
    ir.add_weight("flatw", ir.weight(node.target))
    node.target = "flatw"
    ir.gm.recompile()
    with pytest.raises(RewriterError, match="draft_weights='int4' draft cannot be made"):
        int4_draft(skipped(ir))
