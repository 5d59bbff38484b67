"""Where KV sharing shows outside the IR: the dump's cache table, the artifact's manifest
(checked against its IR at load) and ``rewriter info``."""
import json
import re
import shutil

import pytest

import rewriter
from rewriter.cli import main
from rewriter.errors import ArtifactError
from rewriter.passes import ShareKV

from artifact_tools import artifact_files, reseal
from conftest import traced_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    trace = traced_model("llama-gqa-3l", initializer_range=0.2)[1]
    path = tmp_path_factory.mktemp("shared") / "a"
    rewriter.optimize(trace, passes=[ShareKV(sources={1: 0, 2: 0})]).save(path)
    return path


def test_the_dump_lists_each_caches_readers(tmp_path):
    trace = traced_model("llama-gqa-3l", initializer_range=0.2)[1]
    opt = rewriter.optimize(trace, passes=[ShareKV(sources={2: 0})])
    opt.generate([[3, 4, 5]], max_new_tokens=2)  # the programs exist once lowered
    opt.dump(tmp_path / "d")
    table = json.loads((tmp_path / "d" / "programs" / "caches.json").read_text())
    assert table["readers"] == {"0": [2]}
    assert [c["id"] for c in table["caches"]] == [0, 1]


def test_the_manifest_names_the_sharing_and_info_shows_it(saved, capsys):
    manifest = json.loads(artifact_files(saved)["manifest.json"].read_text())
    assert manifest["kv_sharing"] == {"1": 0, "2": 0}
    assert main(["info", str(saved)]) == 0
    assert re.search(r"KV sharing +layers 1, 2 read layer 0's cache\n", capsys.readouterr().out)


@pytest.mark.parametrize("claim, message", [
    ({"1": 0}, r"kv_sharing \{'1': 0\} is not the sharing of .*ir\.json"),
    ({"x": 0}, r"'kv_sharing' must be null or an object \{reader layer: owner layer\}"),
    ({"1": -1}, r"'kv_sharing' must be null or an object"),
    ([1, 0], r"'kv_sharing' must be null or an object")])
def test_a_manifest_claiming_other_sharing_is_refused(saved, tmp_path, claim, message):
    art = tmp_path / "a"
    shutil.copytree(saved, art, symlinks=True)
    file = artifact_files(art)["manifest.json"]
    data = json.loads(file.read_text())
    data["kv_sharing"] = claim
    file.write_text(json.dumps(data))
    reseal(art)
    with pytest.raises(ArtifactError, match=message):
        rewriter.load(art)
    del data["kv_sharing"]  # saved before the field existed: loads
    file.write_text(json.dumps(data))
    reseal(art)
    rewriter.load(art)
