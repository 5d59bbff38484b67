"""Lowering: the IR graph becomes a program the runtime calls once per step.

The program is an ``fx.GraphModule`` over the same weights, with
- every ``rw`` op replaced by its plain-function kernel (no custom-op dispatch),
- every ``rw.attention`` replaced by ``cached_attention`` on its cache (an IR that
  computes across positions anywhere else is refused: ``rewriter.ir.cacheable``),
- an extra first input, ``step`` (cache, write position, masks),
- weights under flat names (``self.w12``, not ``self.model.layers[1]...``): nested
  module lookups cost more than the math of a one-token step,
- optionally only the last position's logits: prefill needs no more, and the
  ``[B, S, vocab]`` head is the largest matmul of a long prompt.
"""
from __future__ import annotations

import dataclasses
import operator
import os
from collections import Counter

import torch
from torch import fx

from rewriter.errors import RewriterError
from rewriter.ir.cacheable import check_cacheable
from rewriter.ir.core import IR
from rewriter.maths.int4 import dequantize
from rewriter.ops import OPS, op_arguments

from .attention import cached_attention
from .collectives import with_collectives
from .kernels import KERNELS, int4_cpu_ok, int4_cpu_tables, linear_int4_cpu, linear_t
from .kv_cache import CacheSpec, attention_params, cache_spec
from . import memory, packed_linear
from .page_selection import select_pages
from .token_selection import select_tokens

SHORT = {op: name for name, op in OPS.items()}  # rw op -> its name in the op table


def lower(ir: IR, last_only: bool, backend: str = "torch",
          transposed: dict | None = None, kernel_sources: dict | None = None,
          hidden: bool | str = False) -> fx.GraphModule:
    """The step program ``(step, input_ids, positions) -> logits`` of a causal-LM IR
    (``-> (logits, h)`` with ``hidden``: ``h`` the LM head's input, for draft heads, at
    every position with ``hidden="all"`` even where the logits are the last's; an IR
    that returns more than the logits, ``(logits, draft)``, gives its logits here);
    ``backend`` picks the kernels (``torch``: ``runtime.kernels``; ``triton``:
    ``runtime.triton_backend``). With ``transposed`` (a dict the caller keeps, shared by
    its programs), linears on CPU weights read ``[in, out]`` copies (``linear_t``).
    ``kernel_sources`` (name -> source) replaces generated kernels' sources: an artifact's
    stored kernels, used only when its loader said ``trust_code=True``."""
    table, attention = kernel_table(backend)
    table = with_collectives(ir, table)  # a rank's sums over ranks
    if not ir.is_causal_lm:
        raise RewriterError("the KV-cache runtime runs causal language models only; "
                            "call the optimized module directly instead")
    check_cacheable(ir)  # attention it could not cache would give wrong tokens, silently
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    step = graph.placeholder("step")
    order, generated = list(ir.graph.nodes), []
    cast = _table_caster(graph, env)
    written = _Writers(ir.gm)
    if backend == "triton":  # pointwise groups no template covers become generated kernels
        from rewriter.codegen.partition import pointwise_groups, schedule
        order = schedule(ir.gm, pointwise_groups(ir.gm))
    for node in order:
        if isinstance(node, list):
            generated.append(_generated_call(graph, node, env, len(generated), kernel_sources or {}))
        elif node.op == "output":
            graph.output(_output(ir, graph, env, last_only, hidden))
        else:
            env[node] = _lower_node(graph, node, env, step, backend, table, attention, cast,
                                    written)
    graph.eliminate_dead_code()
    if any(n.target is table["next_tokens"] for n in graph.nodes):
        # later positions' tokens: right on a whole sequence, wrong in a cached step
        raise RewriterError("rw.next_tokens reads the tokens after each position; only draft "
                            "heads may use it (their programs take the path as an input)")
    program = program_on_weights(ir, graph, table, backend, transposed)
    program.generated_kernels = generated  # for dumps and artifacts
    return program


def _output(ir: IR, graph: fx.Graph, env: dict, last_only: bool, hidden: bool | str):
    """The program's result: the logits (the last position's with ``last_only``), with the
    LM head's input beside them when ``hidden`` asks for it."""
    out = logits_node(ir)
    result = env[out]
    every = result.args[0] if result.op == "call_function" and result.args else None
    if last_only:
        result = _last_position_logits(graph, out, env)
    if not hidden:
        return result
    if SHORT.get(out.target) != "linear":
        raise RewriterError("draft heads need the logits to come from a linear LM head")
    # h at every position with "all" (an EAGLE draft catches up over the prompt)
    return result, every if hidden == "all" else result.args[0]


def _lower_node(graph: fx.Graph, node: fx.Node, env: dict, step: fx.Node, backend: str,
                table: dict, attention, cast, written: "_Writers") -> fx.Node:
    """``node``'s copy in the program: an ``rw`` op calls its kernel, attention and the
    token selections read the cache through ``step``."""
    new = graph.node_copy(node, lambda n: env[n])
    name = SHORT.get(node.target) if node.op == "call_function" else None
    if name == "attention":
        _lower_attention(new, node, env, step, backend, attention, cast, written)
    elif name in SELECTIONS:  # reads its layer's cache: the step is an input
        kernel, keywords = SELECTIONS[name]
        p = op_arguments(name, tuple(node.args), dict(node.kwargs))
        new.target = kernel
        new.args = (step, env[node.args[0]], env[node.args[1]], p["layer"])
        new.kwargs = {k: p[k] for k in keywords}
    elif name is not None:
        new.target = table[name]
        if name == "rope" and backend == "torch":
            new.args = (new.args[0], cast(node.args[1], node.args[0]),
                        cast(node.args[2], node.args[0]), *new.args[3:])
    return new


# op -> (its kernel, the attributes it takes by keyword): TidalDecode's, Quest's selections
SELECTIONS = {
    "select_tokens": (select_tokens, ("num_heads", "num_kv_heads", "head_dim", "top_k", "recent")),
    "select_pages": (select_pages, ("num_heads", "num_kv_heads", "head_dim", "page", "budget",
                                    "recent")),
}


class _Writers:
    """Which attention op of a program writes each cache: the first that names it (the
    owner, or, in a draft that skips the owner, its first reader: the same k and v,
    ``ir.sharing``); the others read it (``CacheSpec.write``), and each knows whether a
    later one reads it too (``CacheSpec.read_after``)."""

    def __init__(self, gm: fx.GraphModule):
        self.left = Counter(cache_spec(n).id for n in gm.graph.find_nodes(
            op="call_function", target=OPS["attention"]))  # ops yet to lower, per cache
        self.written: set = set()

    def spec(self, node: fx.Node) -> CacheSpec:
        """``node``'s cache attributes as this program lowers them (in graph order)."""
        spec = cache_spec(node)
        first = spec.id not in self.written
        self.written.add(spec.id)
        self.left[spec.id] -= 1
        # a merged pair's second layer (MiniCache) writes too: it merges its K/V in
        return dataclasses.replace(spec, write=first or spec.merge is not None,
                                   read_after=self.left[spec.id] > 0)


def _lower_attention(new: fx.Node, node: fx.Node, env: dict, step: fx.Node, backend: str,
                     attention, cast, written: _Writers) -> None:
    """``rw.attention`` -> ``attention(step, q, k, v, spec, ...)`` on its layer's cache:
    ``spec`` its attributes as one ``CacheSpec`` (a constant of the program, see
    ``_spec_constants``), the sink positions, selection and rope tables by keyword; of the
    ops sharing a cache, ``written`` says which writes it."""
    params = attention_params(node)
    # by name, whether an artifact passed them by position or by keyword
    bound = op_arguments("attention", tuple(node.args), dict(node.kwargs))
    if not params["causal"]:
        raise RewriterError(f"{node.name}: the runtime needs causal attention")
    new.target = attention
    q, k, v = (env[a] for a in node.args[:3])
    spec = written.spec(node)
    new.args = (step, q, k, v, spec)
    kwargs = {}
    if params["sinks"] is not None and bound["rotary"] is not None:
        kwargs["rotary"] = env[bound["rotary"]]  # StreamingLLM's sink positions
    if bound["select"] is not None:  # TidalDecode, Quest: the selected tokens
        kwargs["select"] = env[bound["select"]]
    if bound["cos"] is not None:  # FuseRoPE: rotate inside attention
        cos, sin = bound["cos"], bound["sin"]
        if backend == "torch":  # the Triton kernels read float32 tables
            kwargs["cos"], kwargs["sin"] = cast(cos, node.args[0]), cast(sin, node.args[0])
        else:
            kwargs["cos"], kwargs["sin"] = env[cos], env[sin]
    new.kwargs = kwargs


def kernel_table(backend: str) -> tuple[dict, object]:
    """``(kernels by op name, cached attention)`` of ``backend`` (``torch``:
    ``runtime.kernels``; ``triton``: ``runtime.triton_backend``)."""
    if backend == "triton":
        from . import triton_backend
        return triton_backend.kernels()
    return KERNELS, cached_attention


def program_on_weights(ir: IR, graph: fx.Graph, table: dict, backend: str,
                       transposed: dict | None, extra: dict | None = None) -> fx.GraphModule:
    """The program of a lowered ``graph``: int4 linears lowered, weights read as the
    backend reads them fastest (transposed, packed: shared through ``transposed``), dead
    code removed, weights under flat names. ``extra``: derived weights the graph reads
    already (``transposed`` itself when given)."""
    extra = extra if extra is not None else transposed if transposed is not None else {}
    _lower_int4(ir, graph, table["linear_int4"], extra)
    if transposed is not None and backend == "torch":
        _transpose_linear_weights(ir, graph, transposed)
        _pack_linear_weights(ir, graph, transposed)
    graph.eliminate_dead_code()
    attributes = _flatten_weights(ir, graph, extra)
    attributes.update(_spec_constants(graph))
    return fx.GraphModule(attributes, graph)


def _spec_constants(graph: fx.Graph) -> dict[str, CacheSpec]:
    """Each ``CacheSpec`` argument becomes an attribute of the program (``self.cache3``),
    read once per step: written into the code, it was built anew by every attention call
    of every step. Returns the name -> spec map."""
    names: dict[CacheSpec, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or not any(isinstance(a, CacheSpec) for a in node.args):
            continue
        args = list(node.args)
        for i, spec in enumerate(args):
            if isinstance(spec, CacheSpec):
                name = names.setdefault(spec, f"cache{spec.id}" if f"cache{spec.id}" not in
                                        names.values() else f"cache{spec.id}_{len(names)}")
                with graph.inserting_before(node):
                    args[i] = graph.get_attr(name)
        node.args = tuple(args)
    return {name: spec for spec, name in names.items()}


def program_code(program: fx.GraphModule) -> str:
    """``program``'s Python code, headed by the value of each cache spec it reads."""
    specs = [f"# self.{name} = {value!r}" for name, value in vars(program).items()
             if isinstance(value, CacheSpec)]
    return "\n".join(specs) + program.code if specs else program.code


def logits_node(ir: IR) -> fx.Node:
    """The node of the logits: the graph's output, or its first value (``(logits, draft)``)."""
    (out,) = ir.graph.find_nodes(op="output")
    value = out.args[0]
    return value[0] if isinstance(value, (tuple, list)) else value


def _table_caster(graph: fx.Graph, env: dict):
    """``cast(table, x)``: the lowered cos/sin ``table`` in ``x``'s dtype, converted once
    per step instead of by every rope of every layer (the reference rope converts it to
    ``x``'s dtype first, so the values are the same)."""
    done: dict = {}

    def cast(table: fx.Node, x: fx.Node) -> fx.Node:
        want = x.meta["val"].dtype if "val" in x.meta else None
        have = table.meta["val"].dtype if "val" in table.meta else None
        if want is None or want == have:
            return env[table]
        if (table, want) not in done:
            with graph.inserting_after(env[table]):
                done[table, want] = graph.call_method("to", (env[table], want))
        return done[table, want]
    return cast


def _generated_call(graph: fx.Graph, group: list, env: dict, index: int, sources: dict):
    """One call of a generated Triton kernel in place of a pointwise group."""
    import dataclasses
    from rewriter.codegen.pointwise import Launcher, generate
    kernel = generate(group, index)
    if kernel.name in sources:
        kernel = dataclasses.replace(kernel, source=sources[kernel.name])
    call = graph.call_function(Launcher(kernel), tuple(env[a] for a in kernel.inputs))
    if len(kernel.outputs) == 1:
        env[kernel.outputs[0]] = call
    else:
        for i, out in enumerate(kernel.outputs):
            env[out] = graph.call_function(operator.getitem, (call, i))
    return kernel


def _transpose_linear_weights(ir: IR, graph: fx.Graph, transposed: dict) -> None:
    """``linear(x, W, b)`` -> ``linear_t(x, W^T, b)`` for 2-d float32 CPU weights (see
    ``linear_t``), where the copies fit in memory (``_fitting``) or
    ``REWRITER_TRANSPOSED_LINEAR`` says so."""
    def weight(target: str) -> torch.Tensor:
        return transposed[target] if target in transposed else ir.weight(target)

    # bfloat16 streams faster untransposed (measured: docs/history/benchmarks-notebook.md)
    setting = _transposed_setting()
    nodes = [n for n in graph.find_nodes(op="call_function", target=KERNELS["linear"])
             if n.args[1].op == "get_attr" and _transposable(weight(n.args[1].target))]
    # "off" is a refusal like a full memory's: the model's programs all read F.linear
    room = {"on": lambda nbytes: True, "off": lambda nbytes: False}.get(setting, memory.room_for)
    for node in _fitting(nodes, transposed, weight, ".__transposed", _transposed, room):
        w = node.args[1]
        name = w.target + ".__transposed"
        if name not in transposed:
            transposed[name] = _transposed(weight(w.target))  # [in, out]
        with graph.inserting_before(node):
            node.args = (node.args[0], graph.get_attr(name), *node.args[2:])
        node.target = linear_t


TRANSPOSED_ENV = "REWRITER_TRANSPOSED_LINEAR"


def _transposed_setting() -> str:
    """``REWRITER_TRANSPOSED_LINEAR``: ``auto`` (copies where they fit), ``on`` (copies
    whatever memory is left: a machine whose available memory reads low, wrongly), ``off``
    (never: the weights' memory once, ``F.linear``'s speed)."""
    setting = os.environ.get(TRANSPOSED_ENV, "auto").strip().lower()
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"{TRANSPOSED_ENV} must be auto, on or off, got {os.environ[TRANSPOSED_ENV]!r}")
    return setting


def _transposable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and not weight.is_cuda and weight.dtype == torch.float32


def _fitting(nodes: list, derived: dict, weight, suffix: str, copies: memory.Copies, room) -> list:
    """The linears (``nodes``) that read derived copies (``suffix``): all of them where the
    copies not yet made fit (``room(bytes)``). Where they do not, only those whose copy an
    earlier program of the model already reads; the refusal is kept in ``derived`` (shared
    by the model's programs), so that no later program makes a copy either, and a weight
    is read the same way by every program (prefill, decode, verify)."""
    refused = ("refused", suffix)  # no weight's name: a tuple
    if not derived.get(refused):
        copies.sweep()
        targets = {n.args[1].target for n in nodes if n.args[1].target + suffix not in derived}
        new = {id(w): w for w in map(weight, targets) if not copies.has(w)}  # tied weights once
        if room(sum(w.nbytes for w in new.values())):
            return nodes
        derived[refused] = True
    return [n for n in nodes if n.args[1].target + suffix in derived]


def _pack_linear_weights(ir: IR, graph: fx.Graph, derived: dict) -> None:
    """``linear(x, W, b)`` -> ``linear_packed(x, pack(W), b)`` for 2-d bfloat16 CPU weights,
    where packing pays on this machine (``runtime.packed_linear``) and the copies fit in
    memory (``_fitting``)."""
    def weight(target: str) -> torch.Tensor:
        return derived[target] if target in derived else ir.weight(target)

    nodes = [n for n in graph.find_nodes(op="call_function", target=KERNELS["linear"])
             if n.args[1].op == "get_attr" and packed_linear.supported(weight(n.args[1].target))]
    if not nodes or not packed_linear.pays():
        return
    for node in _fitting(nodes, derived, weight, ".__packed", packed_linear.pack, packed_linear.room_for):
        w = node.args[1]
        name = w.target + ".__packed"
        if name not in derived:
            derived[name] = packed_linear.pack(weight(w.target))
        with graph.inserting_before(node):
            node.args = (node.args[0], graph.get_attr(name), *node.args[2:])
        node.target = packed_linear.linear_packed


# a float32 weight transposed, ``[in, out]``, made once per weight and version
_transposed = memory.Copies(lambda weight: weight.t().contiguous())


def _lower_int4(ir: IR, graph: fx.Graph, target, extra: dict) -> None:
    """``rw.linear_int4`` -> the CPU int4 kernel where it applies (bfloat16, CPU), else a
    dense ``linear`` over the weight dequantized once here: the same values, no saving.
    The derived tables go into ``extra`` (shared by a model's programs)."""
    for node in list(graph.find_nodes(op="call_function", target=target)):
        args = op_arguments("linear_int4", tuple(node.args), dict(node.kwargs))
        names = [args[k].target for k in ("codes", "scales", "mins")]
        codes, scales, mins = (ir.weight(n) for n in names)
        group = args["group_size"]
        fast = int4_cpu_ok(codes, scales, group)
        derived = [names[0] + ".__int4_packed", names[0] + ".__int4_scale_zeros"] if fast \
            else [names[0] + ".__dequantized"]
        if derived[0] not in extra:
            tables = int4_cpu_tables(codes, scales, mins) if fast else \
                (dequantize(codes, scales, mins, group).to(scales.dtype),)
            extra.update(zip(derived, tables))
        with graph.inserting_before(node):
            reads = tuple(graph.get_attr(n) for n in derived)
        if fast:
            node.target, node.args = linear_int4_cpu, (args["x"], *reads, group, args["bias"])
        else:
            node.target, node.args = KERNELS["linear"], (args["x"], *reads, args["bias"])
        node.kwargs = {}


def _flatten_weights(ir: IR, graph: fx.Graph, extra: dict) -> dict:
    """Rename every weight read to a flat attribute; returns the name -> tensor map."""
    weights, flat = {}, {}
    for node in graph.find_nodes(op="get_attr"):
        if node.target not in flat:
            flat[node.target] = f"w{len(flat)}"
            weights[flat[node.target]] = extra[node.target] if node.target in extra else ir.weight(node.target)
        node.target = flat[node.target]
    return weights


def _last_position_logits(graph: fx.Graph, out: fx.Node, env: dict) -> fx.Node:
    """Logits of the last position only, ``[B, 1, vocab]``.

    When the output is the LM head (a linear), its input is sliced to the last position
    first, so the head runs on one row per sequence; otherwise the logits are sliced.
    """
    last = (slice(None), slice(-1, None))  # [:, -1:]
    head = env[out]
    if out.op == "call_function" and SHORT.get(out.target) == "linear":
        with graph.inserting_before(head):
            x = graph.call_function(operator.getitem, (head.args[0], last))
        head.args = (x, *head.args[1:])
        return head
    return graph.call_function(operator.getitem, (head, last))
