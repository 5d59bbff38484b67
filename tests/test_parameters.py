"""Every parameter a user passes is checked by name: NaN and inf, booleans, floats where an
integer is meant and strings are refused, never truncated, never read as "no limit".

Generation parameters go through one ``GenerationSettings``; prompts through ``prepare``;
pass parameters through ``from_spec`` and each pass's ``__init__``."""
import numpy as np
import pytest
import torch

import transformers as T

import rewriter
from conftest import make_model
from rewriter.passes import FuseAddRMSNorm, FuseQKV, LayerSkip, from_spec
from rewriter.runtime.settings import GenerationSettings

NAN, INF = float("nan"), float("inf")
VOCAB = 128  # llama-gqa-3l


@pytest.fixture(scope="module")
def opt():
    return rewriter.optimize(make_model("llama-gqa-3l"))


# ------------------------------------------------------------------ generation settings

SAMPLING = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.9, seed=0)

BAD_SETTINGS = [
    # the issue's: top_k=nan meant "no limit", eos_token_id=True became token 1
    (dict(SAMPLING, top_k=NAN), "top_k must be an integer"),
    (dict(eos_token_id=True), "eos_token_id must be an integer"),
    # integers: no floats (integral or not), no bools, no strings
    (dict(SAMPLING, top_k=2.5), "top_k must be an integer"),
    (dict(SAMPLING, top_k=20.0), "top_k must be an integer"),
    (dict(SAMPLING, top_k=True), "top_k must be an integer"),
    (dict(SAMPLING, top_k="5"), "top_k must be an integer"),
    (dict(max_new_tokens=3.0), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=NAN), "max_new_tokens must be an integer"),
    (dict(max_new_tokens="4"), "max_new_tokens must be an integer"),
    (dict(SAMPLING, seed=1.5), "seed must be an integer"),
    (dict(SAMPLING, seed=True), "seed must be an integer"),
    (dict(SAMPLING, seed="0"), "seed must be an integer"),
    (dict(SAMPLING, seed=2 ** 70), "seed must be < "),
    (dict(eos_token_id=2.0), "eos_token_id must be an integer"),
    (dict(eos_token_id=[1, True]), r"eos_token_id\[1\] must be an integer"),
    (dict(eos_token_id=[1, 2.5]), r"eos_token_id\[1\] must be an integer"),
    (dict(eos_token_id="2"), "eos_token_id must be a token id or a list"),
    (dict(eos_token_id=-1), "eos_token_id must be >= 0"),
    (dict(eos_token_id=VOCAB + 5), r"eos_token_id 133 is outside the vocabulary \[0, 128\)"),
    (dict(eos_token_id=[3, VOCAB]), r"eos_token_id 128 is outside the vocabulary"),
    (dict(pad_token_id=True), "pad_token_id must be an integer"),
    (dict(pad_token_id=0.0), "pad_token_id must be an integer"),
    (dict(pad_token_id="0"), "pad_token_id must be an integer"),
    # reals: finite numbers, checked even when greedy decoding ignores them
    (dict(SAMPLING, temperature=NAN), "temperature must be finite"),
    (dict(SAMPLING, temperature=INF), "temperature must be finite"),
    (dict(temperature=NAN), "temperature must be finite"),
    (dict(SAMPLING, temperature="hot"), "temperature must be a number"),
    (dict(SAMPLING, temperature=True), "temperature must be a number"),
    (dict(SAMPLING, top_p=NAN), "top_p must be finite"),
    (dict(top_p=-INF), "top_p must be finite"),
    (dict(SAMPLING, top_p="0.9"), "top_p must be a number"),
    (dict(SAMPLING, top_p=-0.1), r"top_p must be in \(0, 1\]"),
    (dict(do_sample="yes"), "do_sample must be True or False"),
    (dict(do_sample=1), "do_sample must be True or False"),
    # pad ids fill an int64 tensor: the 2**63 and 2**70 were raw torch errors
    (dict(pad_token_id=2 ** 63), "pad_token_id must be < 9223372036854775808"),
    (dict(pad_token_id=2 ** 70), "pad_token_id must be < 9223372036854775808"),
    (dict(pad_token_id=-(2 ** 63) - 1), "pad_token_id must be >= -9223372036854775808"),
    (dict(pad_token_id=np.uint64(2 ** 64 - 1)), "pad_token_id must be < "),
    (dict(SAMPLING, seed=-(2 ** 63) - 1), "seed must be >= "),
    (dict(SAMPLING, seed=np.float64(3)), "seed must be an integer"),
    # temperatures that overflow the scaled logits (the 1e-300: NaN probabilities)
    (dict(SAMPLING, temperature=1e-300), r"temperature must be >= 0.0001 when sampling"),
    (dict(SAMPLING, temperature=5e-324), r"temperature must be >= 0.0001 when sampling"),
    (dict(SAMPLING, temperature=np.float32(1e-30)), r"temperature must be >= 0.0001"),
]


@pytest.mark.parametrize("kwargs,message", BAD_SETTINGS)
def test_bad_generation_settings_are_refused_by_name(opt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        opt.generate([[1, 2, 3]], max_new_tokens=kwargs.pop("max_new_tokens", 2), **kwargs)


@pytest.mark.parametrize("kwargs,message", BAD_SETTINGS[:6])
def test_stream_refuses_them_when_called_not_at_the_first_token(opt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        opt.stream([[1, 2, 3]], max_new_tokens=2, **kwargs)  # not iterated


def test_the_settings_are_one_object_with_hugging_faces_defaults():
    s = GenerationSettings()
    assert (s.max_new_tokens, s.do_sample, s.temperature, s.top_k, s.top_p) == (20, False, 1.0, 50, 1.0)
    resolved = GenerationSettings(eos_token_id=[5, 7]).for_model({"vocab_size": 10, "eos_token_id": 2})
    assert resolved.eos_token_id == (5, 7) and resolved.pad_token_id == 5
    from_config = GenerationSettings().for_model({"vocab_size": 10, "eos_token_id": 2})
    assert from_config.eos_token_id == (2,) and from_config.pad_token_id == 2
    with pytest.raises(AttributeError):
        s.top_k = 3  # frozen: what was checked is what runs


def test_a_model_config_with_a_bool_eos_is_refused_by_name():
    with pytest.raises(ValueError, match=r"eos_token_id \(from the model config\) must be an integer"):
        GenerationSettings().for_model({"vocab_size": 10, "eos_token_id": True})


def test_valid_edge_values_still_work(opt):
    ids = [[1, 2, 3]]
    greedy = opt.generate(ids, max_new_tokens=3, eos_token_id=[])
    assert torch.equal(opt.generate(ids, max_new_tokens=3, eos_token_id=(), top_k=None,
                                    temperature=0.0, top_p=0.0), greedy)  # greedy ignores them
    sampled = dict(do_sample=True, top_k=0, top_p=1, temperature=2, seed=-1, eos_token_id=[])
    assert opt.generate(ids, max_new_tokens=3, **sampled).shape == (1, 6)
    assert opt.generate(ids, max_new_tokens=3, eos_token_id=[], pad_token_id=-1).shape == (1, 6)


# ------------------------------------------------------------------ prompts

BAD_PROMPTS = [
    ([[1, 2.7, 3]], r"input_ids\[0\]\[1\] must be an integer, got 2.7"),  # the issue's: truncated to 2
    ([[1, 2], [3, 4.0]], r"input_ids\[1\]\[1\] must be an integer, got 4.0"),
    ([[True, 2]], r"input_ids\[0\]\[0\] must be an integer, got True"),
    ([[1, "2"]], r"input_ids\[0\]\[1\] must be an integer, got '2'"),
    ([[1, NAN]], r"input_ids\[0\]\[1\] must be an integer, got nan"),
    ([[[1, 2], [3]]], r"input_ids\[0\]\[0\] must be an integer, got \[1, 2\]"),
    ([[1, -2]], r"input_ids\[0\]\[1\] must be >= 0, got -2"),
    ([[1, 2 ** 64]], r"input_ids\[0\]\[1\] must be < "),
    ([[1, VOCAB]], r"outside the vocabulary \[0, 128\): row 0 has 128"),
    ([[1], [2, 3, 500]], r"outside the vocabulary \[0, 128\): row 1 has 500"),
    (["hello"], r"input_ids\[0\] must be a list of token ids"),
    ("hello", "input_ids must be a .* tensor or a list of token-id lists"),
    ([1, 2, 3], r"input_ids\[0\] must be a list of token ids, got 1"),
    ([torch.tensor([1.0, 2.0])], r"input_ids\[0\] must be a 1-D integer tensor"),
    (torch.tensor([[1.0, 2.0]]), "input_ids must be an integer tensor"),
    (torch.tensor([[True, False]]), "input_ids must be an integer tensor"),
    (torch.tensor([[-1, 2]]), "outside the vocabulary"),
    ([[]], "every prompt needs at least one token"),
    ([], "every prompt needs at least one token"),
]


@pytest.mark.parametrize("prompts,message", BAD_PROMPTS)
def test_bad_prompts_are_refused_by_name(opt, prompts, message):
    with pytest.raises(ValueError, match=message):
        opt.generate(prompts, max_new_tokens=2)


IDS = torch.tensor([[0, 5, 6], [7, 8, 9]])

BAD_MASKS = [
    (IDS.float(), "attention_mask must be a bool or integer tensor"),
    (torch.tensor([[0, 1, 1], [1, 2, 1]]), "attention_mask must hold only 0 and 1, found 2"),
    (torch.tensor([[0, 1, 1], [1, -1, 1]]), "attention_mask must hold only 0 and 1, found -1"),
    (torch.tensor([[0, 0, 0], [1, 1, 1]]), "attention_mask row 0 is all zeros"),
    (torch.tensor([[0, 1], [1, 1]]), r"attention_mask has shape \[2, 2\], input_ids \[2, 3\]"),
    ([[0, 1, 1], [1, 1, 1]], "attention_mask must be a tensor, got list"),
]


@pytest.mark.parametrize("mask,message", BAD_MASKS)
def test_bad_attention_masks_are_refused_by_name(opt, mask, message):
    with pytest.raises(ValueError, match=message):
        opt.generate(IDS, attention_mask=mask, max_new_tokens=2)


@pytest.mark.parametrize("positions", [
    torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[0, 1]]), torch.tensor([[0, -1, 2]]), [[0, 1, 2]]])
def test_bad_positions_for_the_reference_call_are_refused_by_name(opt, positions):
    with pytest.raises(ValueError, match="positions must be a non-negative integer tensor"):
        opt(torch.tensor([[1, 2, 3]]), positions)


def test_a_mask_with_list_prompts_is_refused_not_ignored(opt):
    with pytest.raises(ValueError, match="attention_mask goes with a .* tensor"):
        opt.generate([[1, 2, 3]], attention_mask=torch.tensor([[0, 1, 1]]), max_new_tokens=2)


def test_a_pad_id_outside_the_vocabulary_only_marks_the_output(opt):
    """List prompts of different lengths are left-padded; the model reads a real token
    there (masked), the caller sees ``pad_token_id``."""
    out = opt.generate([[4, 5, 6], [7]], max_new_tokens=2, eos_token_id=[], pad_token_id=-1)
    assert out[1, :2].tolist() == [-1, -1]
    alone = opt.generate([[7]], max_new_tokens=2, eos_token_id=[])
    assert torch.equal(out[1, 3:], alone[0, 1:])


# ------------------------------------------------------------------ pass parameters

BAD_SPECS = [
    ("layer_skip:speedup=1.5,speedup=2", "parameter 'speedup' is given twice"),  # the issue's
    ("layer_skip:layers=[1],layers=[2]", "parameter 'layers' is given twice"),
    ("layer_skip:speedup=2, speedup=2", "parameter 'speedup' is given twice"),
    ("layer_skip:speedup=NaN", "speedup must be a finite number, got nan"),
    ("layer_skip:speedup=Infinity", "speedup must be a finite number, got inf"),
    ("layer_skip:speedup=-Infinity", "speedup must be a finite number"),
    ("layer_skip:speedup=true", "speedup must be a number, got True"),
    ("layer_skip:speedup=fast", "speedup must be a number, got 'fast'"),
    ("layer_skip:layers=3", "layers must be a list of layer indices, got 3"),
    ("layer_skip:layers=abc", "layers must be a list of layer indices, got 'abc'"),
    ("layer_skip:layers=[1.0]", "layers must hold non-negative integers, got 1.0"),
    ("layer_skip:layers=[true]", "layers must hold non-negative integers, got True"),
    ("layer_skip:layers=[NaN]", "layers must hold non-negative integers, got nan"),
    ("layer_skip:layer=[1]", "unknown parameter 'layer'; its parameters are layers, speedup"),
    ("fuse_qkv:enabled=true", "pass fuse_qkv: unknown parameter 'enabled'; its parameters are none"),
    ("fuse_rope:x", "pass fuse_rope: parameter 'x' is not key=value"),
    ("fuse_swiglu:=1", "parameter '=1' is not key=value"),
    ("fuse_add_rms_norm:eps=1e-6", "pass fuse_add_rms_norm: unknown parameter 'eps'"),
    (None, "a pass spec is a string"),
]


@pytest.mark.parametrize("spec,message", BAD_SPECS)
def test_bad_pass_specs_are_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        from_spec(spec)


@pytest.mark.parametrize("kwargs,message", [
    (dict(speedup=NAN), "speedup must be a finite number"),
    (dict(speedup=INF), "speedup must be a finite number"),
    (dict(layers="12"), "layers must be a list of layer indices"),
    (dict(layers={1: 2}), "layers must be a list of layer indices"),
])
def test_bad_layer_skip_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerSkip(**kwargs)


def test_a_good_spec_still_round_trips():
    assert repr(from_spec("layer_skip: layers=[2, 1]")) == "LayerSkip(layers=[1, 2])"
    assert repr(from_spec("layer_skip:speedup=2")) == "LayerSkip(speedup=2.0)"
    assert repr(from_spec("fuse_qkv")) == "FuseQKV()"


def test_running_a_fusion_pass_twice_keeps_its_count():
    once = rewriter.optimize(make_model("llama-gqa-3l"), passes=[FuseQKV()])
    twice = rewriter.optimize(make_model("llama-gqa-3l"), passes=[FuseQKV(), FuseQKV()])
    assert once.ir.info["fusions"] == twice.ir.info["fusions"] == {"FuseQKV": 3}


def test_layer_skip_still_refuses_to_run_after_a_repeated_add_rms_norm_fusion():
    """The count is what LayerSkip reads: reset to 0 by the second run, it let LayerSkip
    cut a fused add + norm in two."""
    with pytest.raises(rewriter.PassError, match="must run before FuseAddRMSNorm"):
        rewriter.optimize(make_model("llama-gqa-3l"),
                          passes=[FuseAddRMSNorm(), FuseAddRMSNorm(), LayerSkip(layers=[1])])



# ------------------------------------------------------------------ numpy scalars

def test_numpy_scalars_are_taken_as_their_python_values_and_stored_so(opt):
    """The issue's: a numpy seed reached ``manual_seed`` (TypeError after the checks)."""
    numpy_kw = dict(max_new_tokens=np.int64(4), do_sample=np.bool_(True), temperature=np.float32(0.5),
                    top_k=np.int32(20), top_p=np.float64(0.9), seed=np.uint64(2 ** 64 - 1),
                    eos_token_id=[np.int16(3)], pad_token_id=np.int64(-1))
    plain_kw = dict(max_new_tokens=4, do_sample=True, temperature=0.5, top_k=20, top_p=0.9,
                    seed=2 ** 64 - 1, eos_token_id=[3], pad_token_id=-1)
    s = GenerationSettings(**numpy_kw)
    assert s == GenerationSettings(**plain_kw)
    assert all(type(getattr(s, k)) in (int, float, bool) for k in plain_kw if k != "eos_token_id")
    assert torch.equal(opt.generate([[1, 2, 3]], **numpy_kw), opt.generate([[1, 2, 3]], **plain_kw))


@pytest.mark.parametrize("index", [np.int64(1), np.int32(1), np.uint8(1)])
def test_layer_skip_takes_numpy_layer_indices(index):
    assert repr(LayerSkip(layers=[index, 2])) == "LayerSkip(layers=[1, 2])"


@pytest.mark.parametrize("prefix", [np.int64(2), np.int32(2), np.uint16(2)])
def test_score_takes_a_numpy_prefix(opt, prefix):
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.equal(opt.score(ids, prefix), opt.score(ids, 2))


@pytest.mark.parametrize("eos", [np.int64, np.int32, np.uint16])
def test_chat_takes_a_numpy_eos_id(eos):
    """The issue's: chat generated, then raised TypeError resolving a numpy eos by hand."""
    from rewriter.models.checkpoints import DEFAULT_MODEL_DIR
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"),
                                  chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).eval()
    chat_opt = rewriter.optimize(model, tokenizer=tok)
    first = int(chat_opt.generate([tok.encode("hello")], max_new_tokens=3, eos_token_id=[])[0, -1])
    answer = chat_opt.chat("hello", max_new_tokens=3, eos_token_id=eos(first))
    assert answer == chat_opt.chat("hello", max_new_tokens=3, eos_token_id=first)


# ------------------------------------------------------------------ explicit positions

def test_positions_beyond_the_context_are_refused_by_name(opt):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"positions must be < 128 \(the model's context length\), got 1000000"):
        opt(ids, torch.tensor([[0, 1, 10 ** 6]]))  # the (RoPE: no IndexError, still past the context)
    assert opt(ids, torch.tensor([[125, 126, 127]])).shape == (1, 3, VOCAB)


@pytest.mark.parametrize("family,position", [
    ("gpt2", 100),  # the issue's: GPT-2 n_positions=64, IndexError
    ("gpt2", 64),
    ("opt", 64),  # OPT reads position + 2: row 66 of a 66-row table
])
def test_positions_past_a_learned_position_table_are_refused_by_name(family, position):
    torch.manual_seed(0)
    model = (T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64))
             if family == "gpt2" else
             T.OPTForCausalLM(T.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=64,
                                          word_embed_proj_dim=64))).eval()
    small = rewriter.optimize(model)
    with pytest.raises(ValueError, match=f"positions must be < 64 .* got {position}"):
        small(torch.tensor([[1, 2]]), torch.tensor([[0, position]]))
    assert small(torch.tensor([[1, 2]]), torch.tensor([[62, 63]])).shape == (1, 2, 128)


@pytest.mark.parametrize("positions", [torch.tensor([[0, 1, 2]]), torch.tensor([[5, 6, 7]]),
                                       torch.tensor([[0, 0, 0]], dtype=torch.int32)])
def test_positions_for_a_model_that_reads_none_are_refused_not_ignored(positions):
    """A BERT-like decoder: its position ids are made inside the model, and the frontend
    wires ``positions`` to nothing; explicit positions would be ignored in silence."""
    torch.manual_seed(0)
    bert = T.BertLMHeadModel(T.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          max_position_embeddings=128, is_decoder=True)).eval()
    opt = rewriter.optimize(bert)
    with pytest.raises(ValueError, match="positions were given, but this model reads none"):
        opt(torch.tensor([[1, 2, 3]]), positions)
    assert opt(torch.tensor([[1, 2, 3]])).shape == (1, 3, 128)
