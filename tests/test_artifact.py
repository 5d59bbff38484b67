"""Artifacts: save/load round trips exactly, every corruption is an ArtifactError naming the
file and the reason, saves are atomic, and loading runs no stored code."""
import json
import os
import pickle
import re
import shutil

import pytest
import torch

import rewriter
from rewriter import ArtifactError
from rewriter.passes import LayerSkip
from rewriter.runtime.artifact_dir import is_artifact
from rewriter.runtime.artifact_manifest import read_manifest

from artifact_tools import artifact_files, reseal
from conftest import make_model, varied_init

IDS = torch.tensor([[3, 17, 42, 5, 99, 8], [1, 2, 3, 4, 5, 6]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(OptimizedModel, artifact dir) of a Llama with LayerSkip, saved once."""
    model = make_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(model, passes=[LayerSkip(layers=[1])])
    path = tmp_path_factory.mktemp("art") / "llama-skip"
    opt.save(path)
    return opt, path


@pytest.fixture
def copy(saved, tmp_path):
    """A fresh copy of the saved artifact that a test may damage."""
    dst = tmp_path / "copy"
    shutil.copytree(saved[1], dst)
    return dst


def rewrite_manifest(path, edit):
    """Edit the manifest, then make every checksum agree (the pointer's included)."""
    manifest = artifact_files(path)["manifest.json"]
    m = json.loads(manifest.read_text())
    edit(m)
    manifest.write_text(json.dumps(m))
    reseal(path)


@pytest.mark.parametrize("name", ["llama-gqa-3l", "qwen2-mqa-3l", "mistral-window-3l", "gpt2-3l"])
def test_loaded_engine_generates_the_same_tokens(name, tmp_path):
    opt = rewriter.optimize(make_model(name, initializer_range=varied_init(name)))
    opt.save(tmp_path / "a")
    engine = rewriter.load(tmp_path / "a")
    kw = dict(max_new_tokens=16, eos_token_id=[])
    assert torch.equal(engine.generate(IDS, **kw), opt.generate(IDS, **kw))
    assert str(engine.ir) == str(opt.ir)  # names, ops, shapes, layers and roles survive


def test_manifest_records_versions_passes_and_checksums(saved):
    _, path = saved
    m = json.loads(artifact_files(path)["manifest.json"].read_text())
    assert m["format_version"] == 2 and m["versions"]["torch"] == torch.__version__
    assert m["passes"] == [{"name": "LayerSkip", "params": {"layers": [1], "speedup": None}}]
    assert m["model"]["family"] == "llama" and m["model"]["layers"] == 2
    assert set(m["files"]) == {"ir.json", "weights.safetensors"}
    for entry in m["files"].values():
        assert len(entry["sha256"]) == 64 and entry["bytes"] > 0


def test_tied_weights_are_stored_once(tmp_path):
    opt = rewriter.optimize(make_model("llama-gqa-3l", tie_word_embeddings=True))
    # Give the embedding its own name for the shared tensor, as a pass re-homing weights might.
    ir = opt.ir
    embed = next(n for n in ir.ops() if n.target is rewriter.ops.OPS["embedding"])
    ir.add_weight("model.embed_tokens.weight", ir.weight(embed.args[1].target))
    with ir.graph.inserting_before(embed):
        embed.args = (embed.args[0], ir.graph.get_attr("model.embed_tokens.weight"))
    ir.gm.recompile()
    names = ir.weights()
    assert names["model.embed_tokens.weight"] is names["lm_head.weight"]
    opt.save(tmp_path / "a")
    from safetensors import safe_open
    with safe_open(str(artifact_files(tmp_path / "a")["weights.safetensors"]), "pt") as f:
        assert len(set(f.keys())) == len(names) - 1
    engine = rewriter.load(tmp_path / "a")
    assert engine.ir.weight("lm_head.weight") is engine.ir.weight("model.embed_tokens.weight")
    assert torch.equal(engine.generate(IDS, max_new_tokens=4), opt.generate(IDS, max_new_tokens=4))


def test_tokenizer_travels_with_the_artifact(tmp_path):
    from rewriter.models.checkpoints import load_tokenizer
    opt = rewriter.optimize(make_model("llama-gqa-3l"))
    opt.tokenizer = load_tokenizer("default")
    opt.save(tmp_path / "a")
    engine = rewriter.load(tmp_path / "a")
    assert engine.tokenizer.encode("def f(x): return 42").ids == opt.tokenizer.encode("def f(x): return 42").ids


def test_missing_file(copy):
    artifact_files(copy)["weights.safetensors"].unlink()
    with pytest.raises(ArtifactError, match=r"weights\.safetensors: missing"):
        rewriter.load(copy)


def test_missing_pointer_is_not_an_artifact(copy):
    (copy / "artifact.json").unlink()
    with pytest.raises(ArtifactError, match=r"artifact\.json: missing"):
        rewriter.load(copy)


def test_missing_manifest(copy):
    artifact_files(copy)["manifest.json"].unlink()
    with pytest.raises(ArtifactError, match=r"manifest\.json: unreadable"):
        rewriter.load(copy)


def test_checksum_mismatch(copy):
    ir = artifact_files(copy)["ir.json"]
    ir.write_text(ir.read_text().replace("rw.linear", "rw.linaer", 1))  # same size
    with pytest.raises(ArtifactError, match=r"ir\.json: checksum mismatch"):
        rewriter.load(copy)


def test_truncated_weights(copy):
    weights = artifact_files(copy)["weights.safetensors"]
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    with pytest.raises(ArtifactError, match=r"weights\.safetensors: \d+ bytes, the manifest says"):
        rewriter.load(copy)
    reseal(copy)  # even with a manifest that agrees, it must not load
    with pytest.raises(ArtifactError, match=r"weights\.safetensors: unreadable safetensors"):
        rewriter.load(copy)


def test_unknown_format_version(copy):
    rewrite_manifest(copy, lambda m: m.__setitem__("format_version", 99))
    with pytest.raises(ArtifactError, match="format version 99 is not supported"):
        rewriter.load(copy)


@pytest.mark.parametrize("target", ["rw.not_an_op", "builtins.exec", "os.system", "aten.__class__.x",
                                    "aten.add.__init__"])
def test_unknown_op_is_refused_by_name(copy, target):
    def inject(data):
        next(n for n in data["graph"] if n["op"] == "call_function")["target"] = target
    edit_ir(copy, inject)
    node = next(n for n in json.loads(artifact_files(copy)["ir.json"].read_text())["graph"]
                if n["op"] == "call_function")
    with pytest.raises(ArtifactError, match=rf"ir\.json: node {node['name']}: unknown op"):
        rewriter.load(copy)


def test_loading_never_unpickles(copy, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("load used pickle")
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert rewriter.load(copy).generate(IDS, max_new_tokens=2).shape == (2, 8)


def crash_at(monkeypatch, step, error=KeyboardInterrupt):
    """Make ``save`` raise ``error`` when it finishes ``step``."""
    from rewriter.runtime import artifact

    def hook(name):
        if name == step:
            raise error
    monkeypatch.setattr(artifact, "SAVE_STEP_HOOKS", [hook])


def test_interrupted_save_leaves_nothing_that_loads(saved, tmp_path, monkeypatch):
    opt, _ = saved
    crash_at(monkeypatch, "wrote weights.safetensors")
    with pytest.raises(KeyboardInterrupt):
        opt.save(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []  # no artifact, no half-written version directory


def test_interrupted_overwrite_keeps_the_old_artifact(copy, saved, monkeypatch):
    opt, _ = saved
    before = sorted(p.name for p in copy.iterdir())
    crash_at(monkeypatch, "wrote ir.json", ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        opt.save(copy)
    assert sorted(p.name for p in copy.parent.iterdir()) == ["copy"]
    assert sorted(p.name for p in copy.iterdir()) == before
    assert rewriter.load(copy).generate(IDS, max_new_tokens=2).shape == (2, 8)


def test_save_refuses_to_replace_other_directories(saved, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="is not a rewriter artifact"):
        saved[0].save(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def edit_ir(path, edit):
    ir = artifact_files(path)["ir.json"]
    data = json.loads(ir.read_text())
    edit(data)
    ir.write_text(json.dumps(data))
    reseal(path)


def test_a_node_name_that_is_code_is_refused(copy, capsys):
    """torch.fx writes placeholder names into the forward() it generates."""
    def inject(data):
        last = [n for n in data["graph"] if n["op"] == "placeholder"][-1]
        evil = 'positions=print("INJECTED")'
        for n in data["graph"]:  # rename it and every reference to it
            text = json.dumps(n).replace(f'{{"node": "{last["name"]}"}}', json.dumps({"node": evil}))
            n.clear()
            n.update(json.loads(text))
        last["name"] = evil
    edit_ir(copy, inject)
    with pytest.raises(ArtifactError, match="ir.json: bad node name"):
        rewriter.load(copy)
    assert "INJECTED" not in capsys.readouterr().out


def test_a_weight_name_that_is_code_is_refused(copy):
    evil = 'w", None) or print("INJECTED") or getattr(self, "y'
    def inject(data):
        node = next(n for n in data["graph"] if n["op"] == "get_attr")
        data["weights"][evil] = data["weights"][node["target"]]
        node["target"] = evil
    edit_ir(copy, inject)
    with pytest.raises(ArtifactError, match="ir.json: .*bad weight name"):
        rewriter.load(copy)


def test_the_tokenizer_cannot_point_outside_the_artifact(copy):
    rewrite_manifest(copy, lambda m: m.__setitem__("tokenizer", "/etc/hostname"))
    with pytest.raises(ArtifactError, match="tokenizer must be the listed tokenizer.json"):
        rewriter.load(copy)


def test_file_reading_aten_ops_are_not_known_ops(copy):
    def inject(data):
        next(n for n in data["graph"] if n["op"] == "call_function")["target"] = "aten.from_file.default"
    edit_ir(copy, inject)
    with pytest.raises(ArtifactError, match="unknown op 'aten.from_file.default'"):
        rewriter.load(copy)


def test_a_generic_module_round_trips(tmp_path):
    """Not a causal LM: ATen ops and broadcast parameters, called with its one input."""
    from test_codegen_pointwise import RowReductions
    model = RowReductions(12)
    x = torch.randn(2, 3, 12)
    opt = rewriter.optimize(model, example_inputs=(x,))
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    y = torch.randn(4, 5, 12)  # other sizes than traced
    for got, want in zip(loaded(y), opt(y)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------- the manifest is covered

def write_manifest_text(path, edit):
    """Edit the manifest's text, leaving every checksum as it was."""
    manifest = artifact_files(path)["manifest.json"]
    manifest.write_text(edit(manifest.read_text()))


def set_ir_checksum(text):
    m = json.loads(text)
    m["files"]["ir.json"]["sha256"] = "0" * 64
    return json.dumps(m, indent=1)


@pytest.mark.parametrize("edit", [
    lambda t: t.replace('"layers": [\n     1\n    ]', '"layers": []'),  # the issue's: pass list
    set_ir_checksum,  # the issue's: a file's checksum
    lambda t: t + "\n",  # whitespace only
    lambda t: t.replace('"backend": "torch"', '"backend": "triton"'),
    lambda t: t.replace('"family": "llama"', '"family": "gpt2"'),
], ids=["pass_list", "checksum", "whitespace", "backend", "family"])
def test_an_edited_manifest_is_reported_as_an_edit_of_the_manifest(copy, edit):
    before = artifact_files(copy)["manifest.json"].read_text()
    write_manifest_text(copy, edit)
    assert artifact_files(copy)["manifest.json"].read_text() != before
    with pytest.raises(ArtifactError, match=r"manifest\.json: changed since it was saved") as info:
        rewriter.load(copy)
    assert "ir.json" not in str(info.value)
    with pytest.raises(ArtifactError, match=r"manifest\.json: changed since it was saved"):
        read_manifest(copy)  # what `rewriter info` shows


def test_another_artifacts_manifest_is_refused(copy, tmp_path):
    other = rewriter.optimize(make_model("llama-gqa-3l", initializer_range=0.2))
    other.save(tmp_path / "other")
    shutil.copy(artifact_files(tmp_path / "other")["manifest.json"], artifact_files(copy)["manifest.json"])
    with pytest.raises(ArtifactError, match=r"manifest\.json: changed since it was saved"):
        rewriter.load(copy)


def edit_pointer(path, key, value):
    pointer = json.loads((path / "artifact.json").read_text())
    pointer[key] = value
    (path / "artifact.json").write_text(json.dumps(pointer))


@pytest.mark.parametrize("key, value, match", [
    ("manifest_sha256", "0" * 64, r"manifest\.json: changed since it was saved"),
    ("manifest_sha256", "not hex", r"artifact\.json: manifest_sha256 must be 64 hex digits"),
    ("manifest_sha256", None, r"artifact\.json: manifest_sha256 must be 64 hex digits"),
    ("version_dir", "../copy", r"artifact\.json: version_dir must be 'v-' and 16 hex digits"),
    ("version_dir", "/etc", r"artifact\.json: version_dir must be"),
    ("version_dir", "v-0123", r"artifact\.json: version_dir must be"),
    ("version_dir", ["v-0123456789abcdef"], r"artifact\.json: version_dir must be"),
    ("version_dir", "v-0123456789abcdef", r"v-0123456789abcdef: missing or not a directory"),
    ("format_version", 99, r"artifact\.json: format version 99 is not supported"),
    ("format_version", True, r"artifact\.json: format version True is not supported"),
    ("format_version", 2.0, r"artifact\.json: format version 2.0 is not supported"),
    ("format", "something-else", r"artifact\.json: not a rewriter artifact"),
])
def test_a_bad_pointer_is_named(copy, key, value, match):
    edit_pointer(copy, key, value)
    with pytest.raises(ArtifactError, match=match):
        rewriter.load(copy)


@pytest.mark.parametrize("text", [b"[" * 100000 + b"]" * 100000, b"\xff\xfe not utf-8", b"[1, 2]",
                                  b'{"format": ', b""], ids=["nested", "not_utf8", "list", "cut", "empty"])
@pytest.mark.parametrize("which", ["artifact.json", "manifest.json"])
def test_an_unreadable_pointer_or_manifest_is_named(copy, which, text):
    artifact_files(copy)[which].write_bytes(text)
    reseal(copy)  # the manifest's checksum agrees: its content must still be refused
    with pytest.raises(ArtifactError, match=rf"{which.replace('.', '[.]')}: (unreadable JSON|expected a JSON object)"):
        rewriter.load(copy)


def set_key(m, path, value):
    *outer, last = path
    for k in outer:
        m = m[k]
    m[last] = value


@pytest.mark.parametrize("path, value, match", [
    (["files", "ir.json"], "0" * 64, "'files' must be"),
    (["files", "ir.json", "bytes"], "123", "'files' must be"),
    (["files", "ir.json", "bytes"], True, "'files' must be"),
    (["files", "ir.json", "sha256"], 12, "'files' must be"),
    (["files"], [], "'files' must be"),
    (["passes"], {"name": "LayerSkip"}, "'passes' must be"),
    (["passes", 0, "params"], None, "'passes' must be"),
    (["model", "layers"], "2", "'model' must be"),
    (["model"], None, "'model' must be"),
    (["tokenizer"], 5, "'tokenizer' must be"),
    (["backend"], None, "'backend' must be"),
    (["versions"], ["2.13"], "'versions' must be"),
    (["created"], 0, "'created' must be"),
    (["format_version"], "2", "format version '2' is not supported"),
    (["model", "parameters"], 10 ** 400, "'model' must be"),
    (["model", "layers"], -1, "'model' must be"),
    (["files", "ir.json", "bytes"], 2 ** 64, "'files' must be"),
])
def test_a_manifest_field_of_the_wrong_type_is_named(copy, path, value, match):
    manifest = artifact_files(copy)["manifest.json"]
    m = json.loads(manifest.read_text())
    set_key(m, path, value)
    manifest.write_text(json.dumps(m))
    reseal(copy, entries=False)
    with pytest.raises(ArtifactError, match=r"manifest\.json: " + match):
        rewriter.load(copy)
    from rewriter.cli import main
    assert main(["info", str(copy)]) == 2  # rewriter info reads the same checked manifest


@pytest.mark.parametrize("key", ["files", "passes", "model", "backend", "tokenizer"])
def test_a_manifest_without_a_field_is_named(copy, key):
    rewrite_manifest(copy, lambda m: m.pop(key))
    with pytest.raises(ArtifactError, match=rf"manifest\.json: has no '{key}'"):
        rewriter.load(copy)


def test_artifact_files_that_are_symlinks_are_refused(copy, tmp_path):
    """Same bytes, same checksums, but read through a link: refused."""
    files = artifact_files(copy)
    outside = tmp_path / "weights.safetensors"
    shutil.move(files["weights.safetensors"], outside)
    files["weights.safetensors"].symlink_to(outside)
    with pytest.raises(ArtifactError, match=r"weights\.safetensors: is a symbolic link"):
        rewriter.load(copy)


def test_a_version_directory_that_is_a_symlink_is_refused(copy, tmp_path):
    v = artifact_files(copy)["manifest.json"].parent
    shutil.move(v, tmp_path / "elsewhere")
    v.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ArtifactError, match=rf"{v.name}: missing or not a directory"):
        rewriter.load(copy)


# ---------------------------------------------------------------- only the format's own files

@pytest.mark.parametrize("name", [
    "evil.sh",             # the issue's: a top-level file outside the format, present, hashed
    "kernels/x",           # the issue's: a kernel that is not a .py module
    "kernels/setup.sh",
    "kernels/my-kernel.py",  # .py, but not a module name
    "kernels.py",
])
def test_a_listed_file_outside_the_format_is_refused(copy, name):
    v = artifact_files(copy)["manifest.json"].parent
    (v / name).parent.mkdir(exist_ok=True)
    (v / name).write_text("#!/bin/sh\nrm -rf ~\n")
    rewrite_manifest(copy, lambda m: m["files"].__setitem__(name, {"bytes": 0, "sha256": "0" * 64}))
    for read in (rewriter.load, read_manifest):
        with pytest.raises(ArtifactError, match=rf"manifest\.json: .*{re.escape(name)!s}"):
            read(copy)


def test_a_triton_artifact_where_triton_cannot_run_is_an_artifact_error(copy, monkeypatch):
    rewrite_manifest(copy, lambda m: m.__setitem__("backend", "triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ArtifactError, match=r"load\(\.\.\., backend='torch'\) runs it anyway"):
        rewriter.load(copy)
    assert rewriter.load(copy, backend="torch").backend == "torch"  # the hint works


def test_a_path_under_the_home_directory_is_expanded(saved, tmp_path, monkeypatch):
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "cwd")
    saved[0].save("~/models/x")
    assert os.listdir(tmp_path / "cwd") == []  # no literal ./~/models/x
    assert is_artifact(tmp_path / "home" / "models" / "x")
    assert str(rewriter.load("~/models/x").ir) == str(saved[0].ir)
    assert read_manifest("~/models/x")["backend"] == "torch"
