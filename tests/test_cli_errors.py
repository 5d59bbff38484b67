"""Every failure a user can cause at the command line is one line on stderr,
``rewriter: error: ...``, and exit status 2: never a traceback, never a usage block, and
for ``run`` nothing on stdout (not even the prompt) before the inputs are checked.

The table runs in-process through ``main(argv)``; the end-to-end cases (a closed pipe,
real stderr) run ``python -m rewriter`` in a subprocess."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import rewriter
from artifact_tools import artifact_files
from rewriter.cli import main
from test_checkpoints import tiny_llama


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Good and broken inputs, by name (see ``BAD`` for what each one is)."""
    root = tmp_path_factory.mktemp("cli_errors")
    good = root / "ckpt"
    tiny_llama().save_pretrained(good)
    shutil.copy(rewriter.models.checkpoints.DEFAULT_MODEL_DIR / "tokenizer.json", good)
    p = {"ckpt": good, "file": root / "a_file.txt", "empty_dir": root / "empty"}
    p["file"].write_text("not a model")
    p["empty_dir"].mkdir()

    def broken(name, damage):
        d = root / name
        shutil.copytree(good, d)
        damage(d)
        p[name] = d

    def config(**changes):
        def edit(d):
            c = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**c, **changes}))
        return edit

    def pickled(d):
        (d / "model.safetensors").unlink()
        torch.save(load_file(good / "model.safetensors"), d / "pytorch_model.bin")

    def truncated(d):
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 3])

    def stray_tensor(d):
        w = load_file(d / "model.safetensors")
        save_file({**w, "extra": torch.zeros(1)}, d / "model.safetensors", metadata={"format": "pt"})

    broken("more_layers", config(num_hidden_layers=4))
    broken("mismatched", config(intermediate_size=48))
    broken("stray_tensor", stray_tensor)
    broken("pickled", pickled)
    broken("truncated", truncated)
    broken("bad_tokenizer", lambda d: (d / "tokenizer.json").write_text("{not json"))
    broken("bad_config", lambda d: (d / "config.json").write_text("{not json"))
    broken("unknown_type", config(model_type="no-such-model"))
    broken("bad_heads", config(num_attention_heads=5))
    broken("negative_vocab", config(vocab_size=-5))
    p["artifact"] = root / "artifact"
    assert main(["optimize", str(good), "--out", str(p["artifact"])]) == 0
    p["corrupt_artifact"] = root / "corrupt_artifact"
    shutil.copytree(p["artifact"], p["corrupt_artifact"])
    with open(artifact_files(p["corrupt_artifact"])["weights.safetensors"], "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    return p


def out_in(name, *rest):
    return lambda p, tmp: str(p[name] / "/".join(rest)) if rest else str(p[name])


A = "{artifact}"
# (argv with {name} for a path of the ``paths`` fixture and {tmp} for a fresh directory,
#  a fragment the error line must hold)
BAD = [
    # optimize: checkpoints
    ("optimize {tmp}/missing --out {tmp}/o", "no such checkpoint directory"),
    ("optimize {file} --out {tmp}/o", "not a directory"),
    ("optimize {empty_dir} --out {tmp}/o", "no config.json"),
    ("optimize {more_layers} --out {tmp}/o", "missing from the checkpoint: model.layers.2."),
    ("optimize {mismatched} --out {tmp}/o", "shaped unlike config.json"),
    ("optimize {stray_tensor} --out {tmp}/o", "in the checkpoint but not in the model: extra"),
    ("optimize {pickled} --out {tmp}/o", "pytorch_model.bin: pickled weights are refused"),
    ("optimize {truncated} --out {tmp}/o", "model.safetensors: not a valid safetensors file"),
    ("optimize {bad_tokenizer} --out {tmp}/o", "tokenizer.json: not a valid tokenizer file"),
    ("optimize {bad_config} --out {tmp}/o", "config.json: not valid JSON"),
    ("optimize {unknown_type} --out {tmp}/o", "model_type 'no-such-model'"),
    ("optimize {bad_heads} --out {tmp}/o", "config.json: not a valid llama config"),
    ("optimize {negative_vocab} --out {tmp}/o", "negative dimension"),
    # optimize: where it writes
    ("optimize {ckpt} --out {file}/o", "is a file, not a directory"),
    ("optimize {ckpt} --out {file}", "exists and is not a directory"),
    ("optimize {ckpt} --out ''", "--out must name a directory, got ''"),
    ("optimize {ckpt} --out {tmp}/o --dump {file}/d", "--dump"),
    # optimize: passes and arguments
    ("optimize {ckpt} --pass layer_skip:speedup=1.5,speedup=2 --out {tmp}/o", "'speedup' is given twice"),
    ("optimize {ckpt} --pass layer_skip:speedup=NaN --out {tmp}/o", "speedup must be a finite number"),
    ("optimize {ckpt} --pass layer_skip:layers=[1.0] --out {tmp}/o", "got 1.0"),
    ("optimize {ckpt} --pass fuse_qkv:x=1 --out {tmp}/o", "unknown parameter 'x'"),
    ("optimize {ckpt} --pass no_such_pass --out {tmp}/o", "unknown pass 'no_such_pass'"),
    ("optimize {ckpt} --pass layer_skip:layers=[7] --out {tmp}/o", "layer 7 is out of range"),
    ("optimize {ckpt} --backend tpu --out {tmp}/o", "invalid choice: 'tpu'"),
    ("optimize {ckpt}", "the following arguments are required: --out"),
    ("", "the following arguments are required: COMMAND"),
    ("compile {ckpt}", "invalid choice: 'compile'"),
    # run: sampling parameters (checked before the model loads)
    ("run {ckpt} --ids 1,2 --top-k nan", "argument --top-k: invalid int value: 'nan'"),
    ("run {ckpt} --ids 1,2 --top-k 2.5", "argument --top-k: invalid int value: '2.5'"),
    ("run {ckpt} --ids 1,2 --top-k -1", "top_k must be >= 0"),
    ("run {ckpt} --ids 1,2 --do-sample --temperature nan", "temperature must be finite"),
    ("run {ckpt} --ids 1,2 --temperature inf", "temperature must be finite"),
    ("run {ckpt} --ids 1,2 --do-sample --temperature -1", "temperature must be > 0"),
    ("run {ckpt} --ids 1,2 --do-sample --top-p nan", "top_p must be finite"),
    ("run {ckpt} --ids 1,2 --do-sample --top-p 1.5", "top_p must be in (0, 1]"),
    ("run {ckpt} --ids 1,2 --max-new-tokens 0", "max_new_tokens must be >= 1"),
    ("run {ckpt} --ids 1,2 --prefill-chunk 8", "prefill_chunk must be >= 16"),
    ("run {ckpt} --ids 1,2 --max-new-tokens 1e3", "invalid int value: '1e3'"),
    ("run {ckpt} --ids 1,2 --seed abc", "argument --seed: invalid int value"),
    ("run {ckpt} --ids 1,2 --do-sample --seed 100000000000000000000000", "seed must be <"),
    # run: prompts (checked before anything is printed)
    ("run {ckpt} --ids 1,x", "--ids must be comma-separated integers"),
    ("run {ckpt} --ids 1,,2", "--ids must be comma-separated integers"),
    ("run {ckpt} --ids 1.5", "--ids must be comma-separated integers"),
    ("run {ckpt} --ids=-1,2", "--ids: token id -1 is not a non-negative"),
    ("run {artifact} --ids 1,64", "outside the vocabulary [0, 64): row 0 has 64"),
    ("run {artifact} --ids 1,99999999999999999999999", "--ids: token id 99999999999999999999999 is not"),
    ("run {artifact} --ids 1,2 --max-new-tokens 100", "exceeds the KV cache of 64 tokens"),
    ("run {artifact} --ids 1,2 --max-new-tokens 100 --no-stream", "exceeds the KV cache"),
    ("run {artifact} --ids ' '", "--ids must be comma-separated integers"),
    ("run {artifact} --ids 1 --prompt hi", "not allowed with argument"),
    ("run {artifact} --prompt \udcff", "--prompt is not valid UTF-8 text"),
    ("run {artifact}", "one of the arguments --prompt --chat --ids is required"),
    # run: models
    ("run {artifact} --ids 99999999999999999999999", "--ids: token id 99999999999999999999999"),
    ("run {artifact} --ids -3", "--ids: token id -3"),
    ("run {tmp}/missing --ids 1", "no such artifact or checkpoint"),
    ("run {file} --ids 1", "not a directory"),
    ("run {pickled} --ids 1", "pickled weights are refused"),
    ("run {truncated} --ids 1", "not a valid safetensors file"),
    ("run {more_layers} --ids 1", "missing from the checkpoint"),
    ("run {bad_tokenizer} --prompt hi", "not a valid tokenizer file"),
    ("run {corrupt_artifact} --ids 1", "weights.safetensors: checksum mismatch"),
    ("run {artifact} --ids 1 --backend tpu", "invalid choice: 'tpu'"),
    # ir and info
    ("ir {tmp}/missing", "missing"),
    ("ir {file}", "a_file.txt"),
    ("ir {ckpt}", "ckpt"),
    ("ir {corrupt_artifact}", "checksum mismatch"),
    ("info {tmp}/missing", "no such artifact directory"),
    ("info {file}", "a_file.txt"),
    ("info {empty_dir}", "empty"),
    ("info {artifact} --yaml", "unrecognized arguments: --yaml"),
]


def expand(argv: str, p: dict, tmp) -> list[str]:
    import shlex
    return [a.format(tmp=tmp, **p) for a in shlex.split(argv)]


@pytest.mark.parametrize("argv,fragment", BAD, ids=[a or "(none)" for a, _ in BAD])
def test_bad_input_is_one_error_line_and_status_2(paths, tmp_path, capsys, argv, fragment):
    assert main(expand(argv, paths, tmp_path)) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("rewriter: error: "), err
    assert fragment in err and "Traceback" not in err
    if argv.startswith("run"):
        assert out == ""  # nothing of a generation, not even the prompt
    assert not (tmp_path / "o").exists()  # optimize wrote nothing


def test_an_unwritable_out_is_one_line(paths, tmp_path, capsys, monkeypatch):
    """A read-only directory (simulated: the tests may run as root, who writes anywhere)."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "o"))
    monkeypatch.setattr(rewriter.OptimizedModel, "save", refuse)
    assert main(["optimize", str(paths["ckpt"]), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"rewriter: error: {tmp_path / 'o'}: Permission denied\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_a_read_only_directory_is_refused_before_tracing(paths, tmp_path, capsys):
    tmp_path.chmod(0o555)
    try:
        assert main(["optimize", str(paths["ckpt"]), "--out", str(tmp_path / "o")]) == 2
    finally:
        tmp_path.chmod(0o755)
    assert "permission denied" in capsys.readouterr().err


def test_good_input_still_works(paths, capsys):
    assert main(["run", str(paths["artifact"]), "--ids", "1,2", "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and len(out) > 1 and err == ""


# ------------------------------------------------------------------ end to end

def cli(*argv, stdout=subprocess.PIPE):
    return subprocess.run([sys.executable, "-m", "rewriter", *map(str, argv)], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120)


@pytest.mark.parametrize("command", ["run", "ir"])
def test_a_closed_stdout_is_one_error_line(paths, command):
    """``rewriter run ... | head -c1``: the reader has gone; one line says so, no traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    try:
        argv = [command, paths["artifact"]] + (["--ids", "1,2", "--max-new-tokens", "3"] if command == "run" else [])
        r = cli(*argv, stdout=write)
    finally:
        os.close(write)
    assert r.returncode == 2
    assert r.stderr == "rewriter: error: stdout was closed before the output was complete (broken pipe)\n"


def test_real_stderr_is_one_line(paths):
    """No log line from transformers, no warning, no progress bar around the error."""
    for argv in (["optimize", paths["more_layers"], "--out", paths["ckpt"].parent / "x"],
                 ["run", paths["negative_vocab"], "--ids", "1"],  # transformers warns here
                 ["run", paths["ckpt"], "--ids", "1", "--top-k", "nan"]):
        r = cli(*argv)
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("rewriter: error: "), r.stderr
