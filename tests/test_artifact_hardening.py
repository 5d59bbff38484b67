"""Artifacts, second round (issue 57): non-finite weights, stored kernels that do not
import, and artifacts without a tokenizer. Each test edits a copy of a saved artifact and
reseals its checksums (``artifact_tools.reseal``), so the edit reaches the check it is about.

- A NaN or infinite floating weight, anywhere in ``weights.safetensors`` (int4 scales and
  minimums, an embedding, a norm in bfloat16, a linear in float16, draft heads, an EAGLE
  draft), is an ``ArtifactError`` naming the file and the tensor, and nothing is written;
  integer tensors (int4 codes) are not floating weights. ``save`` refuses such a model.
- With ``trust_code=True`` a stored kernel that does not import (a syntax error, a name or
  import error, an exception, an exit) or lacks its ``@triton.jit`` function is an
  ``ArtifactError`` naming ``kernels/<name>.py`` and the problem.
- A manifest whose file list lacks ``tokenizer.json`` says that the artifact has no
  tokenizer; one saved without a tokenizer loads, and what needs text says what to do.
"""
import hashlib
import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer

import rewriter
from rewriter import ArtifactError, RewriterError
from rewriter.models.checkpoints import DEFAULT_MODEL_DIR
from rewriter.cli import main
from rewriter.passes import EagleDraft, Int4Weights, MedusaHeads

from artifact_tools import reseal, version_dir
from conftest import make_model, random_draft
from test_artifact_contents import edit_weights

NAN, INF = float("nan"), float("inf")
IDS = [[3, 17, 42, 5]]

# One xdist worker runs this module (``--dist loadgroup``, pyproject.toml):
# its shared set of saved artifacts is built once.
pytestmark = pytest.mark.xdist_group("artifact_hardening")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root, engines): artifacts by name, each saved from its engine: the default model
    with int4 weights, tiny models in bfloat16 and float16 (no tokenizer), with Medusa
    heads (and the default model's tokenizer) and with an EAGLE draft."""
    root = tmp_path_factory.mktemp("hardening")
    tiny = make_model("llama-gqa-3l")
    draft = random_draft(tiny, root / "draft.safetensors")
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    traced = rewriter.trace(tiny)  # one trace for both draft pipelines
    engines = {
        "int4": rewriter.from_pretrained("default", passes=[Int4Weights()]),
        "bf16": rewriter.optimize(make_model("llama-gqa-3l").to(torch.bfloat16)),
        "fp16": rewriter.optimize(make_model("qwen2-mqa-3l").to(torch.float16)),
        "medusa": rewriter.optimize(traced, tokenizer=tokenizer,
                                    passes=[MedusaHeads(num_heads=2, tree=[[0], [1], [0, 0]])]),
        "eagle": rewriter.optimize(traced, passes=[EagleDraft(weights=draft)]),
    }
    for name, engine in engines.items():
        engine.save(root / name)
    return root, engines


def copy_of(saved, name, tmp_path):
    shutil.copytree(saved[0] / name, tmp_path / name, symlinks=True)
    return tmp_path / name


def tree(path) -> dict:
    """Every file under ``path`` by relative name, with its sha256: what a load changed."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def poison(tensors, name, value, where=(0,)):
    """Put ``value`` at the first element (or ``where``) of the stored tensor ``name``."""
    t = tensors[name]
    assert t.is_floating_point(), (name, t.dtype)
    t.view(-1)[list(where)] = value


# ---------------------------------------------------------------------------- non-finite weights

PROJ = "model.layers.0.self_attn.q_proj"
NON_FINITE = [
    # (artifact, stored tensor, value, where) -- the input first
    ("int4", f"{PROJ}.int4_scales", NAN, (0,)),
    ("int4", f"{PROJ}.int4_scales", NAN, range(0, 2048, 7)),  # many, scattered
    ("int4", "model.layers.7.mlp.down_proj.int4_mins", -INF, (-1,)),  # the last element
    ("int4", "model.layers.3.mlp.up_proj.int4_scales", INF, (5,)),
    ("int4", "lm_head.weight", INF, (12345,)),  # the (tied) embedding and LM head, float32
    ("int4", "model.norm.weight", NAN, (255,)),
    ("bf16", "model.layers.1.input_layernorm.weight", NAN, (3,)),  # a norm, bfloat16
    ("bf16", "model.rotary_emb.inv_freq", INF, (0,)),  # the RoPE table
    ("bf16", "model.layers.2.mlp.down_proj.weight", -INF, (100,)),
    ("fp16", "model.layers.0.self_attn.k_proj.weight", INF, (7,)),  # a linear, float16
    ("fp16", "model.layers.1.self_attn.q_proj.bias", NAN, (0,)),
    ("medusa", "medusa.w1", -INF, (0,)),  # a draft head
    ("medusa", "medusa.b0", NAN, (9,)),
    ("eagle", "eagle.fc_weight", NAN, (1,)),  # EAGLE's draft layer
    ("eagle", "eagle.norm", INF, (0,)),
]


@pytest.mark.parametrize("name,tensor,value,where", NON_FINITE,
                         ids=[f"{a}-{t}-{v}" for a, t, v, _ in NON_FINITE])
def test_a_non_finite_weight_is_refused_by_name(saved, tmp_path, name, tensor, value, where):
    art = copy_of(saved, name, tmp_path)
    edit_weights(art, lambda w: poison(w, tensor, value, where))
    before = tree(tmp_path)
    with pytest.raises(ArtifactError) as e:
        rewriter.load(art)
    message = str(e.value)
    assert "weights.safetensors" in message and repr(tensor) in message, message
    assert "NaN or infinite" in message, message
    assert tree(tmp_path) == before  # nothing written, nothing changed


def test_nan_int4_scales_fail_the_cli_in_one_line(saved, tmp_path, capsys):
    """The issue's input through ``rewriter run``: it emitted token 0 forever, exit 0."""
    art = copy_of(saved, "int4", tmp_path)
    edit_weights(art, lambda w: w[f"{PROJ}.int4_scales"].fill_(NAN))
    assert main(["run", str(art), "--ids", "1,2,3", "--max-new-tokens", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("rewriter: error: ") and f"'{PROJ}.int4_scales'" in err, err


def test_integer_tensors_are_not_checked_as_weights(saved, tmp_path):
    """int4 codes are bytes: every value is a valid pair of codes, NaN has no meaning."""
    art = copy_of(saved, "int4", tmp_path)
    edit_weights(art, lambda w: w[f"{PROJ}.int4_codes"].fill_(255))
    rewriter.load(art).generate(IDS, max_new_tokens=2)


def test_finite_extremes_still_load(saved, tmp_path):
    """The largest finite values and negative zero are weights, not infinities."""
    art = copy_of(saved, "bf16", tmp_path)
    big = torch.finfo(torch.bfloat16).max

    def extremes(w):
        poison(w, "model.norm.weight", big, (0,))
        poison(w, "model.norm.weight", -big, (1,))
        poison(w, "model.norm.weight", -0.0, (2,))
    edit_weights(art, extremes)
    rewriter.load(art)


@pytest.mark.parametrize("value", [NAN, -INF])
def test_a_model_with_a_non_finite_weight_is_not_saved(saved, tmp_path, value):
    """What load refuses is never written: a diverged model fails at save, by name."""
    weight = saved[1]["bf16"].ir.weight("model.norm.weight")
    kept = weight[5].item()
    weight[5] = value
    try:
        with pytest.raises(ArtifactError, match=r"cannot save the model: its tensor 'model\.norm"
                                                r"\.weight' \(bfloat16 \[64\]\) holds 1 NaN or "
                                                r"infinite value$"):
            saved[1]["bf16"].save(tmp_path / "a")
    finally:
        weight[5] = kept
    assert list(tmp_path.iterdir()) == []


def test_the_check_reads_every_element_of_large_tensors_in_every_float_dtype():
    """``aminmax`` propagates NaN wherever it sits (vectorised lanes, tails, threads)."""
    from rewriter.runtime.artifact_files import non_finite
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                  torch.float8_e4m3fn, torch.float8_e5m2):
        for n in (1, 15, 16, 17, 1000, 100_003):  # past a thread's share (32768)
            for i in {0, n // 2, n - 1}:
                for value in (NAN, INF, -INF):
                    t = torch.ones(n).to(dtype)
                    t[i] = value
                    if dtype == torch.float8_e4m3fn and t[i].float().isfinite():
                        continue  # e4m3fn has no infinity: it saturates
                    assert non_finite({"w": t}) is not None, (dtype, n, i, value)
            assert non_finite({"w": torch.ones(n).to(dtype)}) is None
    assert non_finite({"w": torch.empty(0), "i": torch.full((3,), 255, dtype=torch.uint8)}) is None


# ---------------------------------------------------------------------------- stored kernels

@pytest.fixture(scope="module")
def triton_saved(tmp_path_factory):
    pytest.importorskip("triton")
    path = tmp_path_factory.mktemp("triton") / "a"
    rewriter.optimize(make_model("gpt2-3l"), backend="triton").save(path)
    return path


KERNEL = "pointwise_0_add"
BROKEN_KERNELS = [
    # (change to the stored source, what the message says)
    (lambda s: s.replace(f"def {KERNEL}(", "def renamed("),
     rf"defines no '{KERNEL}' \(a stored kernel"),
    (lambda s: s + "\ndef broken(:\n", r"importing it raised SyntaxError at line 1[67]: "),
    (lambda s: s.replace("import triton\n", "import triton\nraise RuntimeError('boom')\n"),
     r"importing it raised RuntimeError at line 4: boom"),
    (lambda s: s.replace("import triton\n", "import triton\nundefined_name\n"),
     r"importing it raised NameError at line 4: name 'undefined_name' is not defined"),
    (lambda s: s.replace("import triton\n", "import no_such_module_xyz\n"),
     r"importing it raised ModuleNotFoundError at line 3: No module named 'no_such_module_xyz'"),
    (lambda s: s.replace("@triton.jit\n", ""),  # a plain function: not subscriptable at launch
     rf"'{KERNEL}' is a function, not a @triton\.jit function"),
    (lambda s: s + f"\n{KERNEL} = 5\n", rf"'{KERNEL}' is an int, not a @triton\.jit function"),
    (lambda s: s.replace("import triton\n", "import sys\nsys.exit(3)\n"),
     r"importing it raised SystemExit at line 4: 3"),
    (lambda s: s.replace("import triton\n", "def f():\n    f()\nf()\n"),
     r"importing it raised RecursionError at line 4: maximum recursion depth"),
]


@pytest.mark.parametrize("change,problem", BROKEN_KERNELS,
                         ids=["missing", "syntax", "raises", "name", "import", "not_jit",
                              "not_callable", "exit", "recursion"])
def test_a_stored_kernel_that_does_not_import_is_named(triton_saved, tmp_path, change, problem):
    art = tmp_path / "a"
    shutil.copytree(triton_saved, art, symlinks=True)
    file = version_dir(art) / "kernels" / f"{KERNEL}.py"
    file.write_text(change(file.read_text()))
    reseal(art)
    with pytest.raises(ArtifactError, match=problem) as e:
        rewriter.load(art, trust_code=True)
    assert str(e.value).startswith(f"{file}: "), str(e.value)
    assert "trust_code=True" in str(e.value)
    rewriter.load(art)  # without trust_code the kernel is regenerated: the file never runs


def test_a_broken_stored_kernel_fails_the_cli_in_one_line(triton_saved, tmp_path, capsys):
    art = tmp_path / "a"
    shutil.copytree(triton_saved, art, symlinks=True)
    file = version_dir(art) / "kernels" / f"{KERNEL}.py"
    file.write_text(file.read_text() + "\ndef broken(:\n")
    reseal(art)
    assert main(["run", str(art), "--ids", "1,2", "--trust-code", "--max-new-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"kernels/{KERNEL}.py" in err, (out, err)


# ---------------------------------------------------------------------------- no tokenizer

def edit_manifest(path, change):
    file = version_dir(path) / "manifest.json"
    manifest = json.loads(file.read_text())
    change(manifest)
    file.write_text(json.dumps(manifest))
    reseal(path)


def unlist(*names):
    def change(m):
        for name in names:
            del m["files"][name]
    return change


NO_TOKENIZER = "the artifact has no tokenizer (save the model again with its tokenizer)"
TOKENIZER_CASES = [
    # (manifest change, files to delete, message) -- the input first
    (unlist("tokenizer.json"), [], "names tokenizer.json as the tokenizer, but its file list "
                                   "has no tokenizer.json: " + NO_TOKENIZER),
    (unlist("tokenizer.json"), ["tokenizer.json"], "names tokenizer.json as the tokenizer, but "
                                                   "its file list has no tokenizer.json"),
    (lambda m: (unlist("tokenizer.json")(m), m.update(tokenizer=None)), ["tokenizer.json"],
     "lists tokenizer_config.json but not tokenizer.json: " + NO_TOKENIZER),
    (lambda m: m.update(tokenizer=None), [],
     "lists tokenizer.json but its tokenizer field is null"),
    (lambda m: m.update(tokenizer="vocab.json"), [],
     "tokenizer must be the listed tokenizer.json or null, got 'vocab.json'"),
]


@pytest.mark.parametrize("change,delete,message", TOKENIZER_CASES,
                         ids=["unlisted", "unlisted_and_gone", "config_only", "listed_not_named",
                              "other_name"])
def test_a_manifest_without_its_tokenizer_says_so(saved, tmp_path, change, delete, message):
    art = copy_of(saved, "medusa", tmp_path)
    for name in delete:
        (version_dir(art) / name).unlink()
    edit_manifest(art, change)
    with pytest.raises(ArtifactError) as e:
        rewriter.load(art)
    assert str(e.value).startswith(f"{version_dir(art) / 'manifest.json'}: {message}"), str(e.value)


def test_an_artifact_saved_without_a_tokenizer_says_what_to_do(saved, tmp_path, capsys):
    art = copy_of(saved, "bf16", tmp_path)  # optimized from a model alone: no tokenizer
    assert json.loads((version_dir(art) / "manifest.json").read_text())["tokenizer"] is None
    engine = rewriter.load(art)
    assert engine.generate(IDS, max_new_tokens=2).shape == (1, 6)  # token ids still work
    with pytest.raises(RewriterError, match=r"has no tokenizer \(.*its artifact was saved "
                                            r"without one\), so it cannot chat: give token ids"):
        engine.chat("hi")
    for argv in (["--prompt", "hi"], ["--chat", "hi"]):
        assert main(["run", str(art), *argv, "--max-new-tokens", "2"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "has no tokenizer" in err, (argv, err)
        assert "--ids" in err, err
