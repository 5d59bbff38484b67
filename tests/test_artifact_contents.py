"""What an artifact's files may say: every crafted or inconsistent ``ir.json`` /
``manifest.json`` / weights file is an ``ArtifactError`` naming the file and the problem
(issue 10, items 3 and 4). Each test edits a copy of one saved tiny Llama, reseals the
checksums (``artifact_tools.reseal``) so the edit reaches the parsers, and loads it."""
import json
import re
import shutil

import pytest
import torch
import transformers as T

import rewriter
from rewriter import ArtifactError, PassError
from rewriter.ir.serialize import resolve_target, target_name

from artifact_tools import artifact_files, reseal
from conftest import make_model

IDS = torch.tensor([[3, 17, 42, 5], [1, 2, 3, 4]])


def tiny_llama():
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64)
    return T.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("contents") / "llama"
    rewriter.optimize(tiny_llama()).save(path)
    return path


@pytest.fixture
def art(saved, tmp_path):
    """A fresh copy of the saved artifact that a test may edit."""
    shutil.copytree(saved, tmp_path / "a", symlinks=True)
    return tmp_path / "a"


def edit(path, name, change):
    """Apply ``change`` to the parsed JSON file ``name`` (it may return a replacement),
    write it back and reseal the checksums."""
    file = artifact_files(path)[name]
    data = json.loads(file.read_text())
    data = change(data) or data
    file.write_text(json.dumps(data))
    reseal(path)


def edit_weights(path, change):
    from safetensors.torch import load_file, save_file
    file = artifact_files(path)["weights.safetensors"]
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file))
    reseal(path)


def refused(path, file: str, problem: str) -> str:
    """Loading raises ArtifactError whose message names ``file`` and matches ``problem``."""
    with pytest.raises(ArtifactError) as e:
        rewriter.load(path)
    message = str(e.value)
    assert file in message and re.search(problem, message), message
    return message


def node(data, name):
    return next(n for n in data["graph"] if n["name"] == name)


def nodes(data, target):
    return [n for n in data["graph"] if n.get("target") == target]


def rename(data, old, new):
    """Rename node ``old`` to ``new`` and every reference to it."""
    text = json.dumps(data["graph"]).replace(json.dumps({"node": old}), json.dumps({"node": new}))
    data["graph"] = json.loads(text)
    node(data, old)["name"] = new


def test_the_untouched_artifact_loads_and_generates(art):
    edit(art, "ir.json", lambda d: None)  # a rewrite and reseal alone change nothing
    assert rewriter.load(art).generate(IDS, max_new_tokens=3).shape == (2, 7)


# ------------------------------------------------------------ names that would be code

def _placeholder(name):
    return lambda d: rename(d, "positions" if any(n["name"] == "positions" for n in d["graph"])
                            else [n for n in d["graph"] if n["op"] == "placeholder"][-1]["name"], name)


@pytest.mark.parametrize("name", [
    'positions=print("INJECTED")',  # the issue's: fx writes placeholder names into forward()
    "self",                         # def forward(self, self): a SyntaxError when fx compiles
    "torch",                        # would shadow the torch global the code calls
    "ｐositions",                   # not ASCII: NFKC makes it the same variable as another
    "x\n  y",
])
def test_a_node_name_that_is_code_is_refused(art, name, capsys):
    edit(art, "ir.json", _placeholder(name))
    refused(art, "ir.json", r"bad node name")
    assert "INJECTED" not in capsys.readouterr().out


@pytest.mark.parametrize("key", [
    "x=__import__('os')",      # the injected name
    "eps\n",                   # a newline in generated code: IndentationError
    "dim=print(1), y",
    "class",
])
def test_a_kwargs_key_that_is_code_is_refused(art, key):
    edit(art, "ir.json", lambda d: node(d, "rms_norm").__setitem__("kwargs", {key: 1e-6}))
    refused(art, "ir.json", r"node rms_norm: kwargs must be an object keyed by identifiers")


@pytest.mark.parametrize("target", ["__class__", "model.forward", "model.training",
                                    "model.norm.weight.__dict__", 'w", print("x")'])
def test_a_weight_path_that_is_code_or_an_attribute_is_refused(art, target):
    def change(d):
        get = nodes(d, "model.norm.weight")[0]
        d["weights"][target] = d["weights"].pop("model.norm.weight")
        get["target"] = target
    edit(art, "ir.json", change)
    refused(art, "ir.json", r"bad weight name")


@pytest.mark.parametrize("path", ["model.norm.weight.x", "lm_head.weight.t",
                                  "model.embed_tokens.weight.extra"])
def test_a_weight_that_is_also_a_module_on_another_path_is_refused(art, path):
    """fx would set an attribute on a tensor, and read the wrong thing back."""
    def change(d):
        old = "model.layers.0.input_layernorm.weight"
        nodes(d, old)[0]["target"] = path
        d["weights"][path] = d["weights"].pop(old)
    edit(art, "ir.json", change)
    refused(art, "ir.json", r"weight '[\w.]+' is also a module on the path of weight")


# ------------------------------------------------------------ the op allow-list

@pytest.mark.parametrize("target", [
    "aten.empty.memory_format",       # the issue's: uninitialised memory is no function
    "aten.empty_like.default", "aten.new_empty.default", "aten.empty_strided.default",
    "aten.rand.default", "aten.randn.default", "aten.randperm.default",
    "aten.native_dropout.default", "aten.bernoulli.default", "aten.normal.Tensor_float",
    "aten.uniform.default", "aten.multinomial.default", "aten._assert_async.msg",
])
def test_ops_whose_output_is_not_a_function_of_their_inputs_are_refused(art, target):
    edit(art, "ir.json", lambda d: node(d, "silu").__setitem__("target", target))
    refused(art, "ir.json", rf"node silu: unknown op '{re.escape(target)}'")
    with pytest.raises(ValueError):  # and no pass can store one either
        target_name(eval("torch.ops." + target))


@pytest.mark.parametrize("name", ["llama-gqa-3l", "gpt2-3l", "mistral-window-3l"])
def test_every_op_the_real_irs_store_is_accepted(name, tmp_path):
    from rewriter.passes import FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU
    passes = [] if name.startswith("gpt2") else [FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm(), FuseRoPE()]
    for p in ([], passes):
        opt = rewriter.optimize(make_model(name), passes=p)
        opt.save(tmp_path / "a")
        data = json.loads(artifact_files(tmp_path / "a")["ir.json"].read_text())
        for n in data["graph"]:
            if n["op"] == "call_function":
                resolve_target(n["target"], n["name"])
        kw = dict(max_new_tokens=3, eos_token_id=[])
        assert torch.equal(rewriter.load(tmp_path / "a").generate(IDS, **kw), opt.generate(IDS, **kw))


# ------------------------------------------------------------ attributes of rw ops

@pytest.mark.parametrize("index, value, problem", [
    (9, -5, r"window must be None or an integer in \[1"),  # the issue's: it changed the tokens
    (9, 0, r"window must be None or an integer in \[1"),
    (9, 2.5, r"window must be"),
    (9, True, r"window must be"),
    (4, 3, r"num_heads=3 is not a multiple of num_kv_heads=2"),
    (5, 0, r"num_kv_heads must be an integer in \[1"),
    (6, True, r"head_dim must be an integer"),
    (6, 8.0, r"head_dim must be an integer"),
    (7, float("nan"), r"scale must be a finite number > 0"),
    (7, -0.35, r"scale must be a finite number > 0"),
    (7, "0.35", r"scale must be a finite number > 0"),
    (8, 1, r"causal must be true or false"),
    (3, -1, r"layer must be an integer in \[0"),
])
def test_bad_attention_attributes_are_refused(art, index, value, problem):
    edit(art, "ir.json", lambda d: node(d, "attention")["args"].__setitem__(index, value))
    refused(art, "ir.json", rf"node attention: rw\.attention: {problem}")


@pytest.mark.parametrize("change, problem", [
    (lambda args: args + [None] * 11, r"takes 20 arguments, got 21"),
    (lambda args: args + [None, None, -1], r"sinks must be None or an integer in \[0"),
    (lambda args: args[:9] + [None, None, None, 4], r"sinks=4 needs a window"),
    (lambda args: args[:7], r"missing argument 'scale'"),
    (lambda args: [1.0] + args[1:], r"q must be a tensor, got 1\.0"),
])
def test_attention_arguments_of_the_wrong_number_or_kind_are_refused(art, change, problem):
    edit(art, "ir.json", lambda d: node(d, "attention").__setitem__(
        "args", change(node(d, "attention")["args"])))
    refused(art, "ir.json", rf"node attention: rw\.attention:? {problem}")


@pytest.mark.parametrize("name, index, value, problem", [
    ("rms_norm", 2, float("nan"), r"rw\.rms_norm: eps must be a finite number > 0"),
    ("rms_norm", 2, 0, r"rw\.rms_norm: eps must be a finite number > 0"),
    ("rms_norm", 2, -1e-6, r"rw\.rms_norm: eps must be a finite number > 0"),
    ("rope", 3, 0, r"rw\.rope: head_dim must be an integer in \[1"),
    ("rotary", 2, float("inf"), r"rw\.rotary: scaling must be a finite number > 0"),
])
def test_bad_attributes_of_other_ops_are_refused(art, name, index, value, problem):
    edit(art, "ir.json", lambda d: node(d, name)["args"].__setitem__(index, value))
    refused(art, "ir.json", rf"node {name}: {problem}")


@pytest.mark.parametrize("name, change", [
    ("mul_19", lambda n: n["args"].__setitem__(1, float("nan"))),
    ("add_6", lambda n: n.__setitem__("kwargs", {"alpha": float("nan")})),
    ("mul_28", lambda n: n["args"].__setitem__(1, [1.0, {"tuple": [float("nan")]}])),
])
def test_a_nan_constant_in_an_aten_node_is_refused(art, name, change):
    """JSON readers accept ``NaN``; a resealed one loaded and greedy decoding emitted token 0
    forever (issue 57). No IR rewriter writes holds one."""
    edit(art, "ir.json", lambda d: change(node(d, name)))
    refused(art, "ir.json", rf"node {name}: a NaN constant")


class SetAttention(rewriter.Pass):
    """A faulty pass: writes one attention argument."""

    def __init__(self, index, value):
        self.index, self.value = index, value

    def run(self, ir):
        for n in ir.ops():
            if n.target is rewriter.ops.OPS["attention"]:
                args = list(n.args)
                args[self.index] = self.value
                n.args = tuple(args)
        return ir


@pytest.mark.parametrize("index, value, problem", [
    (9, -5, "window must be"), (4, 3, "not a multiple"), (7, float("inf"), "scale must be")])
def test_a_pass_that_writes_a_bad_attribute_fails_by_name(index, value, problem):
    with pytest.raises(PassError, match=rf"SetAttention.*attention.*{problem}"):
        rewriter.optimize(tiny_llama(), passes=[SetAttention(index, value)])


# ------------------------------------------------------------ shapes of the weights

@pytest.mark.parametrize("weight, shape, problem", [
    ("model.layers.0.mlp.down_proj.weight", (32, 40), r"rw\.linear: weight \[32, 40\] does not take x"),
    ("model.layers.1.self_attn.k_proj.weight", (8, 32), r"rw\.attention: k .* is not \[B, S, num_kv_heads"),
    ("model.norm.weight", (31,), r"rw\.rms_norm: weight \[31\] does not fit"),
    ("model.embed_tokens.weight", (64,), r"rw\.embedding: weight must be \[rows, features\]"),
])
def test_mis_shaped_weights_are_refused_by_op(art, weight, shape, problem):
    edit_weights(art, lambda t: t.__setitem__(weight, torch.zeros(shape)))
    refused(art, "ir.json", rf"shapes do not propagate over weights\.safetensors: {problem}")


# ------------------------------------------------------------ agreement of the parts

@pytest.mark.parametrize("key, value", [("layers", 3), ("parameters", 1), ("dtype", "float16"),
                                        ("family", "gpt2")])
def test_the_manifest_model_section_must_match_the_ir(art, key, value):
    edit(art, "manifest.json", lambda m: m["model"].__setitem__(key, value))
    refused(art, "manifest.json", rf"model {key} is .*, but .*ir\.json and weights\.safetensors")


def test_the_manifest_config_must_be_the_ir_config(art):
    edit(art, "manifest.json", lambda m: m["model"]["config"].__setitem__("vocab_size", 65))
    refused(art, "manifest.json", r"model config differs from the config in .*ir\.json "
                                  r"\(vocab_size: 65 in the manifest, 64 in ir\.json\)")


@pytest.mark.parametrize("passes", [
    [{"name": "LayerSkip", "params": {"layers": [1], "speedup": None}}],  # the edit
    [{"name": "FuseQKV", "params": {}}],
    [{"name": "FuseRoPE", "params": {}}, {"name": "FuseRoPE", "params": {}}],
])
def test_the_manifest_pass_list_must_be_the_one_ir_json_records(art, passes):
    edit(art, "manifest.json", lambda m: m.__setitem__("passes", passes))
    refused(art, "manifest.json", r"passes .* are not the passes .*ir\.json records")


@pytest.mark.parametrize("where, message", [
    ({"backend": "torch", "device": "cpu", "machine": "x", "passes": ["PromptLookup"]},
     r"measured_on .* is not what .*ir\.json records \(None\)"),
    ({"backend": "torch", "device": 0}, r"'measured_on' must be null or an object"),
    ("cpu", r"'measured_on' must be null or an object")])
def test_the_manifests_measured_on_is_the_one_ir_json_records(art, where, message):
    """The manifest's ``measured_on`` (which ``rewriter info`` shows) may not claim timings
    the IR does not record, nor be malformed: the loader refuses both (an artifact saved
    before the field was written has none, and loads)."""
    edit(art, "manifest.json", lambda m: m.__setitem__("measured_on", where))
    refused(art, "manifest.json", message)
    edit(art, "manifest.json", lambda m: m.__delitem__("measured_on"))
    rewriter.load(art)


@pytest.mark.parametrize("info_change", [
    lambda i: i.__setitem__("fusions", {"FuseQKV": 2}),
    lambda i: i.__setitem__("skipped_layers", [1]),
    lambda i: i.__setitem__("skipped_layers", []),
])
def test_what_passes_left_in_the_ir_must_agree_with_the_pass_list(art, info_change):
    edit(art, "ir.json", lambda d: info_change(d["info"]))
    refused(art, "manifest.json", r"passes \[\] (lack|and the skipped layers .* disagree)")


@pytest.mark.parametrize("vocab", [65, 63, 128])
def test_config_vocab_size_must_match_the_embedding_rows(art, vocab):
    def change(d):
        d["info"]["config"]["vocab_size"] = vocab
    edit(art, "ir.json", change)
    edit(art, "manifest.json", lambda m: m["model"]["config"].__setitem__("vocab_size", vocab))
    refused(art, "ir.json", rf"config vocab_size is {vocab}, but the token embedding "
                            rf"'model\.embed_tokens\.weight' has 64 rows")


@pytest.mark.parametrize("rows", [65, 32, 128])
def test_the_lm_head_rows_must_match_the_vocabulary(art, rows):
    edit_weights(art, lambda t: t.__setitem__("lm_head.weight", torch.zeros(rows, 32)))
    edit(art, "manifest.json", lambda m: m["model"].__setitem__(  # not this check
        "parameters", m["model"]["parameters"] + (rows - 64) * 32))
    refused(art, "ir.json", rf"config vocab_size is 64, but the graph's output is \[.*{rows}\]")


@pytest.mark.parametrize("key, value, problem", [
    ("num_attention_heads", 8, r"num_heads=4, but the config says 8"),
    ("num_key_value_heads", 4, r"num_kv_heads=2, but the config says 4"),
    ("head_dim", 16, r"head_dim=8, but the config says 16"),
    ("sliding_window", 7, None),  # full attention under a config window: allowed (Qwen2 does)
    ("rms_norm_eps", 1e-5, r"eps=1e-06, but the config's rms_norm_eps is 1e-05"),
])
def test_config_head_counts_and_sizes_must_match_the_attention(art, key, value, problem):
    for name in ("ir.json", "manifest.json"):
        edit(art, name, lambda d: (d["info"]["config"] if "info" in d else d["model"]["config"])
             .__setitem__(key, value))
    if problem is None:
        rewriter.load(art)
    else:
        refused(art, "ir.json", rf"node (attention|rope|rms_norm)\w*: {problem}")


@pytest.mark.parametrize("key, value", [("vocab_size", "64"), ("vocab_size", None),
                                        ("eos_token_id", True), ("eos_token_id", 1.5),
                                        ("pad_token_id", -1), ("max_position_embeddings", float("nan"))])
def test_config_values_the_runtime_reads_are_checked_by_name(art, key, value):
    for name in ("ir.json", "manifest.json"):
        edit(art, name, lambda d: (d["info"]["config"] if "info" in d else d["model"]["config"])
             .__setitem__(key, value))
    refused(art, "ir.json", rf"info: config {key} must be")


def test_a_position_table_shorter_than_the_context_is_refused(tmp_path):
    rewriter.optimize(make_model("gpt2-3l")).save(tmp_path / "g")
    for name in ("ir.json", "manifest.json"):
        edit(tmp_path / "g", name, lambda d: (d["info"]["config"] if "info" in d
                                              else d["model"]["config"]).__setitem__("n_positions", 512))
    refused(tmp_path / "g", "ir.json", r"context is 512 tokens, but the position embedding "
                                        r"'transformer\.wpe\.weight' has 128 rows")


@pytest.mark.parametrize("weight, dtype", [
    ("model.layers.0.mlp.down_proj.weight", torch.float16),
    ("model.norm.weight", torch.bfloat16),
    ("model.embed_tokens.weight", torch.float64),
    ("model.norm.weight", torch.int8),
    ("lm_head.weight", torch.complex64),
])
def test_weights_of_mixed_dtypes_are_refused(art, weight, dtype):
    edit_weights(art, lambda t: t.__setitem__(weight, t[weight].to(dtype)))
    refused(art, "weights.safetensors", rf"is {dtype} but the model is torch\.float32|"
                                        rf"rw\.linear: x is torch\.\w+ but weight is torch\.\w+|"
                                        rf"is {dtype}, a dtype no op of .*ir\.json takes")


def test_rope_frequencies_may_stay_float32_in_a_bf16_model(art):
    def to_bf16(t):
        for k in t:
            if k != "model.rotary_emb.inv_freq":
                t[k] = t[k].to(torch.bfloat16)
    edit_weights(art, to_bf16)
    edit(art, "manifest.json", lambda m: m["model"].__setitem__("dtype", "bfloat16"))
    assert rewriter.load(art).generate(IDS, max_new_tokens=2).shape == (2, 6)


def test_weights_listed_in_ir_json_must_be_in_the_file(art):
    edit_weights(art, lambda t: t.pop("model.norm.weight"))
    refused(art, "ir.json", r"weights names 'model\.norm\.weight', which .*weights\.safetensors "
                            r"does not hold")


def test_tensors_in_the_file_must_be_used(art):
    edit_weights(art, lambda t: t.__setitem__("stowaway", torch.zeros(3)))
    refused(art, "weights.safetensors", r"holds 'stowaway', which .*ir\.json does not use")


def test_weights_listed_must_be_read_by_a_node(art):
    edit(art, "ir.json", lambda d: d["weights"].__setitem__("model.unused", "model.norm.weight"))
    refused(art, "ir.json", r"weights lists 'model\.unused', which no node reads")


def test_layer_spans_must_be_the_graphs(art):
    edit(art, "ir.json", lambda d: d["info"]["layers"].__delitem__(-1))
    refused(art, "ir.json", r"info layers .* are not the graph's layer spans")


# ------------------------------------------------------------ the raw exceptions of the issue

def _deep(depth):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("change, problem", [
    # SyntaxError: fx compiled forward(self, self)
    (_placeholder("self"), r"bad node name 'self'"),
    # IndentationError: a newline in a keyword name
    (lambda d: node(d, "rms_norm").__setitem__("kwargs", {"\n eps": 1e-6}), r"keyed by identifiers"),
    # IndexError: an output with no value; a getitem past the end
    (lambda d: d["graph"][-1].__setitem__("args", []), r"output node takes one value"),
    (lambda d: d["graph"][-1]["args"].append({"node": "linear"}), r"output node takes one value"),
    (lambda d: d["graph"].insert(-1, node(d, "positions")), r"placeholders must come before"),
    (lambda d: node(d, "cos_1")["args"].__setitem__(1, 7), r"node cos_1: shapes do not propagate"),
    (lambda d: node(d, "cos_1")["args"].__setitem__(1, -2**63), r"node cos_1: shapes do not propagate"),
    # AttributeError / TypeError: a field of the wrong type
    (lambda d: d.__setitem__("weights", list(d["weights"])), r"weights must map weight names"),
    (lambda d: d["graph"].insert(0, "placeholder"), r"a node must be an object"),
    (lambda d: d.__setitem__("info", []), r"info: must be an object"),
    (lambda d: d["info"].__setitem__("inputs", {"shape": 1}), r"info: inputs must be"),
    (lambda d: node(d, "rms_norm").__setitem__("meta", []), r"node rms_norm: meta must be"),
    # RecursionError: arguments nested deeper than any IR needs
    (lambda d: node(d, "rms_norm")["args"].__setitem__(2, _deep(500)), r"nested deeper than"),
    (lambda d: d["info"]["config"].__setitem__("x", _deep(400)), r"config must be an object nested"),
    # two outputs, an output in the middle
    (lambda d: d["graph"].append(d["graph"][-1]), r"exactly one output node"),
    (lambda d: d["graph"].insert(3, d["graph"][-1]), r"exactly one output node"),
])
def test_no_raw_python_exception_escapes(art, change, problem):
    edit(art, "ir.json", change)
    refused(art, "ir.json", problem)


@pytest.mark.parametrize("text", ["[" * 100000 + "]" * 100000, '{"graph": ' * 5000 + "1" + "}" * 5000],
                         ids=["lists", "objects"])
def test_json_nested_past_the_parsers_limit_is_refused(art, text):
    artifact_files(art)["ir.json"].write_text(text)
    reseal(art)
    refused(art, "ir.json", r".")


def test_an_unforeseen_failure_is_still_an_artifact_error_naming_the_file(art, monkeypatch):
    """The checks above leave nothing known to the safety net behind them; this shows it."""
    import rewriter.runtime.artifact_ir as artifact_ir
    monkeypatch.setattr(artifact_ir, "layer_spans", lambda gm: {}["boom"])
    refused(art, "ir.json", r"cannot be read \(KeyError: 'boom'\)")


# ------------------------------------------------------------------ memory and devices

def _before_output(data, new_node):
    """Insert ``new_node`` before the output and make the logits depend on it
    (``logits + sum(new_node)``), so it is not dead code."""
    out = data["graph"][-1]
    logits = out["args"][0]
    data["graph"][-1:-1] = [
        new_node,
        {"name": "total", "op": "call_function", "target": "aten.sum.dim_IntList",
         "args": [{"node": new_node["name"]}, [], True]},
        {"name": "mixed", "op": "call_function", "target": "aten.add.Tensor",
         "args": [logits, {"node": "total"}]}]
    out["args"] = [{"node": "mixed"}]


@pytest.mark.parametrize("new, problem", [
    ({"name": "huge", "op": "call_function", "target": "aten.full.default",
      "args": [[65536, 32768], 1.0]}, "would exhaust memory"),
    ({"name": "huge", "op": "call_function", "target": "aten.full.default",
      "args": [[1 << 20, 1 << 20], 1.0]}, "would exhaust memory"),
    ({"name": "huge", "op": "call_function", "target": "aten.repeat.default",
      "args": [{"node": "embedding"}, [65536, 1, 1]]}, "would exhaust memory"),
    ({"name": "huge", "op": "call_function", "target": "aten.expand.default",
      "args": [{"node": "embedding"}, [4096, 4096, -1, -1, -1]]}, "would exhaust memory"),
])
def test_a_few_bytes_of_ir_json_cannot_allocate_gigabytes(art, new, problem):
    edit(art, "ir.json", lambda d: _before_output(d, new))
    refused(art, "ir.json", problem)


@pytest.mark.parametrize("target, args", [
    ("aten.as_strided.default", [{"node": "embedding"}, [64], [1], 100000]),
    ("aten.nonzero.default", [{"node": "embedding"}]),
    ("aten._local_scalar_dense.default", [{"node": "embedding"}]),
])
def test_raw_memory_views_and_data_dependent_ops_are_refused(art, target, args):
    edit(art, "ir.json", lambda d: _before_output(d, {"name": "odd", "op": "call_function",
                                                      "target": target, "args": args}))
    refused(art, "ir.json", "unknown op")


@pytest.mark.parametrize("device, problem", [("meta", "malformed"), ("cuda:5", "no CUDA device"),
                                             ("cuda", "no CUDA device")])
def test_tensors_placed_where_they_cannot_run_are_refused(art, device, problem):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    new = {"name": "moved", "op": "call_function", "target": "aten._to_copy.default",
           "args": [{"node": "embedding"}], "kwargs": {"device": {"device": device}}}
    edit(art, "ir.json", lambda d: _before_output(d, new))
    refused(art, "ir.json", problem)
