"""bfloat16 linears on packed weights (``runtime.packed_linear``): the values oneDNN's
``F.linear`` gives, the copies kept while their weights are unchanged, the choice measured
or fixed by hand, and the lowered programs reading them where it is taken."""
import pytest
import torch
import torch.nn.functional as F

from rewriter.runtime import memory, packed_linear
from rewriter.runtime.kernels import KERNELS
from rewriter.runtime.lower import lower

needs_onednn = pytest.mark.skipif(not packed_linear._machine_ok(),
                                  reason="this torch or CPU has no oneDNN bfloat16 linear")


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@needs_onednn
@pytest.mark.parametrize("x_shape", [(1, 96), (7, 96), (2, 5, 96), (3, 1, 96), (1, 0, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_gives_f_linears_values(x_shape, bias):
    w, x = _bf16(40, 96, seed=1), _bf16(*x_shape, seed=2)
    b = _bf16(40, seed=3) if bias else None
    got = packed_linear.linear_packed(x, packed_linear.pack(w), b)
    assert got.shape == (*x_shape[:-1], 40) and got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(x, w, b))


@needs_onednn
def test_a_strided_input_is_read_as_it_is():
    """The last position of a prompt (``x[:, -1:]``) and a transposed view: not contiguous."""
    w, x = _bf16(40, 96, seed=1), _bf16(2, 6, 96, seed=2)
    packed = packed_linear.pack(w)
    assert torch.equal(packed_linear.linear_packed(x[:, -1:], packed), F.linear(x[:, -1:], w))
    xt = _bf16(96, 4, seed=3).t()
    assert torch.equal(packed_linear.linear_packed(xt, packed), F.linear(xt, w))


def test_only_2d_bfloat16_cpu_weights_are_packed(monkeypatch):
    monkeypatch.setattr(packed_linear, "_machine_ok", lambda: True)
    assert packed_linear.supported(_bf16(4, 8))
    assert not packed_linear.supported(torch.randn(4, 8))  # float32
    assert not packed_linear.supported(torch.randn(4, 8).half())
    assert not packed_linear.supported(_bf16(8))
    assert not packed_linear.supported(_bf16(0, 8))
    monkeypatch.setattr(packed_linear, "_machine_ok", lambda: False)
    assert not packed_linear.supported(_bf16(4, 8))


@needs_onednn
def test_a_packed_copy_is_kept_until_its_weight_is_written():
    w = torch.nn.Parameter(_bf16(40, 96), requires_grad=False)
    first = packed_linear.pack(w)
    assert packed_linear.pack(w) is first
    x = _bf16(3, 96, seed=4)
    with torch.no_grad():
        w.mul_(2)  # in place: the kept copy is stale
    again = packed_linear.pack(w)
    assert again is not first
    assert torch.equal(packed_linear.linear_packed(x, again), F.linear(x, w))
    with torch.inference_mode():
        made = _bf16(40, 96)
    # an inference tensor has no version counter: packed afresh every time
    assert packed_linear.pack(made) is not packed_linear.pack(made)


def _fake_clock(monkeypatch, linear_costs, packed_costs):
    """The probe's clock advanced by each pass's cost, in turn: no real timing."""
    now, costs = [0.0], {"linear": list(linear_costs), "packed": list(packed_costs)}
    monkeypatch.setattr(packed_linear, "_clock", lambda: now[0])

    def costing(name, f):
        def call(*a, **kw):
            # a pass is _PROBE[0] products: its cost is counted once, on its first
            costing.calls[name] = costing.calls.get(name, 0) + 1
            if costing.calls[name] % packed_linear._PROBE[0] == 1:
                now[0] += costs[name].pop(0) if len(costs[name]) > 1 else costs[name][0]
            return f(*a, **kw)
        return call
    costing.calls = {}
    monkeypatch.setattr(packed_linear.F, "linear", costing("linear", F.linear))
    monkeypatch.setattr(packed_linear, "linear_packed", costing("packed", packed_linear.linear_packed))


@needs_onednn
@pytest.mark.parametrize("linear,packed,takes", [
    ([1.4], [1.0], True),  # the Xeon: 22.3 ms against 15.5 for a step's linears
    ([1.0], [1.1], True),  # within the margin: packing is kept (the same values, less work)
    ([1.0], [1.2], False),  # clearly slower: F.linear
    ([1.0] * 2 + [9.0] * 15, [1.3], False),  # a busy machine slowed all but one pass
    ([1.0], [1.0] * 2 + [20.0] * 15, True),
])
def test_the_choice_is_measured_on_each_sides_fastest_pass(monkeypatch, linear, packed, takes):
    _fake_clock(monkeypatch, linear, packed)
    assert packed_linear._measure() is takes


def test_the_choice_is_measured_once_and_can_be_fixed_by_hand(monkeypatch):
    monkeypatch.delenv(packed_linear.ENV, raising=False)
    monkeypatch.setattr(packed_linear, "_PAYS", {})
    monkeypatch.setattr(packed_linear, "_machine_ok", lambda: True)
    measured = []
    monkeypatch.setattr(packed_linear, "_probe", lambda: measured.append(1) or True)
    assert packed_linear.pays() and packed_linear.pays() and measured == [1]
    monkeypatch.setenv(packed_linear.ENV, " OFF ")
    assert not packed_linear.pays()
    monkeypatch.setenv(packed_linear.ENV, "on")
    monkeypatch.setattr(packed_linear, "_PAYS", {"bfloat16": False})
    assert packed_linear.pays()
    monkeypatch.setenv(packed_linear.ENV, "yes")
    with pytest.raises(ValueError, match="REWRITER_PACKED_LINEAR must be auto, on or off"):
        packed_linear.pays()


def test_a_machine_without_the_op_is_not_measured(monkeypatch):
    monkeypatch.delenv(packed_linear.ENV, raising=False)
    monkeypatch.setattr(packed_linear, "_PAYS", {})
    monkeypatch.setattr(packed_linear, "_machine_ok", lambda: False)
    monkeypatch.setattr(packed_linear, "_probe", lambda: pytest.fail("measured"))
    assert not packed_linear.pays()


def test_packing_is_refused_where_its_values_differ_or_its_ops_fail(monkeypatch):
    monkeypatch.setattr(packed_linear, "_measure", lambda: True)
    monkeypatch.setattr(packed_linear, "_same", lambda: False)  # an emulating oneDNN
    assert not packed_linear._probe()

    def broken():
        raise RuntimeError("no such kernel in this build")
    monkeypatch.setattr(packed_linear, "_same", broken)
    assert not packed_linear._probe()
    monkeypatch.setattr(packed_linear, "_same", lambda: True)
    assert packed_linear._probe()


@needs_onednn
def test_the_value_check_compares_real_products(monkeypatch):
    assert packed_linear._same()  # this machine packs: its products are F.linear's
    real = packed_linear.linear_packed

    def one_unit_off(x, p, b=None):  # what an emulating oneDNN was seen to give
        y = real(x, p, b)
        y[..., 0] = torch.nextafter(y[..., 0], torch.tensor(float("inf"), dtype=y.dtype))
        return y
    monkeypatch.setattr(packed_linear, "linear_packed", one_unit_off)
    assert not packed_linear._same()


@pytest.mark.parametrize("flags,native", [("fpu avx512f avx512bw", False),
                                          ("avx512f avx512_bf16", True), ("avx512f amx_bf16 amx_tile", True)])
def test_native_bfloat16_is_read_from_the_cpus_flags(monkeypatch, tmp_path, flags, native):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    monkeypatch.setattr(packed_linear, "_CPUINFO", str(info))
    assert packed_linear._native_bf16() is native
    monkeypatch.setattr(packed_linear, "_CPUINFO", str(tmp_path / "missing"))  # not Linux
    assert packed_linear._native_bf16() is False


@pytest.mark.parametrize("limit,native", [("AVX512_CORE", False), ("avx2", False), ("SSE41", False),
                                          ("AVX512_CORE_AMX", True), ("all", True)])
def test_a_onednn_limited_below_native_bfloat16_is_not_packed(monkeypatch, tmp_path, limit, native):
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: avx512f amx_bf16\n")
    monkeypatch.setattr(packed_linear, "_CPUINFO", str(info))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
    assert packed_linear._native_bf16() is native
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", limit)  # the older name, read where the newer is unset
    assert packed_linear._native_bf16() is native
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the newer name wins
    assert packed_linear._native_bf16() is False


def _targets(program):
    return {n.target for n in program.graph.nodes if n.op == "call_function"}


@needs_onednn
def test_programs_read_packed_weights_where_chosen(monkeypatch):
    """A bfloat16 model's linears read packed copies (one per weight, shared by prefill
    and decode) when packing is on, none when off; both decode the same tokens."""
    import rewriter
    from conftest import make_model
    model = make_model("llama-gqa-3l").to(torch.bfloat16)
    packed = lambda gm: {id(t) for t in gm.__dict__["_buffers"].values() if t.is_mkldnn}  # noqa: E731
    tokens = {}
    for setting in ("on", "off"):
        monkeypatch.setenv(packed_linear.ENV, setting)
        opt = rewriter.optimize(model)
        prefill, decode = opt._lowered()["prefill"], opt._lowered()["decode"]
        if setting == "on":
            assert packed_linear.linear_packed in _targets(decode)
            assert KERNELS["linear"] not in _targets(decode)
            # 7 linears a layer, 3 layers, the LM head
            assert len(packed(decode)) == 22 and packed(prefill) == packed(decode)
        else:
            assert packed_linear.linear_packed not in _targets(decode) and not packed(decode)
        tokens[setting] = opt.generate([[3, 4, 5, 6], [7, 8, 9, 10]], max_new_tokens=8, eos_token_id=[])
    assert torch.equal(tokens["on"], tokens["off"])


@needs_onednn
def test_an_engine_with_packed_weights_copies_and_reads_weights_written_later(monkeypatch):
    """Packed copies cannot be deep-copied: a copied engine lowers its own programs. A
    weight written in place after lowering is read at the next call, not its stale copy."""
    import copy
    import rewriter
    from conftest import make_model
    monkeypatch.setenv(packed_linear.ENV, "on")
    model = make_model("llama-gqa-3l").to(torch.bfloat16)
    opt = rewriter.optimize(model)
    before = opt.generate([[3, 4, 5]], max_new_tokens=6, eos_token_id=[])
    twin = copy.deepcopy(opt)
    assert torch.equal(twin.generate([[3, 4, 5]], max_new_tokens=6, eos_token_id=[]), before)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)  # the greedy token becomes the least likely one
    after = opt.generate([[3, 4, 5]], max_new_tokens=6, eos_token_id=[])
    assert not torch.equal(after, before)
    assert torch.equal(after, rewriter.optimize(model).generate([[3, 4, 5]], max_new_tokens=6,
                                                                eos_token_id=[]))


def test_float32_programs_are_not_packed_nor_measured(monkeypatch):
    import rewriter
    from conftest import traced_model
    monkeypatch.delenv(packed_linear.ENV, raising=False)
    monkeypatch.setattr(packed_linear, "_PAYS", {})
    monkeypatch.setattr(packed_linear, "_machine_ok", lambda: True)  # as if any machine could
    monkeypatch.setattr(packed_linear, "_probe", lambda: pytest.fail("measured"))
    opt = rewriter.optimize(traced_model("llama-gqa-3l")[1])  # lowered here: patched
    assert packed_linear.linear_packed not in _targets(lower(opt.ir, False, "torch", {}))


def test_an_engine_reads_weights_written_or_replaced_after_lowering():
    """Lowered programs read derived copies of weights (float32: transposed; bfloat16:
    packed): a weight written in place or replaced after lowering is read at the next
    call, as a fresh engine reads it; a deep copy lowers programs of its own."""
    import copy
    import rewriter
    from conftest import make_model
    model = make_model("llama-gqa-3l")
    opt = rewriter.optimize(model)
    prompt = dict(input_ids=[[3, 4, 5]], max_new_tokens=6, eos_token_id=[])
    before = opt.generate(**prompt)
    twin = copy.deepcopy(opt)
    assert torch.equal(twin.generate(**prompt), before)
    assert twin._lowered()["decode"] is not opt._lowered()["decode"]
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)  # in place: the greedy token becomes the least likely
    written = opt.generate(**prompt)
    assert not torch.equal(written, before)
    assert torch.equal(written, rewriter.optimize(model).generate(**prompt))
    weight = opt.ir.weight("lm_head.weight")  # the IR's (it shares the model's storage)
    weight.data = -weight.data  # replaced: a new tensor, the version kept; as it was at first
    assert torch.equal(opt.generate(**prompt), before)
    assert torch.equal(twin.generate(**prompt), before)  # the copy has weights of its own


def test_generations_do_not_lower_again():
    """Nothing a generation writes is a weight: the programs are lowered once."""
    import rewriter
    from conftest import traced_model
    from rewriter.passes import HydraHeads
    _, traced = traced_model("llama-gqa-3l")
    for passes in ([], [HydraHeads(num_heads=2, tree=[[0], [1], [0, 0]])]):
        opt = rewriter.optimize(traced, passes=passes)
        programs = opt._lowered()
        for _ in range(2):
            opt.generate([[3, 4, 5], [6, 7, 8]], max_new_tokens=5, eos_token_id=[])
            list(opt.stream([[3, 4, 5]], max_new_tokens=3, eos_token_id=[]))
        assert opt._lowered() is programs


@needs_onednn
def test_copies_that_would_not_fit_in_memory_are_not_made(monkeypatch, tmp_path):
    """Packed copies sit beside the weights: past half the available memory the programs
    keep ``F.linear`` (unless packing is forced on)."""
    import rewriter
    from conftest import make_model
    monkeypatch.setattr(packed_linear, "_PAYS", {**packed_linear._PAYS, "bfloat16": True})
    model = make_model("llama-gqa-3l").to(torch.bfloat16)
    # what the copies need: every linear's weight (the token embedding is no linear's)
    need = sum(t.nbytes for n, t in model.named_parameters() if t.dim() == 2 and "embed" not in n)
    info = tmp_path / "meminfo"
    for available_kb, env, packs in ((need // 1024, "auto", False),  # half of it is room for half
                                     (3 * need // 1024, "auto", True),
                                     (need // 1024, "on", True)):
        info.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_kb} kB\n")
        monkeypatch.setattr(memory, "MEMINFO", str(info))
        monkeypatch.setattr(memory, "CGROUP", str(tmp_path / "no-cgroup"))  # whatever the machine's
        monkeypatch.setenv(packed_linear.ENV, env)
        decode = lower(rewriter.optimize(model).ir, False, "torch", {})
        assert (packed_linear.linear_packed in _targets(decode)) is packs, (available_kb, env)
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "missing"))  # not Linux
    monkeypatch.setenv(packed_linear.ENV, "auto")
    assert packed_linear.room_for(10 ** 15)
