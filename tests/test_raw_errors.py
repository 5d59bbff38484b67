"""Raw errors the second hostile round found (issue 57, item 4), each now the project's own
error naming the problem, with more inputs of each class:

(a) JSON nested deep in a heads file's metadata (a RecursionError), and everywhere else the
    project reads JSON: draft and gates files, checkpoint configs, pass spec values;
(b) a draft file's tensor of the right shape and the wrong dtype, reported as a shape;
(c) ``chat(None)``, ``chat(5)``, lone surrogates reaching the tokenizer, and the Python
    API's other arguments of the wrong type (paths, flags, the model, the pass list);
(d) a path with a comma (or a quote, a colon, brackets) in a pass spec: quoted, it now
    reads, and round-trips through an artifact (``to_spec``);
(e) ``PromptLookup`` on a short-context model suggesting the draft heads' parameters;
(f) an unknown activation in a checkpoint's config, named by value only.

Each case checks the error type and that the message names the problem; where a command
could write, that nothing was written."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import rewriter
from conftest import make_model
from rewriter.drafts import duo_gates, eagle, eagle_file
from rewriter.drafts import heads as heads_file
from rewriter.models.checkpoints import DEFAULT_MODEL_DIR
from rewriter.cli import main
from rewriter.errors import CheckpointError, PassError, RewriterError
from rewriter.passes import (DuoAttention, EagleDraft, HydraHeads, MedusaHeads, PromptLookup,
                             SelfSpeculative, from_spec, to_spec)
from test_checkpoints import tiny_llama

H, K, VOCAB = 8, 2, 10
DEEP = "[" * 100_000 + "]" * 100_000  # the issue's: json recursed until RecursionError


def nested(levels: int) -> str:
    """A JSON object nested ``levels`` deep: Python reads it, no real file nests so."""
    return '{"a": ' * levels + "1" + "}" * levels


def files_under(d) -> dict:
    """Every file under ``d`` and its bytes: a refused command must change none."""
    return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def write_heads(path, arch="medusa", tensors=None, meta=None):
    """A valid ``K``-head heads file for hidden size ``H``, then ``tensors``/``meta`` over it."""
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(H, H * (i + 2), generator=g) for i in range(K)] if arch == "hydra" \
        else torch.randn(K, H, H, generator=g)
    heads_file.Heads(w, torch.zeros(K, H), VOCAB, [[0.0] * 8] * 4, [[0.5]] * K, {"seed": 0},
                     torch.ones(VOCAB, dtype=torch.int64), arch).save(path)
    return rewrite(path, path, tensors, meta)


def rewrite(src, dst, tensors=None, meta=None):
    with safe_open(str(src), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        m = dict(f.metadata())
    t.update(tensors or {})
    m.update(meta or {})
    save_file(t, str(dst), metadata=m)
    return dst


def eagle_draft_file(path):
    shape = eagle.Shape(hidden=32, heads=4, kv_heads=2, intermediate=48)
    g = torch.Generator().manual_seed(0)
    eagle_file.made(eagle.init(shape, g), shape, torch.randn(50, 32, generator=g)).save(path)
    return path


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


# ---------------------------------------------------------------------------- (a) deep JSON

@pytest.mark.parametrize("field,text", [
    ("probe", DEEP),  # the issue's
    ("accuracy", DEEP),
    ("trained", DEEP),
    # parses, but stored in the IR's info it made an artifact that saved and did not load
    ("trained", nested(40)),
], ids=["probe", "accuracy", "trained", "trained-40"])
def test_heads_metadata_nested_deep_is_refused_naming_the_file_and_field(tmp_path, field, text):
    path = write_heads(tmp_path / "h.safetensors", meta={field: text})
    before = files_under(tmp_path)
    problem = (rf"h.safetensors: bad metadata \('{field}' is not JSON \(lists and objects nested "
               rf"more than 16 deep")
    with pytest.raises(heads_file.HeadsFileError, match=problem):
        heads_file.load(path)
    with pytest.raises(ValueError, match="MedusaHeads: .*" + problem):
        MedusaHeads(weights=str(path))
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("field,text", [("trained", DEEP), ("trained", nested(40)),
                                        ("probe", nested(20))],
                         ids=["trained", "trained-40", "probe-20"])
def test_eagle_metadata_nested_deep_is_refused_naming_the_field(tmp_path, field, text):
    path = rewrite(eagle_draft_file(tmp_path / "d.safetensors"), tmp_path / "bad.safetensors",
                   meta={field: text})
    with pytest.raises(ValueError, match=rf"bad.safetensors: .*'{field}' is not JSON .*nested "
                                         rf"more than 16"):
        EagleDraft(weights=str(path))


def test_a_gates_file_nested_deep_is_refused(tmp_path):
    data = json.loads((duo_gates.ASSETS / "default.json").read_text())
    path = tmp_path / "g.json"
    path.write_text(json.dumps(data)[:-1] + ', "calibration": ' + nested(40) + "}")
    with pytest.raises(duo_gates.GatesFileError, match=r"g.json: not JSON \(.*nested more than 16"):
        DuoAttention(gates=str(path))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("raw_errors") / "ckpt"
    tiny_llama().save_pretrained(d)
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.json", d)
    return d


def broken_checkpoint(checkpoint, tmp_path, name, text):
    d = tmp_path / "ckpt"
    shutil.copytree(checkpoint, d)
    (d / name).write_text(text)
    return d


@pytest.mark.parametrize("name,text", [("config.json", DEEP), ("tokenizer_config.json", DEEP),
                                       ("tokenizer_config.json", nested(40))],
                         ids=["config", "tokenizer_config", "tokenizer_config-40"])
def test_checkpoint_json_nested_deep_is_a_checkpoint_error(checkpoint, tmp_path, name, text,
                                                           capsys):
    d = broken_checkpoint(checkpoint, tmp_path, name, text)
    with pytest.raises(CheckpointError, match=rf"{name}: not valid JSON \(.*nested more than 16"):
        rewriter.from_pretrained(d)
    code, err = run_cli(capsys, "optimize", d, "--out", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and f"{name}: not valid JSON" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000,
                                   "[" * 18 + "]" * 18],
                         ids=["list-5000", "object-3000", "list-18"])
def test_a_pass_spec_value_nested_deep_is_refused(value, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"pass layer_skip: parameter 'layers': .* is not JSON "
                                         r"\(lists and objects nested more than 16 deep\)"):
        from_spec("layer_skip:layers=" + value)
    code, err = run_cli(capsys, "optimize", "default", "--pass", "layer_skip:layers=" + value,
                        "--out", tmp_path / "out")
    assert code == 2 and "nested more than 16 deep" in err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- (b) dtypes

I64, I32, F64 = (dict(dtype=d) for d in (torch.int64, torch.int32, torch.float64))
F8 = torch.float8_e4m3fn


@pytest.mark.parametrize("arch,tensors,match", [
    ("medusa", {"w": torch.zeros(K, H, H, **I64)}, r"w must be float32 \(b's dtype\), got int64"),
    ("medusa", {"w": torch.zeros(K, H, H, dtype=torch.bool)}, r"w must be float32 .*got bool"),
    ("medusa", {"w": torch.zeros(K, H, H, **F64)}, r"w must be float32 .*got float64"),
    ("medusa", {"b": torch.zeros(K, H, **I32), "w": torch.zeros(K, H, H, **I32)},
     r"b must be one of float32, bfloat16, float16, float64, got int32"),
    # isfinite is not implemented for it: a raw NotImplementedError before
    ("medusa", {"b": torch.zeros(K, H).to(F8), "w": torch.zeros(K, H, H).to(F8)},
     r"b must be .*got float8_e4m3fn"),
    ("hydra", {"w1": torch.zeros(H, 3 * H, **I64)}, r"w1 must be float32 \(b's dtype\), got int64"),
    ("medusa", {"deep_w": torch.zeros(1, K, H, H), "deep_b": torch.zeros(1, K, H, **I64)},
     r"deep_b must be float32 \(b's dtype\), got int64"),
    ("medusa", {"counts": torch.ones(VOCAB)},
     r"counts must be \[10\] non-negative int64, got float32"),
], ids=["w-int64", "w-bool", "w-float64", "b-int32", "b-float8", "hydra-w1-int64", "deep_b-int64",
        "counts-float32"])
def test_a_heads_tensor_of_the_wrong_dtype_is_named_as_that(tmp_path, arch, tensors, match):
    path = write_heads(tmp_path / "h.safetensors", arch, tensors)
    with pytest.raises(heads_file.HeadsFileError, match="h.safetensors: " + match):
        heads_file.load(path, arch)
    cls = HydraHeads if arch == "hydra" else MedusaHeads
    with pytest.raises(ValueError, match=f"{cls.__name__}: .*h.safetensors: {match}"):
        cls(weights=str(path))


@pytest.mark.parametrize("tensors,match", [
    ({"fc.weight": torch.zeros(32, 64, **I64)},
     r"fc.weight must be float32 or bfloat16, got int64"),
    ({"norm.weight": torch.ones(32, dtype=torch.float16)}, r"norm.weight must be .*, got float16"),
    ({"counts": torch.ones(50, **I32)}, r"counts must be \[50\] non-negative int64, got int32"),
])
def test_an_eagle_tensor_of_the_wrong_dtype_is_named_as_that(tmp_path, tensors, match):
    path = rewrite(eagle_draft_file(tmp_path / "d.safetensors"), tmp_path / "bad.safetensors",
                   tensors)
    with pytest.raises(eagle_file.DraftFileError, match=match):
        eagle_file.load(path)


# ---------------------------------------------------------------------------- (c) the Python API

CONTENT = r"messages\[0\]\['content'\]"
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def opt():
    tok = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"),
                                  eos_token="<|endoftext|>", chat_template=CHAT)
    return rewriter.optimize(make_model("llama-gqa-3l"), tokenizer=tok)


@pytest.mark.parametrize("messages,match", [
    (None, r"messages must be a string or a list of \{'role', 'content'\} dicts, got NoneType"),
    (5, r"messages must be a string or a list .* got int"),
    ("\ud800", r"messages is not valid UTF-8 text \(a lone surrogate at character 0\)"),
    (b"hi", r"messages must be .* got bytes"),
    ({"role": "user", "content": "hi"}, r"messages must be .* got dict"),
    (iter([{"role": "user", "content": "hi"}]), r"messages must be .* got list_iterator"),
    ([{"role": "user", "content": "a\udcffb"}], rf"{CONTENT} is not valid UTF-8 .* 1\)"),
    ([{"role": "us\ud800", "content": "a"}], r"messages\[0\]\['role'\] is not valid UTF-8"),
    ([{"role": "user", "content": None}], rf"{CONTENT} must be a string, got NoneType"),
    ([{"role": "user", "content": ["hi"]}], rf"{CONTENT} must be a string, got list"),
    ([{"role": "user"}], rf"{CONTENT} must be a string, got NoneType"),
    ([{"role": 1, "content": "hi"}], r"messages\[0\]\['role'\] must be a string, got int"),
], ids=["None", "5", "surrogate", "bytes", "dict", "iterator", "content-surrogate", "role-surrogate",
        "content-None", "content-list", "content-missing", "role-int"])  # the first three: the issue's
def test_chat_names_a_bad_message(opt, messages, match):
    with pytest.raises(ValueError, match=match):
        opt.chat(messages, max_new_tokens=2)


def test_a_chat_template_holding_a_lone_surrogate_is_named(opt):
    """From an artifact's or a checkpoint's JSON, where "\\ud800" reads as one."""
    text = opt.text
    try:
        opt.text = rewriter.runtime.chat.TextConfig(CHAT + "\ud800")
        with pytest.raises(RewriterError, match="rendered chat template is not valid UTF-8 .*"
                                                "the template or its special tokens hold it"):
            opt.chat("hi", max_new_tokens=2)
    finally:
        opt.text = text


@pytest.fixture(scope="module")
def saved(opt, tmp_path_factory):
    d = tmp_path_factory.mktemp("saved") / "a"
    opt.save(d)
    return d


PATH = "must be a str or os.PathLike, got"
FLAG = "must be True or False, got 'no'"


def llama():
    return make_model("llama-gqa-3l")


API = {  # each raised a raw TypeError, ran as if the value were right, or blamed another file
    "load(None)": (lambda o, d: rewriter.load(None), ValueError, f"directory {PATH} NoneType"),
    "load(5)": (lambda o, d: rewriter.load(5), ValueError, f"directory {PATH} int"),
    "load('')": (lambda o, d: rewriter.load(""), ValueError, r"directory is empty \(''"),
    # "no" is true: the stored kernels would have run
    "load(trust_code='no')": (lambda o, d: rewriter.load(d, trust_code="no"), ValueError,
                              f"trust_code {FLAG}"),
    "load(backend=5)": (lambda o, d: rewriter.load(d, backend=5), ValueError,
                        "backend must be one of torch, triton or None"),
    "save(None)": (lambda o, d: o.save(None), ValueError, f"directory {PATH} NoneType"),
    "save(b'x')": (lambda o, d: o.save(b"x"), ValueError, f"directory {PATH} bytes"),
    "save('')": (lambda o, d: o.save(""), ValueError, "directory is empty"),
    "dump(5)": (lambda o, d: o.dump(5), ValueError, f"directory {PATH} int"),
    "kv_bytes_per_token('8')": (lambda o, d: o.kv_bytes_per_token("8"), ValueError,
                                "kv_bytes_per_token: tokens must be an integer"),
    "kv_bytes_per_token(-1)": (lambda o, d: o.kv_bytes_per_token(-1), ValueError,
                               "kv_bytes_per_token: tokens must be an integer >= 1, got -1"),
    "generate(progress='no')": (lambda o, d: o.generate([[1, 2]], progress="no"), ValueError,
                                f"progress {FLAG}"),
    "optimize(None)": (lambda o, d: rewriter.optimize(None), TypeError,
                       r"model must be a torch.nn.Module \(.*got NoneType"),
    "optimize('gpt2')": (lambda o, d: rewriter.optimize("gpt2"), TypeError,
                         "model must be a torch.nn.Module .*got str; rewriter.from_pretrained"),
    "optimize(passes=None)": (lambda o, d: rewriter.optimize(llama(), passes=None), TypeError,
                              "passes must be a list of passes, got NoneType"),
    "optimize(passes='fuse_qkv')": (lambda o, d: rewriter.optimize(llama(), passes="fuse_qkv"),
                                    TypeError, r"passes must be a list of passes, got str \(a spec"),
    "optimize(check='no')": (lambda o, d: rewriter.optimize(llama(), check="no"), ValueError,
                             f"check {FLAG}"),
    "optimize(dump=5)": (lambda o, d: rewriter.optimize(llama(), dump=5), ValueError,
                         f"dump {PATH} int"),
    "from_pretrained(None)": (lambda o, d: rewriter.from_pretrained(None), ValueError,
                              f"the checkpoint path {PATH} NoneType"),
}


@pytest.mark.parametrize("case", API)
def test_python_api_arguments_of_the_wrong_type_are_named(opt, saved, tmp_path, monkeypatch, case):
    call, error, match = API[case]
    monkeypatch.chdir(tmp_path)  # "" is the current directory: nothing may be written there
    before = files_under(saved.parent)
    with pytest.raises(error, match=match):
        call(opt, saved)
    assert files_under(saved.parent) == before and not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------- (d) pass specs

ODD_NAMES = ["a,b.safetensors",  # the issue's: a comma ended the value
             "a:b=c.safetensors", 'quo"te.safetensors', "two  spaces .safetensors",
             " leading.safetensors", "[x]{y}(z.safetensors", "back\\slash,.safetensors", "null"]


@pytest.mark.parametrize("name", ODD_NAMES)
def test_a_quoted_path_with_any_characters_reads_and_round_trips(tmp_path, name):
    d = tmp_path / "dir,with:odd=chars"
    d.mkdir()
    path = str(write_heads(d / name))
    p = from_spec(f"medusa_heads:weights={json.dumps(path)},tree=[[0]]")
    assert p.params()["weights"] == path
    spec = to_spec(p)
    assert json.dumps(path) in spec, spec  # written as a JSON string, whatever it holds
    assert from_spec(spec).params() == p.params()


@pytest.mark.parametrize("spec,match", [
    ('medusa_heads:weights="/tmp/a,b.safetensors', r"pass medusa_heads: a quote is not closed"),
    ('medusa_heads:weights="/tmp/a\\",num_heads=2', r"a quote is not closed"),  # \" is a quote
    ("medusa_heads:weights=/tmp/a[b,num_heads=2", r"pass medusa_heads: unbalanced brackets .*"
                                                  r'as a JSON string: key="..."'),
    ("medusa_heads:weights=/tmp/a]b,num_heads=2", r"unbalanced brackets"),
    ('medusa_heads:weights="/tmp/a"b.safetensors', r"parameter 'weights': .* is not JSON"),
    ("layer_skip:layers=[1,2", r"pass layer_skip: unbalanced brackets"),
])
def test_a_spec_whose_quotes_or_brackets_do_not_close_is_refused(spec, match, tmp_path, capsys):
    with pytest.raises(ValueError, match=match):
        from_spec(spec)
    code, err = run_cli(capsys, "optimize", "default", "--pass", spec, "--out", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_gates_path_with_a_comma_goes_through_the_cli_into_the_artifact(tmp_path, capsys):
    gates = tmp_path / 'my gates, v2 "final"' / "g:1=2.json"
    gates.parent.mkdir()
    shutil.copy(duo_gates.ASSETS / "default.json", gates)
    spec = f"duo_attention:gates={json.dumps(str(gates))},threshold=0.5"
    code, err = run_cli(capsys, "optimize", "default", "--pass", spec, "--out", tmp_path / "a")
    assert code == 0, err
    stored = rewriter.load(tmp_path / "a").pass_specs
    assert stored[0]["params"]["gates"] == str(gates)
    assert from_spec(to_spec(stored[0])).params() == stored[0]["params"]


# ---------------------------------------------------------------------------- (e) PromptLookup

@pytest.mark.parametrize("context,tokens", [(24, 4),  # the issue's: the defaults
                                            (12, 8), (10, 16)])  # the last fails timing a step
def test_prompt_lookup_on_a_short_context_names_its_own_parameters(context, tokens):
    model = make_model("llama-gqa-3l", max_position_embeddings=context)
    with pytest.raises(PassError) as e:
        rewriter.optimize(model, passes=[PromptLookup(tokens=tokens)])
    message = str(e.value)
    assert f"the model has {context}" in message
    assert f"give PromptLookup fewer tokens (tokens={tokens} now), or adapt=False" in message
    assert "max_nodes" not in message and "tree=" not in message


def test_the_other_passes_that_time_on_the_model_name_their_own_parameters(tmp_path):
    """A step too long for the context, timed before any round: no hint at all before."""
    from test_draft_heads import random_heads
    model = make_model("llama-gqa-3l", max_position_embeddings=12)
    cases = [(SelfSpeculative(calibrate=[[1, 2, 3, 4]], max_draft=12),
              "give SelfSpeculative a smaller max_draft (max_draft=12 now)"),
             (MedusaHeads(weights=str(random_heads(model, tmp_path / "h.safetensors"))),
              "give the heads a smaller max_nodes, or tree=[...]")]
    for p, hint in cases:
        with pytest.raises(PassError, match="needs a context of more than .* the model has 12: "
                                            + re.escape(hint)):
            rewriter.optimize(model, passes=[p])


# ---------------------------------------------------------------------------- (f) activations

def test_an_unknown_activation_names_the_field_the_value_and_the_known_ones(checkpoint, tmp_path,
                                                                           capsys):
    config = json.loads((checkpoint / "config.json").read_text())
    gpt2 = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64)
                    ).save_pretrained(gpt2)
    cases = [(checkpoint, "hidden_act", "swiglu"),  # the issue's
             (checkpoint, "hidden_act", "SiLU"), (gpt2, "activation_function", "gelu_fast2")]
    for i, (source, field, value) in enumerate(cases):
        d = tmp_path / f"c{i}"
        shutil.copytree(source, d)
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, field: value}))
        match = (rf"c{i}/config.json: {field} '{value}' is not an activation transformers "
                 rf"builds; supported: .*gelu_new, .*relu, .*silu")
        with pytest.raises(CheckpointError, match=match):
            rewriter.from_pretrained(d)
        code, err = run_cli(capsys, "optimize", d, "--out", tmp_path / "out")
        assert code == 2 and err.count("\n") == 1 and f"{field} '{value}'" in err
        assert not (tmp_path / "out").exists()
