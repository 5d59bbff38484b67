"""Saving, dumping and caching never lose or overwrite a user's files.

Each test hashes whole directory trees before and after: every file outside the target,
and every earlier artifact, must be byte-for-byte unchanged.

- ``save`` replaces only an artifact (known by its pointer's format marker), refuses
  anything else before writing (a web app's directory, a file, a symlink, a read-only
  directory), and a kill at *each* step of a save leaves the old or the new artifact.
- What interrupted saves leave behind is deleted by the next save, and nothing else is.
- Dumps and the kernel cache create their files exclusively, inside their directory.
"""
import hashlib
import json
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rewriter
from rewriter import ArtifactError, RewriterError
from rewriter.runtime import artifact
from rewriter.runtime.artifact_dir import is_artifact

# one worker: its module fixtures are built once under --dist loadgroup
pytestmark = pytest.mark.xdist_group("data_safety")

# The steps of a save without a tokenizer or kernels, in order (``SAVE_STEP_HOOKS``).
STEPS = ["locked", "removed leftovers", "created the version directory", "wrote ir.json",
         "wrote weights.safetensors", "wrote manifest.json", "wrote the new pointer",
         "swapped the pointer", "removed the old version"]
SWAP = STEPS.index("swapped the pointer")
NOBODY = 65534


def tiny(seed):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return rewriter.optimize(LlamaForCausalLM(config).eval(), passes=[])


@pytest.fixture(scope="module")
def old():
    return tiny(0)


@pytest.fixture(scope="module")
def new():
    return tiny(1)


def tree(root, skip=None) -> dict:
    """Every entry under ``root`` (links not followed, entries under ``skip`` left out):
    relative path -> kind, mode and content hash (or link target)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            if skip is not None and (p == skip or skip in p.parents):
                continue
            st = p.lstat()
            key = p.relative_to(root).as_posix()
            if stat.S_ISLNK(st.st_mode):
                out[key] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[key] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[key] = ("file", stat.S_IMODE(st.st_mode), hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def holds(path, engine) -> bool:
    """Whether the artifact at ``path`` loads as ``engine`` (same weights, same IR)."""
    loaded = rewriter.load(path)
    want = engine.ir.weights()
    return str(loaded.ir) == str(engine.ir) and all(
        torch.equal(t, want[name]) for name, t in loaded.ir.weights().items())


def version_dirs(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("v-"))


def assert_one_clean_artifact(path, engine):
    assert sorted(os.listdir(path)) == ["artifact.json"] + version_dirs(path)
    assert len(version_dirs(path)) == 1 and holds(path, engine)


def refused(engine, path, match):
    with pytest.raises(ArtifactError, match=match) as info:
        engine.save(path)
    assert str(path) in str(info.value)


# ---------------------------------------------------------------- not an artifact: refused

def web_app(d: Path) -> Path:
    """The issue's input: a web app's directory, with its own manifest.json."""
    (d / "static").mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"name": "My App", "start_url": "/",
                                                 "icons": [{"src": "icon.png"}]}))
    (d / "index.html").write_text("<html>my app</html>")
    (d / "static" / "app.js").write_text("console.log('mine')")
    return d


def not_artifacts(d: Path) -> dict:
    """Directories that hold something and are not rewriter artifacts, by name."""
    cases = {"web_app": web_app(d / "web_app")}
    cases["marker_without_version"] = d / "marker_without_version"
    cases["marker_without_version"].mkdir()
    (cases["marker_without_version"] / "manifest.json").write_text(
        json.dumps({"format": "rewriter-artifact", "format_version": "1", "files": {}}))
    cases["foreign_pointer_name"] = d / "foreign_pointer_name"
    cases["foreign_pointer_name"].mkdir()
    (cases["foreign_pointer_name"] / "artifact.json").write_text('{"name": "a build artifact"}')
    (cases["foreign_pointer_name"] / "build.log").write_text("ok")
    cases["pointer_not_json"] = d / "pointer_not_json"
    cases["pointer_not_json"].mkdir()
    (cases["pointer_not_json"] / "artifact.json").write_text("my notes, not JSON")
    cases["user_files_in_a_version_name"] = d / "user_files_in_a_version_name"
    (cases["user_files_in_a_version_name"] / "v-0123456789abcdef").mkdir(parents=True)
    (cases["user_files_in_a_version_name"] / "v-0123456789abcdef" / "thesis.tex").write_text("mine")
    for case in LOOKALIKES:
        lookalike(d / f"lookalike_{case}" / "v-0123456789abcdef", case, mine=d / "mine")
        cases[f"lookalike_{case}"] = d / f"lookalike_{case}"
    return cases


# What a user may keep under a version directory's or an old sibling's name: the names
# are the format's, the shapes are not (a save writes regular files, and .py kernels).
LOOKALIKES = {
    "kernels_thesis": "kernels/thesis.tex",  # the issue's
    "ir_json_directory": "ir.json/data",     # the issue's
    "kernels_subdirectory": "kernels/lib/util.py",
    "weights_link": "weights.safetensors",   # a link to the user's file
    "kernels_link": "kernels",               # a link to the user's directory of .py files
}


def lookalike(d: Path, case: str, mine: Path) -> None:
    """Make ``d`` hold the format's names in shapes a save never writes; its links point
    into ``mine`` (the user's directory, outside ``d``)."""
    rel = LOOKALIKES[case]
    mine.mkdir(parents=True, exist_ok=True)
    (mine / "notes.txt").write_text("mine")
    (mine / "util.py").write_text("x = 1")
    (d / rel).parent.mkdir(parents=True, exist_ok=True)
    if case == "weights_link":
        (d / rel).symlink_to(mine / "notes.txt")
    elif case == "kernels_link":
        (d / rel).symlink_to(mine)
    else:
        (d / rel).write_text("mine")


@pytest.mark.parametrize("case", ["web_app", "marker_without_version", "foreign_pointer_name",
                                  "pointer_not_json", "user_files_in_a_version_name",
                                  *(f"lookalike_{c}" for c in LOOKALIKES)])
def test_save_refuses_a_directory_that_is_not_an_artifact(old, tmp_path, case):
    path = not_artifacts(tmp_path)[case]
    before = tree(tmp_path)
    refused(old, path, "is not a rewriter artifact")
    assert tree(tmp_path) == before


def test_save_refuses_a_regular_file(old, tmp_path):
    (tmp_path / "model").write_text("a file with the name the user gave")
    before = tree(tmp_path)
    refused(old, tmp_path / "model", "is a file, not a directory")
    assert tree(tmp_path) == before


def test_save_writes_into_an_empty_directory_and_over_an_artifact(old, new, tmp_path):
    (tmp_path / "a").mkdir()
    old.save(tmp_path / "a")
    assert is_artifact(tmp_path / "a") and holds(tmp_path / "a", old)
    new.save(tmp_path / "a")
    assert_one_clean_artifact(tmp_path / "a", new)


def test_is_artifact_judges_by_content(old, tmp_path):
    old.save(tmp_path / "a")
    cases = not_artifacts(tmp_path / "others")
    assert is_artifact(tmp_path / "a")
    assert not any(is_artifact(p) for p in cases.values())
    assert not is_artifact(tmp_path / "missing") and not is_artifact(tmp_path / "a" / "artifact.json")


# ---------------------------------------------------------------- symlinks, files, permissions

def test_save_refuses_a_symlink_to_an_artifact(old, new, tmp_path):
    old.save(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    before = tree(tmp_path)
    refused(new, tmp_path / "link", "is a symbolic link")
    assert tree(tmp_path) == before and holds(tmp_path / "real", old)


@pytest.mark.parametrize("target", ["empty_dir", "dangling", "file"])
def test_save_refuses_other_symlinks(old, tmp_path, target):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "file").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / target)
    before = tree(tmp_path)
    refused(old, tmp_path / "link", "is a symbolic link")
    assert tree(tmp_path) == before


def test_save_refuses_a_symlinked_pointer(old, new, tmp_path):
    """A pointer that is a link (here to another artifact's) is not written through."""
    old.save(tmp_path / "a")
    old.save(tmp_path / "b")
    (tmp_path / "a" / "artifact.json").unlink()
    (tmp_path / "a" / "artifact.json").symlink_to(tmp_path / "b" / "artifact.json")
    before = tree(tmp_path)
    refused(new, tmp_path / "a", r"artifact\.json: is a symbolic link")
    assert tree(tmp_path) == before and holds(tmp_path / "b", old)


@pytest.mark.parametrize("under", ["file/a", "file/x/a", "file"])
def test_save_refuses_a_path_under_a_regular_file(old, tmp_path, under):
    (tmp_path / "file").write_text("mine")
    before = tree(tmp_path)
    refused(old, tmp_path / under, "is a file|part of this path is a file")
    assert tree(tmp_path) == before


@pytest.fixture
def shared_tmp():
    """A directory every user may enter (for saves run as an unprivileged user)."""
    d = Path(tempfile.mkdtemp(prefix="rewriter-safety-"))
    d.chmod(0o755)
    yield d
    for p in [d, *d.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o755)
    shutil.rmtree(d)


def unprivileged(fn):
    """``fn()``'s exception as (type name, message), or None, run by a user without root's
    power to ignore permissions: as root, in a forked child that drops to uid 65534."""
    if os.getuid() != 0:
        try:
            fn()
        except BaseException as e:
            return type(e).__name__, str(e)
        return None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                fn()
                result = None
            except BaseException as e:
                result = (type(e).__name__, str(e))
            os.write(w, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def writable_by_saver(path: Path) -> None:
    if os.getuid() == 0:
        os.chown(path, NOBODY, NOBODY)


@pytest.mark.parametrize("case", ["new_dir_in_read_only_dir", "read_only_artifact",
                                  "read_only_empty_dir", "undeletable_leftover"])
def test_save_refuses_what_it_cannot_write_and_changes_nothing(old, new, shared_tmp, case):
    base = shared_tmp
    old.save(base / "art")
    if case == "new_dir_in_read_only_dir":  # the input
        (base / "ro").mkdir()
        target, match = base / "ro" / "a", "directory is not writable"
        (base / "ro").chmod(0o555)
    elif case == "read_only_artifact":
        target, match = base / "art", "directory is not writable"
        target.chmod(0o555)
    elif case == "read_only_empty_dir":
        target, match = base / "empty", "directory is not writable"
        target.mkdir(mode=0o555)
    else:  # a PermissionError midway: a leftover (of another user's save) cannot be deleted
        target, match = base / "art", "cannot save the artifact"
        leftover = target / "v-0123456789abcdef"
        leftover.mkdir()
        (leftover / "ir.json").write_text("{}")
        writable_by_saver(target)
        leftover.chmod(0o555)
    before = tree(base)
    error = unprivileged(lambda: new.save(target))
    assert error is not None and error[0] == "ArtifactError", error
    assert match in error[1] and str(target) in error[1]
    assert tree(base) == before and holds(base / "art", old)


# ---------------------------------------------------------------- a kill at each step

def test_the_kill_tests_enumerate_every_step_of_a_save(old, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(artifact, "SAVE_STEP_HOOKS", [seen.append])
    old.save(tmp_path / "a")
    assert seen == STEPS


def save_killed_at(engine, path, step):
    """Save in a forked child that is SIGKILLed when the save finishes ``step``."""
    pid = os.fork()
    if pid == 0:
        try:
            def kill(name):
                if name == step:
                    os.kill(os.getpid(), signal.SIGKILL)
            artifact.SAVE_STEP_HOOKS.append(kill)
            engine.save(path)
        finally:
            os._exit(3)  # reached only if the step never came
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"never reached {step!r}"


@pytest.mark.parametrize("step", STEPS)
def test_a_kill_at_each_step_of_an_overwrite_leaves_the_old_or_the_new_artifact(old, new, tmp_path, step):
    path = tmp_path / "a"
    old.save(path)
    (tmp_path / "notes.txt").write_text("beside the artifact")
    outside, earlier = tree(tmp_path, skip=path), tree(path)
    save_killed_at(new, path, step)
    assert tree(tmp_path, skip=path) == outside
    if STEPS.index(step) < SWAP:
        after = tree(path)
        assert {k: after[k] for k in earlier} == earlier  # the old artifact, byte for byte
        assert holds(path, old)
    else:
        assert holds(path, new)
    new.save(path)  # the next save deletes what the kill left
    assert_one_clean_artifact(path, new)
    assert tree(tmp_path, skip=path) == outside


@pytest.mark.parametrize("step", STEPS)
def test_a_kill_at_each_step_of_a_first_save_leaves_no_artifact_or_the_new_one(new, tmp_path, step):
    path = tmp_path / "a"
    (tmp_path / "notes.txt").write_text("beside the artifact")
    outside = tree(tmp_path)
    save_killed_at(new, path, step)
    assert tree(tmp_path, skip=path) == outside
    if STEPS.index(step) < SWAP:
        with pytest.raises(ArtifactError, match=r"artifact\.json: missing"):
            rewriter.load(path)
    else:
        assert holds(path, new)
    new.save(path)  # accepted: the directory holds nothing but a save's leftovers
    assert_one_clean_artifact(path, new)


@pytest.mark.parametrize("error", [PermissionError, KeyboardInterrupt])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("first", [True, False], ids=["first_save", "overwrite"])
def test_an_error_at_each_step_leaves_no_trace_before_the_swap(old, new, tmp_path, monkeypatch,
                                                               step, error, first):
    path = tmp_path / "a"
    if not first:
        old.save(path)
    before = tree(tmp_path)

    def fail(name):
        if name == step:
            raise error("injected")
    monkeypatch.setattr(artifact, "SAVE_STEP_HOOKS", [fail])
    expected = ArtifactError if error is PermissionError else error  # an OSError is named
    with pytest.raises(expected) as info:
        new.save(path)
    if expected is ArtifactError:
        assert str(path) in str(info.value) and "injected" in str(info.value)
    monkeypatch.setattr(artifact, "SAVE_STEP_HOOKS", [])
    if STEPS.index(step) < SWAP:
        assert tree(tmp_path) == before  # nothing written, no leftovers, no empty directory
    else:
        assert holds(path, new)
        new.save(path)
        assert_one_clean_artifact(path, new)


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
@pytest.mark.parametrize("first", [True, False], ids=["first_save", "overwrite"])
def test_an_error_just_after_the_pointer_rename_keeps_the_new_artifact(old, new, tmp_path,
                                                                      monkeypatch, error, first):
    """The rename is the commit: an interrupt landing after it (still inside the call that
    renamed) must not delete the version the pointer now names."""
    path = tmp_path / "a"
    if not first:
        old.save(path)
    (tmp_path / "notes.txt").write_text("beside the artifact")
    outside = tree(tmp_path, skip=path)
    rename = os.replace

    def rename_then_raise(src, dst, *args, **kwargs):
        rename(src, dst, *args, **kwargs)
        if dst == "artifact.json":
            raise error("injected after the rename")
    monkeypatch.setattr(os, "replace", rename_then_raise)
    with pytest.raises(KeyboardInterrupt if error is KeyboardInterrupt else ArtifactError,
                       match="injected after the rename"):
        new.save(path)
    monkeypatch.undo()
    assert holds(path, new) and tree(tmp_path, skip=path) == outside
    new.save(path)  # the next save deletes what was left (the old version)
    assert_one_clean_artifact(path, new)
    assert tree(tmp_path, skip=path) == outside


# ---------------------------------------------------------------- leftovers of interrupted saves

def test_the_old_layouts_hidden_temporary_directories_are_deleted(old, new, tmp_path):
    """The issue's input: format 1 saved through ``.NAME.saving-XXXXXXXX`` siblings."""
    old.save(tmp_path / "a")
    for name in (".a.saving-k2j4_9xz", ".a.old-4242"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights.safetensors").write_bytes(b"\0" * 1000)
        (tmp_path / name / "ir.json").write_text("{}")
    new.save(tmp_path / "a")
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_leftover_versions_and_pointer_temporaries_are_deleted(old, new, tmp_path):
    path = tmp_path / "a"
    old.save(path)
    (path / "v-00000000deadbeef").mkdir()
    (path / "v-00000000deadbeef" / "weights.safetensors").write_bytes(b"\0" * 1000)
    (path / "v-00000000deadbeef" / ".ir.json.0badc0de.tmp").write_text("{")
    (path / ".artifact.json.0123abcd.tmp").write_text("{")
    new.save(path)
    assert_one_clean_artifact(path, new)


def test_what_only_looks_like_a_leftover_is_kept(old, new, tmp_path):
    path = tmp_path / "a"
    old.save(path)
    (tmp_path / ".a.saving-k2j4_9xz").mkdir()  # the old layout's name, holding a user's file
    (tmp_path / ".a.saving-k2j4_9xz" / "diary.txt").write_text("mine")
    (tmp_path / ".b.saving-k2j4_9xz").mkdir()  # another artifact's, maybe saving right now
    (tmp_path / ".b.saving-k2j4_9xz" / "ir.json").write_text("{}")
    (path / "v-0123456789abcdef").mkdir()  # a version's name, holding a user's file
    (path / "v-0123456789abcdef" / "thesis.tex").write_text("mine")
    (path / "README.md").write_text("notes the user keeps beside the artifact")
    (path / "v-00000000deadbeef").symlink_to(tmp_path / ".a.saving-k2j4_9xz")  # a link
    kept = [".a.saving-k2j4_9xz/diary.txt", ".b.saving-k2j4_9xz/ir.json", "a/README.md",
            "a/v-0123456789abcdef/thesis.tex", "a/v-00000000deadbeef"]
    before = tree(tmp_path)
    new.save(path)
    after = tree(tmp_path)
    assert {k: after.get(k) for k in kept} == {k: before[k] for k in kept} and holds(path, new)


@pytest.mark.parametrize("where", ["leftover_version", "old_sibling", "current_version"])
@pytest.mark.parametrize("case", list(LOOKALIKES))
def test_a_version_lookalike_is_kept_wherever_a_save_cleans_up(old, new, tmp_path, where, case):
    """Leftover clean-up, the old-layout siblings' clean-up and the deletion of the version
    the pointer named before all keep a directory that a save would not have written."""
    path = tmp_path / "a"
    old.save(path)
    current = path / json.loads((path / "artifact.json").read_text())["version_dir"]
    d = {"leftover_version": path / "v-0123456789abcdef", "old_sibling": tmp_path / ".a.saving-k2j4_9xz",
         "current_version": current}[where]
    rel = LOOKALIKES[case]
    if (d / rel.split("/")[0]).exists():  # the current version's own ir.json or weights
        (d / rel.split("/")[0]).unlink()
    lookalike(d, case, mine=tmp_path / "mine")
    before = tree(tmp_path)
    new.save(path)
    after = tree(tmp_path)
    kept = [k for k in before if k.startswith(f"{d.relative_to(tmp_path).as_posix()}/")
            or k.startswith("mine")]
    assert {k: after.get(k) for k in kept} == {k: before[k] for k in kept} and holds(path, new)


def test_a_second_save_waits_for_the_first_instead_of_deleting_its_files(old, new, tmp_path):
    """Without the lock, the second save would take the first one's unfinished version
    directory for a leftover and delete it."""
    import threading
    path = tmp_path / "a"
    old.save(path)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            def pause(name):
                if name == "created the version directory":
                    os.write(ready_w, b"x")
                    os.read(go_r, 1)
            artifact.SAVE_STEP_HOOKS.append(pause)
            new.save(path)
            code = 0
        finally:
            os._exit(code)
    os.read(ready_r, 1)  # the first save holds the lock and has a half-made version
    second = threading.Thread(target=old.save, args=(path,))
    second.start()
    second.join(timeout=1.0)
    waited = second.is_alive()
    os.write(go_w, b"x")
    _, status = os.waitpid(pid, 0)
    second.join()
    assert waited and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert_one_clean_artifact(path, old)  # the second save ran after the first


def format1(path: Path, source: Path) -> Path:
    """A format-1 artifact (flat, manifest.json on top) made of a format-2 one's files."""
    v = source / json.loads((source / "artifact.json").read_text())["version_dir"]
    shutil.copytree(v, path)
    m = json.loads((path / "manifest.json").read_text())
    m["format_version"] = 1
    (path / "manifest.json").write_text(json.dumps(m))
    return path


def test_a_format1_artifact_is_replaced_and_refused_at_load(old, new, tmp_path):
    old.save(tmp_path / "src")
    path = format1(tmp_path / "a", tmp_path / "src")
    assert is_artifact(path)
    with pytest.raises(ArtifactError, match="format 1.*save the model again"):
        rewriter.load(path)
    (path / "README.md").write_text("mine")
    new.save(path)
    assert sorted(os.listdir(path)) == ["README.md", "artifact.json"] + version_dirs(path)
    assert holds(path, new)


def format1_manifest(path: Path, files: list[str]) -> Path:
    """A format-1 artifact's marker listing ``files`` (which may not be there)."""
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps(
        {"format": "rewriter-artifact", "format_version": 1, "files": {f: {} for f in files}}))
    return path


@pytest.mark.parametrize("case", ["ssh_keys", "kernel_sources", "ir_json_link"])
def test_replacing_a_format1_artifact_never_deletes_through_a_link(old, tmp_path, case):
    """The issue's input: ``kernels`` a link to ~/.ssh, the manifest listing the keys as
    kernels; a save deleted them. Only regular files inside DIR itself are removed."""
    mine = tmp_path / "mine"
    mine.mkdir()
    names = {"ssh_keys": ["authorized_keys", "id_rsa"], "kernel_sources": ["a.py", "b.py"],
             "ir_json_link": ["ir.json"]}[case]
    for name in names:
        (mine / name).write_text(f"the user's {name}")
    listed = names if case == "ir_json_link" else [f"kernels/{n}" for n in names]
    path = format1_manifest(tmp_path / "a", listed)
    link = path / ("ir.json" if case == "ir_json_link" else "kernels")
    link.symlink_to(mine / "ir.json" if case == "ir_json_link" else mine)
    outside = tree(tmp_path, skip=path)
    old.save(path)
    assert tree(tmp_path, skip=path) == outside
    assert link.is_symlink() and holds(path, old)  # the link, not ours to delete, is kept


# ---------------------------------------------------------------- dumps

@pytest.mark.parametrize("planted", ["00_lift.txt.tmp",  # the old code's predictable name
                                     "summary.json.tmp", "00_lift.dot.tmp", "00_lift.txt",
                                     "summary.json"])
def test_a_symlink_planted_in_a_dump_directory_is_not_written_through(old, tmp_path, planted):
    victim = tmp_path / "victim.txt"
    victim.write_text("an unrelated file")
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / planted).symlink_to(victim)
    outside = tree(tmp_path, skip=dump)
    old.dump(dump)
    assert tree(tmp_path, skip=dump) == outside
    assert (dump / "00_lift.txt").read_text().startswith(str(old._snapshots[0][1]).splitlines()[0])
    assert not (dump / "00_lift.txt").is_symlink()


def test_a_dump_subdirectory_that_is_a_symlink_is_refused(tmp_path):
    from rewriter.ir.dump import Dumper
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "dump").mkdir()
    (tmp_path / "dump" / "kernels").symlink_to(tmp_path / "elsewhere")
    before = tree(tmp_path)
    with pytest.raises(RewriterError, match=r"dump/kernels/k\.py: cannot write"):
        Dumper(tmp_path / "dump").write_text("kernels/k.py", "x = 1\n")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("relpath", ["../escape.txt", "kernels/../../escape.txt", "/tmp/escape.txt",
                                     "kernels//k.py", "./k.py"])
def test_a_dump_file_name_cannot_leave_the_dump_directory(tmp_path, relpath):
    from rewriter.ir.dump import Dumper
    dumper = Dumper(tmp_path / "dump")
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="must be a relative path without"):
        dumper.write_text(relpath.replace("/tmp", str(tmp_path)), "x = 1\n")
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- the kernel cache

def kernel(tag: str):
    from rewriter.codegen.pointwise import GeneratedKernel
    source = f"# {tag}\ndef k():\n    return 42\n"
    return GeneratedKernel(name="k", source=source, inputs=[], outputs=[], symbols=[], shape=())


def cache_name(k) -> str:
    return f"k_{hashlib.sha256(k.source.encode()).hexdigest()[:20]}.py"


@pytest.mark.parametrize("victim_text", ["an unrelated file", None])  # None: the kernel's own text
def test_a_symlink_named_like_a_cached_kernel_is_replaced(tmp_path, monkeypatch, victim_text):
    from rewriter.codegen.pointwise import compile_source
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("REWRITER_CACHE", str(cache))
    k = kernel(str(tmp_path))
    victim = tmp_path / "victim.py"
    victim.write_text(victim_text or k.source)
    (cache / cache_name(k)).symlink_to(victim)
    outside = tree(tmp_path, skip=cache)
    assert compile_source(k)() == 42
    assert tree(tmp_path, skip=cache) == outside
    assert not (cache / cache_name(k)).is_symlink() and (cache / cache_name(k)).read_text() == k.source


@pytest.mark.parametrize("case", ["open_to_others", "a_file", "someone_elses"])
def test_a_kernel_cache_that_is_not_private_is_refused(tmp_path, monkeypatch, case):
    from rewriter.codegen.pointwise import compile_source
    cache = tmp_path / "cache"
    if case == "a_file":
        cache.write_text("mine")
    else:
        cache.mkdir()
        cache.chmod(0o777 if case == "open_to_others" else 0o700)
        if case == "someone_elses":
            if os.getuid() != 0:
                pytest.skip("needs root to give a directory to another user")
            os.chown(cache, NOBODY, NOBODY)
    monkeypatch.setenv("REWRITER_CACHE", str(cache))
    before = tree(tmp_path)
    with pytest.raises(RewriterError, match=f"{cache}: .*(not private|cannot use|not a directory)"):
        compile_source(kernel(f"{tmp_path} {case}"))
    assert tree(tmp_path) == before


def test_the_default_kernel_cache_must_not_be_a_planted_symlink(tmp_path, monkeypatch):
    """Anyone can create /tmp/rewriter-kernels-<uid>: a link there must not be followed,
    not even to a private directory of this user's."""
    from rewriter.codegen.pointwise import compile_source
    monkeypatch.delenv("REWRITER_CACHE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "private").mkdir(mode=0o700)
    (tmp_path / "tmp" / f"rewriter-kernels-{os.getuid()}").symlink_to(tmp_path / "private")
    before = tree(tmp_path)
    with pytest.raises(RewriterError, match="kernel cache is not a directory"):
        compile_source(kernel(f"{tmp_path} default"))
    assert tree(tmp_path) == before
