"""The training commands (``train-heads``, ``train-gates``) fail as the rest of the CLI
does: one ``rewriter: error:`` line, status 2, nothing written. A device, an output path,
a work directory or a gates setting that cannot be used is refused before the model loads
(``--out``'s missing directories are made, and removed again if the run fails); a model
without a tokenizer before any data is made; a full disk names the file and leaves the
old one. The files they keep (data caches, checkpoints, the heads and gates files) are
written under a temporary name and renamed, and a torn cache or checkpoint (what a kill
during an in-place write left) is made again with a one-line warning.

Fast: one traced engine for the whole file, four prompts (three held out) of eight
tokens, the cached data of one run copied for the others."""
import errno
import functools
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import rewriter
from rewriter.drafts import heads as heads_file
from rewriter.files import safe_files, tensor_files
from rewriter.training import generation, prompts
from rewriter.training import train_heads as th
from rewriter.cli import main
from test_checkpoints import tiny_llama

# one worker: its module fixtures are built once under --dist loadgroup
pytestmark = pytest.mark.xdist_group("train_cli_errors")

HEADS = ["train-heads", "default", "--num-heads", "1", "--prompts", "4", "--new-tokens", "8",
         "--epochs", "1", "--dtype", "float32", "--batch", "4"]
GATES = ["train-gates", "default", "--steps", "1", "--lengths", "96", "--sinks", "4",
         "--window", "8"]
NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"
CREATE_FILE = safe_files.create_file


@pytest.fixture(scope="module")
def engine():
    """The default model traced once: every run of this file generates with it (the
    model is the same whichever call loads it)."""
    return rewriter.optimize(rewriter.default_model()[0])


@pytest.fixture(scope="module", autouse=True)
def fast(engine):
    """Every heads run of this file generates with one engine and holds out three prompts
    (the CLI's 48 take most of a run's time)."""
    with pytest.MonkeyPatch.context() as mp:
        for module in (generation, prompts):  # continuing prompts; asking questions
            mp.setattr(module, "engine_of", lambda model: engine)
        mp.setattr(th, "train_heads", functools.partial(th.train_heads, heldout_prompts=3))
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run: ``h.safetensors`` and its work directory (the data caches of
    ``HEADS``' settings and the last checkpoint), to copy."""
    root = tmp_path_factory.mktemp("trained")
    assert main(HEADS + ["--out", str(root / "h.safetensors"), "--work-dir",
                         str(root / "work")]) == 0
    return root


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Inputs that are not what the commands need, by name."""
    root = tmp_path_factory.mktemp("inputs")
    no_tokenizer = root / "no_tokenizer"
    tiny_llama().save_pretrained(no_tokenizer)  # config.json and weights, no tokenizer.json
    artifact = root / "artifact"
    artifact.mkdir()
    (artifact / "artifact.json").write_text(json.dumps({"format": "rewriter-artifact",
                                                        "format_version": 2}))
    return {"no_tokenizer": no_tokenizer, "artifact": artifact}


def listing(root) -> dict:
    """Every entry under ``root``: its kind, size and modification time (links not followed)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(folder, name))
            out[os.path.relpath(os.path.join(folder, name), root)] = (st.st_mode, st.st_size,
                                                                      st.st_mtime_ns)
    return out


def one_error_line(capsys, *fragments) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rewriter: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


def fill_disk(monkeypatch, names, after: int = 0):
    """Files whose final name is in ``names`` meet a full disk after ``after`` bytes (the
    temporary file they are written to is left to ``create_file``'s clean-up)."""
    real = CREATE_FILE

    def create(name, data, dir_fd, mode=0o666):
        m = safe_files.TEMP_NAME.fullmatch(name)
        if m is None or m["name"] not in names:
            return real(name, data, dir_fd, mode)

        class Full:  # the file as the writer sees it: full after ``after`` bytes
            def __init__(self, f):
                self.f, self.n = f, 0

            def write(self, b):
                self.n += memoryview(b).nbytes
                if self.n > after:
                    raise OSError(errno.ENOSPC, NO_SPACE)
                return self.f.write(b)
        return real(name, lambda f: data(Full(f)) if callable(data) else Full(f).write(data),
                    dir_fd, mode)
    monkeypatch.setattr(safe_files, "create_file", create)


# ------------------------------------------------------------------ refused before any work

def _link(tmp):
    (tmp / "elsewhere.safetensors").write_bytes(b"someone's file")
    os.symlink(tmp / "elsewhere.safetensors", tmp / "link")
    return tmp / "link"


def _file(tmp):
    (tmp / "notes.txt").write_text("a file that is not a heads or gates file")
    return tmp / "notes.txt"


def _dir(tmp):
    (tmp / "d").mkdir()
    return tmp / "d"


# (command, extra argv with {out} and {tmp}, a fragment of the error line, a setup that
#  makes the paths; every row fails before the model loads)
EARLY = [
    *[(cmd, f"--out {{tmp}}/o --device {dev}", frag) for cmd in ("heads", "gates")
      for dev, frag in (("cuda:4096", "'cuda:4096': no such CUDA device"),
                        ("mps", "'mps': training runs on cpu or cuda"),
                        ("foo", "'foo' is not a device"), ("cuda:-1", "'cuda:-1' is not a device"),
                        ("''", "'' is not a device"))],
    ("heads", "--out {tmp}/d", "out {tmp}/d is a directory"),
    ("gates", "--out {tmp}/d", "out {tmp}/d is a directory"),
    ("heads", "--out ''", "out must name a heads file, got ''"),
    ("gates", "--out ''", "out must name a gates file, got ''"),
    ("heads", "--out {tmp}/link", "{tmp}/link is a symbolic link"),
    ("gates", "--out {tmp}/link", "{tmp}/link is a symbolic link"),
    ("heads", "--out /dev/null", "/dev/null is not a regular file"),
    ("gates", "--out /dev/null", "/dev/null is not a regular file"),
    ("heads", "--out {tmp}/notes.txt", "notes.txt exists and is not a heads file"),
    ("gates", "--out {tmp}/notes.txt", "notes.txt exists and is not a gates file"),
    ("heads", "--out {tmp}/notes.txt/h.safetensors", "notes.txt is a file, not a directory"),
    ("gates", "--out {tmp}/missing/g.json", "missing is not an existing directory"),
    ("heads", "--out {tmp}/h.safetensors --work-dir {tmp}/notes.txt",
     "work directory {tmp}/notes.txt exists and is not a directory"),
    ("heads", "--out {tmp}/h.safetensors --work-dir ''", "work_dir must name a directory"),
    ("heads", "--out {tmp}/h.safetensors --work-dir {tmp}/h.safetensors",
     "work_dir and out both name {tmp}/h.safetensors"),
    ("gates", "--out {tmp}/g.json", "g.json.work (the checkpoint directory) is not a directory"),
    # settings that need no model: refused before it loads and is traced
    ("gates", "--out {tmp}/o --lengths 10", "lengths must be token counts of at least 64"),
    ("gates", "--out {tmp}/o --lengths 96 63", "lengths must be token counts of at least 64"),
    ("gates", "--out {tmp}/o --steps 0", "steps must be an integer >= 1, got 0"),
    ("gates", "--out {tmp}/o --sinks -1", "sinks must be an integer >= 0, got -1"),
    ("gates", "--out {tmp}/o --window 0", "window must be an integer >= 1, got 0"),
    ("gates", "--out {tmp}/o --lr nan", "lr must be a finite number >= 0, got nan"),
    ("gates", "--out {tmp}/o --reg=-inf", "reg must be a finite number >= 0, got -inf"),
    ("gates", "--out {tmp}/o --sinks 2147483647",
     "sinks + window = 2147483655 must be below the shortest length 96"),
    ("gates", "--out {tmp}/o --lengths 512 128 --sinks 64 --window 64",
     "sinks + window = 128 must be below the shortest length 128"),
]


@pytest.mark.parametrize("command,argv,fragment", EARLY,
                         ids=[f"{c} {a}" for c, a, _ in EARLY])
def test_refused_before_the_model_loads(command, argv, fragment, tmp_path, capsys, monkeypatch):
    import shlex
    _link(tmp_path), _file(tmp_path), _dir(tmp_path)
    (tmp_path / "g.json.work").write_text("a file where the checkpoints would go")
    before = listing(tmp_path)

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(rewriter.models.checkpoints, "load_model", loaded)
    base = HEADS if command == "heads" else GATES
    assert main(base + shlex.split(argv.format(tmp=tmp_path))) == 2
    one_error_line(capsys, fragment.format(tmp=tmp_path))
    assert listing(tmp_path) == before  # nothing written, the file and the link's target unchanged


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["heads", "gates"])
def test_cuda_on_a_machine_without_it(command, tmp_path, capsys):
    base = HEADS if command == "heads" else GATES
    assert main(base + ["--out", str(tmp_path / "o"), "--device", "cuda"]) == 2
    one_error_line(capsys, "--device 'cuda': no such CUDA device on this machine (none)")
    assert listing(tmp_path) == {}


@pytest.mark.parametrize("command", ["heads", "gates"])
def test_a_directory_closed_to_us_is_refused_before_the_model_loads(command, tmp_path, capsys,
                                                                     monkeypatch):
    """Simulated (root writes anywhere): ``os.access`` says no for ``tmp_path``."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(tmp_path)
                        else real(p, mode, **kw))
    base = HEADS if command == "heads" else GATES
    assert main(base + ["--out", str(tmp_path / "o")]) == 2
    one_error_line(capsys, f"cannot write in {tmp_path} (permission denied)")
    assert listing(tmp_path) == {}


LOADED = [
    ("heads", "{no_tokenizer} --out {tmp}/h.safetensors", "has no tokenizer (tokenizer.json)"),
    ("gates", "{no_tokenizer} --out {tmp}/g.json --lengths 64", "has no tokenizer (tokenizer.json)"),
    ("heads", "{artifact} --out {tmp}/h.safetensors", "is an artifact; training needs the checkpoint"),
    ("gates", "{artifact} --out {tmp}/g.json", "is an artifact; training needs the checkpoint"),
    ("heads", "default --out {tmp}/h.safetensors --seed 4294967296", "seed must be an int in [0, 2**32)"),
    ("heads", "default --out {tmp}/h.safetensors --seed -1", "seed must be an int in [0, 2**32)"),
    ("heads", "default --out {tmp}/h.safetensors --new-tokens 2000",
     "prompt_tokens + new_tokens = 2064 exceeds the model's context of 1024 tokens"),
    ("heads", "default --out {tmp}/h.safetensors --init ''", "init must be a heads file's path"),
    ("heads", "default --out {tmp}/h.safetensors --init ' '", "init must be a heads file's path"),
    ("heads", "default --out {tmp}/h.safetensors --epochs 0", "epochs must be an int >= 1"),
]


@pytest.mark.parametrize("command,argv,fragment", LOADED, ids=[f"{c} {a}" for c, a, _ in LOADED])
def test_refused_before_any_data_is_made(command, argv, fragment, inputs, tmp_path, capsys):
    """Models the commands cannot train on, and settings checked with the model: refused
    before a prompt is made or a directory created."""
    import shlex
    base = (HEADS if command == "heads" else GATES)[:1] + (HEADS if command == "heads" else GATES)[2:]
    assert main(base + shlex.split(argv.format(tmp=tmp_path, **inputs))) == 2
    one_error_line(capsys, fragment)
    assert listing(tmp_path) == {}


class BytesPath(os.PathLike):
    """A path object whose path is bytes: ``Path()`` of it raises a raw TypeError."""

    def __fspath__(self):
        return b"/tmp/h.safetensors"


@pytest.mark.parametrize("where", ["heads out", "heads work_dir", "heads init", "gates out"])
def test_a_path_that_is_not_text_is_a_value_error(where, tmp_path, engine):
    """The API's paths: a ``str`` or ``os.PathLike`` of one, else a ``ValueError`` naming
    the parameter (each is checked once, before any work)."""
    from rewriter.training.train_gates import train_gates
    model, tokenizer = rewriter.default_model()
    out, name = str(tmp_path / "h.safetensors"), where.split()[1]
    with pytest.raises(ValueError, match=f"(train_heads|train_gates): {name} must "):
        if where == "gates out":
            train_gates(engine, tokenizer, BytesPath())
        else:
            th.train_heads(model, tokenizer, **{"out": out, name: BytesPath()}, num_heads=1)
    assert listing(tmp_path) == {}


# ------------------------------------------------------------------ torn files, full disks

def _copy(trained, tmp_path):
    shutil.copytree(trained / "work", tmp_path / "work")
    return tmp_path / "work"


def test_a_torn_data_cache_is_made_again_with_a_warning(trained, tmp_path, capsys):
    """What a kill during the old in-place write left: the first half of train.safetensors.
    The next run says so in one line, makes the cache again (the same tensors) and the
    same heads; a temporary file a killed write left is deleted."""
    work = _copy(trained, tmp_path)
    cache = work / "train.safetensors"
    whole = {k: t.clone() for k, t in load_file(cache).items()}  # not the file's memory map
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])  # cut short in place
    (work / "checkpoint.safetensors").unlink()  # trained again, from the remade data
    (work / ".train.safetensors.0123abcd.tmp").write_bytes(b"half of a killed write")
    capsys.readouterr()
    assert main(HEADS + ["--out", str(tmp_path / "h.safetensors"), "--work-dir", str(work)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"rewriter: warning: {cache}: the train data "
                                                   f"cache is unreadable"), err
    again = load_file(cache)
    assert again.keys() == whole.keys() and all(torch.equal(again[k], whole[k]) for k in whole)
    a, b = heads_file.load(trained / "h.safetensors"), heads_file.load(tmp_path / "h.safetensors")
    assert torch.equal(a.w, b.w) and torch.equal(a.b, b.b)
    assert not any(name.endswith(".tmp") for name in os.listdir(work))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong shapes"])
def test_a_torn_checkpoint_is_trained_again_with_a_warning(damage, trained, tmp_path, capsys):
    work = _copy(trained, tmp_path)
    ckpt = work / "checkpoint.safetensors"
    if damage == "garbage":
        ckpt.write_bytes(b"\x08" + b"\x00" * 7 + b"not json")
    elif damage == "truncated":
        ckpt.write_bytes(ckpt.read_bytes()[:-5])
    else:  # whole, of this run's settings, but not what the run trains
        with safe_open(str(ckpt), framework="pt") as f:
            meta, state = f.metadata(), {k: f.get_tensor(k).clone() for k in f.keys()}
        save_file({**state, "p0": torch.zeros(3)}, str(ckpt), metadata=meta)
    capsys.readouterr()
    assert main(HEADS + ["--out", str(tmp_path / "h.safetensors"), "--work-dir", str(work)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"rewriter: warning: {ckpt}: the training "
                                                   f"checkpoint is "), err
    a, b = heads_file.load(trained / "h.safetensors"), heads_file.load(tmp_path / "h.safetensors")
    assert torch.equal(a.w, b.w) and torch.equal(a.b, b.b)  # trained from the start again
    assert load_file(ckpt)["p0"].shape == a.w.shape  # and checkpointed whole


def test_a_full_disk_while_the_cache_is_written_leaves_the_old_cache(trained, tmp_path, capsys,
                                                                      monkeypatch):
    """Five prompts instead of four: the cache is made again, and the disk fills half-way
    through it. The old cache is still there, whole, and nothing else is left."""
    work = _copy(trained, tmp_path)
    cache = work / "train.safetensors"
    old = cache.read_bytes()
    fill_disk(monkeypatch, {"train.safetensors"}, after=len(old) // 2)
    before = listing(tmp_path)
    argv = HEADS + ["--out", str(tmp_path / "h.safetensors"), "--work-dir", str(work)]
    argv[argv.index("--prompts") + 1] = "5"
    assert main(argv) == 2
    one_error_line(capsys, f"rewriter: error: {cache}: {NO_SPACE}")
    assert cache.read_bytes() == old
    # no temporary file, no heads file; the generated rows are kept (a rerun resumes there)
    after = listing(tmp_path)
    assert {k: after[k] for k in after if k != "work" and "partial" not in k} == \
           {k: before[k] for k in before if k != "work"}


def test_a_work_directory_reached_through_a_link_is_used(trained, tmp_path, capsys):
    """A link the user made to a work directory elsewhere: followed (only the files
    written in it are never reached through a link)."""
    work = _copy(trained, tmp_path)
    os.symlink(work, tmp_path / "link")
    assert main(HEADS + ["--out", str(tmp_path / "h.safetensors"), "--work-dir",
                         str(tmp_path / "link")]) == 0
    assert capsys.readouterr().err == ""
    assert heads_file.load(tmp_path / "h.safetensors").num_heads == 1


def test_a_full_disk_at_the_heads_file_names_it_and_writes_nothing(trained, tmp_path, capsys,
                                                                   monkeypatch):
    work = _copy(trained, tmp_path)
    out = tmp_path / "h.safetensors"
    fill_disk(monkeypatch, {"h.safetensors"})
    before = listing(tmp_path)
    assert main(HEADS + ["--out", str(out), "--work-dir", str(work)]) == 2
    one_error_line(capsys, f"rewriter: error: {out}: {NO_SPACE}")
    assert listing(tmp_path) == before


def test_missing_parents_of_out_are_made_with_a_work_directory_elsewhere(trained, tmp_path,
                                                                          capsys):
    """``--out`` in directories that do not exist yet, the work directory elsewhere (which
    used to make them): made, as ``optimize --out`` makes them."""
    work = _copy(trained, tmp_path)
    out = tmp_path / "new" / "sub" / "h.safetensors"
    assert main(HEADS + ["--out", str(out), "--work-dir", str(work)]) == 0
    assert capsys.readouterr().err == ""
    assert heads_file.load(out).num_heads == 1


def test_a_failed_run_removes_the_parents_of_out_it_made(trained, tmp_path, capsys, monkeypatch):
    """The run fails at the heads file (a full disk): the directories it made for ``--out``
    are empty and removed again; the work directory, with its data, stays."""
    work = _copy(trained, tmp_path)
    out = tmp_path / "new" / "sub" / "h.safetensors"
    fill_disk(monkeypatch, {"h.safetensors"})
    before = listing(tmp_path)
    assert main(HEADS + ["--out", str(out), "--work-dir", str(work)]) == 2
    one_error_line(capsys, f"rewriter: error: {out}: {NO_SPACE}")
    assert listing(tmp_path) == before


def test_a_full_disk_at_the_gates_file_names_it_and_keeps_the_old_one(tmp_path, capsys,
                                                                      monkeypatch, engine):
    """The disk fills while the gates file is written (its checkpoint had room): the
    earlier gates file stays as it was, and no temporary file is left beside it."""
    monkeypatch.setattr(rewriter.api.optimized, "optimize", lambda model, **kw: engine)
    out = tmp_path / "g.json"
    out.write_text(json.dumps({"format": "rewriter-duo-gates", "earlier": True}))
    before = listing(tmp_path)
    fill_disk(monkeypatch, {"g.json"}, after=100)
    assert main(GATES + ["--out", str(out)]) == 2
    one_error_line(capsys, f"rewriter: error: {out}: {NO_SPACE}")
    assert json.loads(out.read_text())["earlier"] is True
    assert listing(tmp_path).keys() == before.keys() | {"g.json.work", "g.json.work/state.safetensors"}


def test_the_file_writer_round_trips_every_dtype_through_safetensors(tmp_path):
    """``tensor_files.save``'s files read back whole, in every dtype the caches hold."""
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(4, 7).to(torch.bfloat16)[:, ::2],
               "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 4), "i64": torch.arange(10),
               "bool": torch.tensor([True, False]), "f64": torch.randn(2, 2).double(),
               "f16": torch.randn(3).half(), "i32": torch.arange(6, dtype=torch.int32),
               "u8": torch.arange(5, dtype=torch.uint8)}
    tensor_files.save(tmp_path / "t.safetensors", tensors, {"settings": "k"})
    loaded = tensor_files.load(tmp_path / "t.safetensors", "test file")
    assert loaded is not None and loaded[1] == {"settings": "k"}
    assert all(loaded[0][k].dtype == t.dtype and torch.equal(loaded[0][k], t)
               for k, t in tensors.items())
    assert os.listdir(tmp_path) == ["t.safetensors"]
