"""Room for the derived copies of the weights (``runtime.memory``): float32 weights
transposed and bfloat16 weights packed are made only where they fit in half the available
memory, a copy made once is reused without asking again, and the copies follow their
weights."""
import pytest
import torch

import rewriter
from conftest import make_model
from rewriter.runtime import memory
from rewriter.runtime.kernels import linear_t
from rewriter.runtime.lower import lower


def _meminfo(monkeypatch, tmp_path, available_kb: int) -> None:
    info = tmp_path / "meminfo"
    info.write_text(f"MemTotal:       99999999 kB\nMemFree:        1 kB\n"
                    f"MemAvailable:   {available_kb} kB\n")
    monkeypatch.setattr(memory, "MEMINFO", str(info))
    _no_cgroup(monkeypatch, tmp_path)


def _no_cgroup(monkeypatch, tmp_path) -> None:
    """No cgroup limit, whatever the machine running the tests has."""
    monkeypatch.setattr(memory, "CGROUP", str(tmp_path / "no-cgroup"))
    monkeypatch.setattr(memory, "SELF_CGROUP", str(tmp_path / "no-self-cgroup"))


def _linear_bytes(model) -> int:
    """What one copy of every linear's weight takes (the token embedding is no linear's)."""
    return sum(t.nbytes for n, t in model.named_parameters() if t.dim() == 2 and "embed" not in n)


def _reads_transposed(opt) -> bool:
    """Whether the decode program lowered from ``opt``'s IR (under the memory and environment
    of now) reads transposed copies; the test then generates with the same ``opt``."""
    decode = lower(opt.ir, False, "torch", {})
    return any(n.op == "call_function" and n.target is linear_t for n in decode.graph.nodes)


def test_available_memory_is_read_from_meminfo(monkeypatch, tmp_path):
    _meminfo(monkeypatch, tmp_path, 2048)
    assert memory.available_bytes() == 2048 * 1024
    assert memory.room_for(1024 * 1024) and not memory.room_for(1024 * 1024 + 1)
    assert memory.room_for(0)
    for text in ("MemTotal: 5 kB\n", "MemAvailable: lots\n", ""):  # no figure: not known
        (tmp_path / "meminfo").write_text(text)
        assert memory.available_bytes() is None and memory.room_for(10 ** 15)
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "missing"))  # not Linux
    assert memory.available_bytes() is None and memory.room_for(10 ** 15)


def test_float32_weights_are_transposed_only_where_the_copies_fit(monkeypatch, tmp_path):
    model = make_model("llama-gqa-3l")  # float32, weights never transposed before
    need = _linear_bytes(model)
    _meminfo(monkeypatch, tmp_path, need // 1024)  # half of it is room for half the copies
    plain = rewriter.optimize(model)
    assert not _reads_transposed(plain)
    tight = plain.generate([[3, 4, 5], [6, 7]], max_new_tokens=6, eos_token_id=[])
    _meminfo(monkeypatch, tmp_path, 3 * need // 1024)
    roomy = rewriter.optimize(model)
    assert _reads_transposed(roomy)
    roomy = roomy.generate([[3, 4, 5], [6, 7]], max_new_tokens=6, eos_token_id=[])
    assert torch.equal(tight, roomy)  # F.linear and the transposed product: the same tokens


def test_the_environment_fixes_whether_float32_weights_are_transposed(monkeypatch, tmp_path):
    model = make_model("llama-gqa-3l")
    need = _linear_bytes(model)
    _meminfo(monkeypatch, tmp_path, need // 1024)  # no room
    monkeypatch.setenv("REWRITER_TRANSPOSED_LINEAR", "on")
    assert _reads_transposed(rewriter.optimize(model))  # whatever the memory reads
    _meminfo(monkeypatch, tmp_path, 100 * need // 1024)  # plenty
    monkeypatch.setenv("REWRITER_TRANSPOSED_LINEAR", " OFF ")
    off = rewriter.optimize(model)
    assert not _reads_transposed(off)
    off = off.generate([[3, 4, 5], [6, 7]], max_new_tokens=6, eos_token_id=[])
    monkeypatch.setenv("REWRITER_TRANSPOSED_LINEAR", "auto")
    auto = rewriter.optimize(model)
    assert _reads_transposed(auto)
    auto = auto.generate([[3, 4, 5], [6, 7]], max_new_tokens=6, eos_token_id=[])
    assert torch.equal(off, auto)
    monkeypatch.setenv("REWRITER_TRANSPOSED_LINEAR", "yes")
    with pytest.raises(ValueError, match="REWRITER_TRANSPOSED_LINEAR must be auto, on or off"):
        rewriter.optimize(model)


def test_copies_already_made_are_reused_when_memory_is_tight(monkeypatch, tmp_path):
    """An IR lowered again (a pass times its programs a dozen times) reads the copies it
    has: they take no new memory, and the programs of one model stay alike."""
    model = make_model("llama-gqa-3l")
    ir = rewriter.optimize(model).ir

    def transposed() -> bool:
        decode = lower(ir, False, "torch", {})
        return any(n.op == "call_function" and n.target is linear_t for n in decode.graph.nodes)
    _meminfo(monkeypatch, tmp_path, 3 * _linear_bytes(model) // 1024)
    assert transposed()
    _meminfo(monkeypatch, tmp_path, 1)  # the copies now fill the memory
    assert transposed()
    with torch.no_grad():  # a weight written in place: its copy is stale, a new one needs room
        model.lm_head.weight.mul_(2)
    assert not transposed()


def test_a_copy_follows_its_weight():
    made = []
    copies = memory.Copies(lambda w: made.append(1) or w.t().contiguous())
    w = torch.randn(3, 5)
    assert not copies.has(w)
    first = copies(w)
    assert copies.has(w) and copies(w) is first and len(made) == 1
    assert not first.requires_grad
    w.add_(1)  # written in place: a new copy
    assert not copies.has(w) and torch.equal(copies(w), w.t()) and len(made) == 2
    w.data = torch.randn(3, 5)  # replaced in place of its storage
    assert not copies.has(w) and torch.equal(copies(w), w.t())
    with torch.inference_mode():  # no version counter: made every time, never kept
        v = torch.randn(2, 2)
        assert not copies.has(v) and copies(v) is not copies(v)


def test_a_parameter_copy_is_detached():
    p = torch.nn.Parameter(torch.randn(4, 6))
    copy = memory.Copies(lambda w: w.t().contiguous())(p)
    assert not copy.requires_grad and copy.grad_fn is None


def test_a_containers_limit_counts_where_it_leaves_less(monkeypatch, tmp_path):
    _meminfo(monkeypatch, tmp_path, 4096)  # 4 MiB by /proc/meminfo
    group = tmp_path / "cgroup"
    group.mkdir()
    monkeypatch.setattr(memory, "CGROUP", str(group))
    assert memory.available_bytes() == 4096 * 1024  # no cgroup files: meminfo's
    own = group / "user.slice" / "me"
    own.mkdir(parents=True)
    (tmp_path / "self").write_text("0::/user.slice/me\n")
    monkeypatch.setattr(memory, "SELF_CGROUP", str(tmp_path / "self"))
    (own / "memory.max").write_text(f"{1024 * 1024}\n")  # the process's own cgroup first
    (own / "memory.current").write_text("0\n")
    assert memory.available_bytes() == 1024 * 1024
    (own / "memory.max").unlink()  # none of its own: the root's
    (group / "memory.max").write_text("max\n")
    (group / "memory.current").write_text("123\n")
    assert memory.available_bytes() == 4096 * 1024  # no limit
    (group / "memory.max").write_text(f"{3 * 1024 * 1024}\n")
    (group / "memory.current").write_text(f"{1024 * 1024}\n")
    assert memory.available_bytes() == 2 * 1024 * 1024  # the limit leaves 2 MiB
    (group / "memory.stat").write_text(f"anon 5\ninactive_file {512 * 1024}\nactive_file 9\n")
    assert memory.available_bytes() == 2 * 1024 * 1024 + 512 * 1024  # file cache reclaimable
    (group / "memory.stat").unlink()
    (group / "memory.current").write_text(f"{5 * 1024 * 1024}\n")  # past it: nothing left
    assert memory.available_bytes() == 0 and not memory.room_for(1)
    (group / "memory.max").write_text("garbage\n")
    assert memory.available_bytes() == 4096 * 1024


def test_every_cgroup_above_the_process_counts(monkeypatch, tmp_path):
    _meminfo(monkeypatch, tmp_path, 64 * 1024)  # 64 MiB by /proc/meminfo
    group = tmp_path / "cgroup"
    own = group / "parent" / "me"
    own.mkdir(parents=True)
    monkeypatch.setattr(memory, "CGROUP", str(group))
    (tmp_path / "self").write_text("0::/parent/me\n")
    monkeypatch.setattr(memory, "SELF_CGROUP", str(tmp_path / "self"))
    mib = 1024 * 1024
    for folder, limit, used in ((own, 8, 1), (group / "parent", 6, 2)):
        (folder / "memory.max").write_text(f"{limit * mib}\n")
        (folder / "memory.current").write_text(f"{used * mib}\n")
    assert memory.available_bytes() == 4 * mib  # the parent's 6 - 2, under the own 8 - 1
    (own / "memory.high").write_text(f"{3 * mib}\n")  # throttled past it: a limit too
    assert memory.available_bytes() == 2 * mib
    (own / "memory.high").write_text("max\n")
    (group / "memory.max").write_text(f"{mib}\n")  # the root (a container's) as well
    (group / "memory.current").write_text("0\n")
    assert memory.available_bytes() == mib
    (group / "parent" / "memory.max").write_text("garbage\n")  # a level that does not parse
    (group / "memory.max").write_text("max\n")
    assert memory.available_bytes() == 7 * mib  # is passed over; the own one still counts
    (tmp_path / "self").write_text("0::/parent/../../outside\n")  # not followed out of CGROUP
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "memory.max").write_text("1\n")
    (tmp_path / "outside" / "memory.current").write_text("0\n")
    assert memory.available_bytes() == 64 * mib  # the root alone: no limit there
    (tmp_path / "self").write_text("0::/docker/abc\n")  # a host's path, not mounted here
    (group / "docker").mkdir()
    (group / "docker" / "memory.max").write_text("1\n")  # a folder of the same name
    (group / "docker" / "memory.current").write_text("0\n")
    (group / "memory.max").write_text(f"{5 * mib}\n")
    assert memory.available_bytes() == 5 * mib  # is not the process's: the root alone


@pytest.mark.parametrize("answers", [(False, True), (True, False)])
def test_one_models_programs_read_a_weight_the_same_way(monkeypatch, answers):
    """Each program asks for room as it is lowered; memory that frees (or fills) between
    them must not leave prefill on F.linear and decode on the transposed copies (their
    floats differ): the first answer holds for every program of the model."""
    from rewriter.passes import HydraHeads
    from rewriter.runtime.decoding import strategy_for
    from rewriter.runtime.programs import build_programs
    model = make_model("llama-gqa-3l")
    ir = rewriter.optimize(model, passes=[HydraHeads(num_heads=2, tree=[[0], [1], [0, 0]])]).ir
    asked = list(answers) + [answers[-1]] * 20
    monkeypatch.setattr(memory, "room_for", lambda nbytes: asked.pop(0))
    programs = build_programs(ir, "torch", {}, strategy_for(ir))
    reads = {name: any(n.op == "call_function" and n.target is linear_t for n in p.graph.nodes)
             for name, p in programs.items() if hasattr(p, "graph")}
    assert set(reads) >= {"prefill", "decode", "tree_prefill", "verify"}
    assert all(reads[k] is answers[0] for k in ("prefill", "decode", "tree_prefill", "verify")), reads


def test_stale_copies_are_dropped_before_room_is_asked():
    copies = memory.Copies(lambda w: w.t().contiguous())
    w, v = torch.randn(3, 5), torch.randn(2, 2)
    copies(w), copies(v)
    w.add_(1)  # written: its copy is stale
    copies.sweep()
    assert len(copies._kept) == 1 and copies.has(v)


def _linears(*targets):
    from types import SimpleNamespace
    return [SimpleNamespace(args=(None, SimpleNamespace(target=t))) for t in targets]


def test_room_is_asked_for_new_copies_only_once_stale_ones_are_dropped():
    """``_fitting`` asks for the bytes of copies not yet made (a weight read by two linears,
    or tied under two names, once), after dropping copies whose weights were written."""
    from rewriter.runtime.lower import _fitting
    copies = memory.Copies(lambda w: w.t().contiguous())
    a, b, made = torch.randn(4, 8), torch.randn(2, 8), torch.randn(3, 8)
    stale = torch.randn(5, 5)
    copies(made), copies(stale)
    stale.add_(1)  # written: its copy is never read again
    weights = {"a": a, "tied": a, "b": b, "made": made}
    asked = []

    def room(nbytes):
        asked.append((nbytes, len(copies._kept)))
        return True
    nodes = _linears("a", "a", "tied", "b", "made")
    assert _fitting(nodes, {}, weights.__getitem__, ".__t", copies, room) == nodes
    assert asked == [(a.nbytes + b.nbytes, 1)]  # a once, made not at all, the stale one gone


def test_a_refusal_holds_for_the_models_later_programs():
    from rewriter.runtime.lower import _fitting
    copies = memory.Copies(lambda w: w.t().contiguous())
    weights = {"a": torch.randn(4, 8), "b": torch.randn(2, 8)}
    derived = {"a.__t": copies(weights["a"])}  # an earlier program's copy
    answers = []
    nodes = _linears("a", "b")
    got = _fitting(nodes, derived, weights.__getitem__, ".__t", copies,
                   lambda n: answers.append(n) or False)
    assert got == nodes[:1] and len(answers) == 1  # refused: only the copy already read
    assert _fitting(nodes, derived, weights.__getitem__, ".__t", copies, lambda n: True) == nodes[:1]
