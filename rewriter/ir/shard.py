"""Tensor parallelism's split of an IR: the slice of each weight a rank holds, and the
rank's own IR.

A *region* is what lies between the residual stream and one row-parallel projection:
an attention (q, k, v by columns, heads split by KV group, o by rows) or an MLP (gate, up
or fc by columns, down or proj by rows), Megatron's split. Starting at the row-parallel
projection's input, the walk goes back through the ops between (rope, attention, the
activations, a per-head QK-norm, a fused projection's split) to the column-parallel
projections, and gives every value on the way the features this rank keeps: a tuple of
``(start, end)`` ranges of the whole value's last dimension. The same walk serves the pass (which checks every rank's
split before changing anything) and each rank at load (which takes its slices), so an
artifact stores whole weights and the pass, never a rank's shard.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from functools import reduce

import torch
from torch import fx

from rewriter.errors import PassError
from rewriter.ir.core import IR, add_weight
from rewriter.ir.nodes import attention_args, is_op
from rewriter.ops import OPS, op_arguments, short_name

Ranges = tuple[tuple[int, int], ...]
SELECTIONS = ("select_tokens", "select_pages")  # TidalDecode's, Quest's: per KV head
ELEMENTWISE = ("silu", "gelu")
ROW_SUMS = ("all_reduce", "all_reduce_add_rms_norm")  # their x is a region's output


class ShardError(PassError):
    """The IR cannot be split over the ranks asked for: the message names the op and why."""


@dataclasses.dataclass
class RankPlan:
    """What rank ``rank`` of ``world`` holds: each weight's slice (``weights``: name ->
    ``(dim, ranges)``; ``dim`` 1 for a row-parallel projection's columns), the biases
    only rank 0 adds (``rank0_bias``), and the new attributes of the ops whose heads or
    widths it splits (``attributes``: node name -> {argument: value})."""
    rank: int
    world: int
    weights: dict = dataclasses.field(default_factory=dict)
    rank0_bias: set = dataclasses.field(default_factory=set)
    attributes: dict = dataclasses.field(default_factory=dict)

    def slice_weight(self, name: str, dim: int, ranges: Ranges, where: fx.Node) -> None:
        if self.weights.setdefault(name, (dim, ranges)) != (dim, ranges):
            raise ShardError(f"{where.name}: the weight {name} is read by two ops that "
                             f"would split it differently; tensor parallelism needs each "
                             f"weight split one way")


def split_units(units: int, world: int) -> list[tuple[int, int]]:
    """``units`` (KV groups, aligned MLP blocks) over ``world`` ranks, contiguous, the first
    ``units % world`` ranks one more: 3 KV heads on 2 ranks -> [(0, 2), (2, 3)]."""
    base, extra = divmod(units, world)
    bounds, start = [], 0
    for r in range(world):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


def row_projections(ir: IR) -> list[fx.Node]:
    """The row-parallel projections of a model not yet split: each attention's output
    projection, and each MLP's last projection (an ``mlp`` linear whose users are not)."""
    rows = []
    for node in ir.graph.nodes:
        if is_op(node, "attention"):
            users = list(node.users)
            if len(users) != 1 or not _is_linear(users[0]) or users[0].args[0] is not node:
                raise ShardError(f"{node.name} (layer {node.meta.get('layer')}): its output "
                                 f"feeds {[u.name for u in users]}, not one output projection")
            rows.append(users[0])
        elif _is_linear(node) and node.meta.get("role") == "mlp" \
                and not any(u.meta.get("role") == "mlp" for u in node.users):
            rows.append(node)
    return rows


def summed(ir: IR) -> list[fx.Node]:
    """The row-parallel projections of a split IR: the inputs of its sums over ranks."""
    return [op_arguments(short_name(n.target)[3:], tuple(n.args), dict(n.kwargs))["x"]
            for n in _sums(ir)]


def _sums(ir: IR) -> list[fx.Node]:
    return [n for n in ir.graph.nodes
            if n.op == "call_function" and short_name(n.target)[3:] in ROW_SUMS]


def check_split(ir: IR) -> None:
    """A split IR's sums agree with its ``info["tensor_parallel"]`` (an IR with sums and no
    split recorded, or sums over another number of ranks, would run other arithmetic than
    the model's), and every rank's split can still be made: a pass after
    ``TensorParallel`` that changed what lies between the projections is refused here, by
    name, rather than on the ranks. ``ShardError`` says which and why."""
    tp = ir.info.get("tensor_parallel")
    sums = _sums(ir)
    _check_sums(tp, sums)
    if tp is None or "rank" in tp:
        return  # not split, or one rank's shard: already cut
    world, rows = tp["world_size"], summed(ir)
    for row in rows:  # a partial sum read anywhere but by its sum would leak a rank's part
        if not _is_linear(row) or any(u not in sums for u in row.users):
            raise ShardError(f"{row.name} is summed over ranks but is not a projection read "
                             f"by its sum alone: {[u.name for u in row.users]}")
    for rank in range(world):
        try:
            plan(ir, rows, rank, world)
        except ShardError as e:
            raise ShardError(f"TensorParallel(world_size={world}): {e}") from None


def _check_sums(tp, sums: list[fx.Node]) -> None:
    if tp is None:
        if sums:
            raise ShardError(f"{sums[0].name} sums over ranks, but the IR records no tensor-"
                             f"parallel split (info 'tensor_parallel'): only TensorParallel "
                             f"inserts sums")
        return
    world = tp["world_size"]
    if not sums:
        raise ShardError(f"the IR records a split over {world} ranks (info 'tensor_parallel') "
                         f"but sums over none: it would run each rank's part alone")
    for n in sums:
        size = op_arguments(short_name(n.target)[3:], tuple(n.args), dict(n.kwargs))["world_size"]
        if size != world:
            raise ShardError(f"{n.name} sums over {size} ranks, but the IR is split over "
                             f"{world} (info 'tensor_parallel')")


def plan(ir: IR, rows: list[fx.Node], rank: int, world: int) -> RankPlan:
    """Rank ``rank``'s slices of every region ending at one of ``rows``."""
    p = RankPlan(rank, world)
    sliced, allowed = {}, set(rows)
    for row in rows:
        walk = _Walk(ir, p)
        walk.region(row)
        sliced.update(walk.ranges)
        allowed.update(walk.splits)
    _check_readers(sliced, allowed | set(sliced))
    return p


def _check_readers(sliced: dict, allowed: set) -> None:
    """Every value a rank holds a slice of is read only inside the regions (or by its row
    projection): a reader elsewhere would see this rank's slice as if it were the whole."""
    for node in sliced:
        for user in node.users:
            if user not in allowed:
                raise ShardError(f"{user.name} reads {node.name}, of which each rank holds only "
                                 f"a slice (it lies between a column- and a row-parallel "
                                 f"projection)")


class _Walk:
    def __init__(self, ir: IR, p: RankPlan):
        self.ir, self.p, self.ranges = ir, p, {}
        self.splits: dict[fx.Node, dict[int, Ranges]] = {}

    def region(self, row: fx.Node) -> None:
        x = _linear_input(row)
        width = x.meta["val"].shape[-1]
        attn = x if is_op(x, "attention") else None
        if attn is not None:
            keep = self._heads(attn)[0]
        else:
            keep = self._mlp_block(row, width)
        self._row(row, keep)
        self._push(x, keep)

    def _heads(self, attn: fx.Node) -> tuple[Ranges, Ranges]:
        """(q features, k/v features) of this rank's KV groups, and the attention's new
        attributes."""
        a = attention_args(attn)
        (g0, g1), counts, q_keep, kv_keep = self._head_share(a, attn)
        self._attributes(attn, {**counts, **_per_head(a, g0, g1, attn)})
        return q_keep, kv_keep

    def _head_share(self, a: dict, node: fx.Node) -> tuple:
        """This rank's KV groups ``(g0, g1)`` of an op with ``num_heads``, ``num_kv_heads``,
        ``head_dim`` (attention, a selection): the groups, its head counts, its q features
        and its k/v features."""
        groups, d = a["num_kv_heads"], a["head_dim"]
        rep = a["num_heads"] // groups
        if groups < self.p.world:
            raise ShardError(f"{node.name} (layer {a['layer']}) has {groups} KV heads; each "
                             f"of {self.p.world} ranks needs a whole one, so at most {groups} "
                             f"ranks can split it")
        g0, g1 = split_units(groups, self.p.world)[self.p.rank]
        counts = {"num_heads": (g1 - g0) * rep, "num_kv_heads": g1 - g0}
        return (g0, g1), counts, ((g0 * rep * d, g1 * rep * d),), ((g0 * d, g1 * d),)

    def _mlp_block(self, row: fx.Node, width: int) -> Ranges:
        """This rank's contiguous share of an MLP's ``width`` features, in blocks a 4-bit
        projection's groups (and two codes a byte) stay whole in."""
        align = 1
        for node in [row, *_column_projections(row)]:
            if is_op(node, "linear_int4"):
                align = math.lcm(align, op_arguments("linear_int4", node.args, node.kwargs)["group_size"], 2)
        if width % align or width // align < self.p.world:
            why = " (4-bit groups of Int4Weights)" if align > 1 else ""
            raise ShardError(f"{row.name} (layer {row.meta.get('layer')}): {width} features "
                             f"do not split into {self.p.world} shares of whole blocks of "
                             f"{align}{why}")
        u0, u1 = split_units(width // align, self.p.world)[self.p.rank]
        return ((u0 * align, u1 * align),)

    def _attributes(self, node: fx.Node, new: dict) -> None:
        if self.p.attributes.setdefault(node.name, new) != new:
            raise ShardError(f"{node.name}: two regions split its heads differently")

    def _push(self, node: fx.Node, keep: Ranges) -> None:
        """Give ``node``'s value the features ``keep``, then walk back to its inputs."""
        if node in self.ranges:
            if self.ranges[node] != keep:
                raise ShardError(f"{node.name}: two ops need different slices of it")
            return
        self.ranges[node] = keep
        name = short_name(node.target)[3:] if node.op == "call_function" else None
        if name in ("linear", "linear_int4"):
            self._column(node, keep)
        elif name == "attention":
            self._attention_inputs(node)
        elif name in SELECTIONS:
            self._selection(node)
        elif name in ("rope", *ELEMENTWISE):
            self._push(node.args[0], keep)
        elif name == "head_rms_norm":
            self._head_norm(node, keep)
        elif name == "swiglu":
            half = node.meta["val"].shape[-1]
            self._push(node.args[0], keep + tuple((a + half, b + half) for a, b in keep))
        elif node.op == "call_function" and node.target is torch.ops.aten.mul.Tensor \
                and all(isinstance(a, fx.Node) for a in node.args):
            for a in node.args:
                self._push(a, keep)
        elif node.op == "call_function" and node.target is operator.getitem \
                and _is_split(node.args[0]):
            self._split_part(node, keep)
        else:
            raise ShardError(f"{node.name} ({short_name(node.target) if node.op == 'call_function' else node.op}, "
                             f"layer {node.meta.get('layer')}) lies between a column- and a "
                             f"row-parallel projection, and tensor parallelism does not know "
                             f"how to split it")

    def _attention_inputs(self, attn: fx.Node) -> None:
        q_keep, kv_keep = self._heads(attn)
        a = attention_args(attn)
        self._push(a["q"], q_keep)
        self._push(a["k"], kv_keep)
        self._push(a["v"], kv_keep)
        if isinstance(a["select"], fx.Node):
            self._push(a["select"], ())  # per KV head: its own attributes, its q and k

    def _selection(self, node: fx.Node) -> None:
        name = short_name(node.target)[3:]
        a = op_arguments(name, tuple(node.args), dict(node.kwargs))
        _, counts, q_keep, kv_keep = self._head_share(a, node)
        self._attributes(node, counts)
        self._push(a["q"], q_keep)
        self._push(a["k"], kv_keep)

    def _head_norm(self, node: fx.Node, keep: Ranges) -> None:
        """A QK-norm normalises each head alone with one weight ``[D]`` for every head: a
        rank keeping whole heads normalises them as the model does, with the whole weight."""
        d = op_arguments("head_rms_norm", tuple(node.args), dict(node.kwargs))["head_dim"]
        if any(a % d or b % d for a, b in keep):
            raise ShardError(f"{node.name} (layer {node.meta.get('layer')}) normalises heads of "
                             f"{d} features, but rank {self.p.rank} would keep {list(keep)}, "
                             f"not whole heads")
        self._push(node.args[0], keep)

    def _split_part(self, part: fx.Node, keep: Ranges) -> None:
        """Part ``i`` of a fused projection's split: once every used part is known, the
        fused value keeps the parts' features at their offsets, and the split new sizes."""
        split = part.args[0]
        src, sizes = split.args[0], list(split.args[1])
        known = self.splits.setdefault(split, {})
        if known.setdefault(part.args[1], keep) != keep:
            raise ShardError(f"{part.name}: two reads of part {part.args[1]} of {split.name} "
                             f"need different slices of it")
        used = {u.args[1] for u in split.users}
        if set(self.splits[split]) != used:
            return  # the other parts come later in this walk
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        whole, new_sizes = [], []
        for i, size in enumerate(sizes):
            part_keep = self.splits[split].get(i, ())
            whole += [(a + offsets[i], b + offsets[i]) for a, b in part_keep]
            new_sizes.append(sum(b - a for a, b in part_keep))
        self._attributes(split, {"split_sizes": new_sizes})
        self._push(src, tuple(whole))

    def _column(self, node: fx.Node, keep: Ranges) -> None:
        """A column-parallel projection: its rows (and bias) ``keep``."""
        args = _linear_args(node)
        for key in ("weight", "codes", "scales", "mins", "bias"):
            if isinstance(args.get(key), fx.Node):
                self.p.slice_weight(args[key].target, 0, keep, node)

    def _row(self, row: fx.Node, keep: Ranges) -> None:
        """A row-parallel projection: its columns ``keep`` (codes two to a byte, one scale
        and minimum per group); its bias added by rank 0 alone, so the sum holds it once."""
        args = _linear_args(row)
        if "weight" in args:
            self.p.slice_weight(args["weight"].target, 1, keep, row)
        else:
            g = args["group_size"]
            if any(a % g or b % g for a, b in keep):
                raise ShardError(f"{row.name} ({args['codes'].target}): rank "
                                 f"{self.p.rank}'s columns {list(keep)} are not whole 4-bit "
                                 f"groups of {g} (Int4Weights): a group would straddle two "
                                 f"ranks; use a group size that divides each rank's share")
            self.p.slice_weight(args["codes"].target, 1, tuple((a // 2, b // 2) for a, b in keep), row)
            for key in ("scales", "mins"):
                self.p.slice_weight(args[key].target, 1, tuple((a // g, b // g) for a, b in keep), row)
        if isinstance(args.get("bias"), fx.Node) and self.p.rank != 0:
            self.p.rank0_bias.add(args["bias"].target)


def _per_head(a: dict, g0: int, g1: int, attn: fx.Node) -> dict:
    """DuoAttention's per-KV-head choices, for the heads ``[g0, g1)`` a rank keeps: its
    full heads renumbered, its gates; a rank left with only full heads attends fully, one
    with none streams them all."""
    new = {}
    if a["gates"] is not None:
        new["gates"] = list(a["gates"][g0:g1])
    if a["full_heads"] is not None:
        full = [h - g0 for h in a["full_heads"] if g0 <= h < g1]
        if len(full) == g1 - g0:
            # a layer reading another's cache (ShareKV) has its owner's full heads: the
            # owner attends fully on this rank too, so their caches stay alike
            if a["window"] is not None and a["merge_with"] is None:
                new.update(full_heads=None, sinks=None, window=None, rotary=None, gates=None)
            else:
                raise ShardError(f"{attn.name}: every head this rank keeps attends fully "
                                 f"(DuoAttention), but the layer's other settings (a cache "
                                 f"merged by MiniCache) need a ring")
        else:
            new["full_heads"] = full or None
    return new


def _is_linear(node) -> bool:
    return is_op(node, "linear") or is_op(node, "linear_int4")


def _is_split(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" \
        and node.target is torch.ops.aten.split_with_sizes.default \
        and node.args[2:] in ((-1,), (2,))


def _linear_args(node: fx.Node) -> dict:
    return op_arguments(short_name(node.target)[3:], tuple(node.args), dict(node.kwargs))


def _linear_input(node: fx.Node) -> fx.Node:
    return _linear_args(node)["x"]


def _column_projections(row: fx.Node) -> list[fx.Node]:
    """The projections feeding ``row`` through elementwise ops (its MLP's gate, up, fc)."""
    found, stack, seen = [], [_linear_input(row)], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or n.meta.get("role") != "mlp":
            continue
        seen.add(n)
        if _is_linear(n):
            found.append(n)
        elif n.op == "call_function":
            stack.extend(a for a in n.args if isinstance(a, fx.Node))
    return found


def shard(ir: IR, rank: int) -> IR:
    """Rank ``rank``'s IR of a model ``TensorParallel`` split: its slices of the weights,
    its heads' attributes, the sums over ranks kept (the runtime lowers them to
    collectives). ``info["tensor_parallel"]`` gains ``rank``."""
    world = ir.info["tensor_parallel"]["world_size"]
    if not 0 <= rank < world:
        raise ShardError(f"rank {rank} is not one of the {world} ranks this model is split for")
    p = plan(ir, summed(ir), rank, world)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(ir.graph, env))
    for old, new in env.items():
        new.meta = {k: v for k, v in old.meta.items() if k not in ("val", "shape")}
        if old.name in p.attributes:
            _set_arguments(new, p.attributes[old.name])
        if _is_linear(new) and new.op == "call_function":
            bias = _linear_args(new).get("bias")
            if isinstance(bias, fx.Node) and bias.target in p.rank0_bias:
                _set_arguments(new, {"bias": None})
    root = torch.nn.Module()
    for node in graph.find_nodes(op="get_attr"):
        if not _has(root, node.target):
            whole = ir.weight(node.target)
            add_weight(root, node.target, _sliced(whole, *p.weights.get(node.target, (0, None))))
    graph.eliminate_dead_code()
    gm = fx.GraphModule(root, graph)
    info = {**ir.info, "tensor_parallel": {**ir.info["tensor_parallel"], "rank": rank}}
    out = IR(gm, info)
    out.refresh()
    return out


def _sliced(weight: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    if ranges is None:
        return weight
    return torch.cat([weight.narrow(dim, a, b - a) for a, b in ranges], dim).contiguous()


def _has(root: torch.nn.Module, name: str) -> bool:
    try:
        reduce(getattr, name.split("."), root)
        return True
    except AttributeError:
        return False


def _set_arguments(node: fx.Node, new: dict) -> None:
    """Change ``node``'s named arguments (an ``rw`` op's by schema name; a split's sizes)."""
    if node.target is torch.ops.aten.split_with_sizes.default:
        node.args = (node.args[0], new["split_sizes"], *node.args[2:])
        return
    name = short_name(node.target)[3:]
    schema = [a.name for a in OPS[name]._schema.arguments]
    bound = op_arguments(name, tuple(node.args), dict(node.kwargs))
    bound.update(new)
    positional = len(node.args)
    node.args = tuple(bound[k] for k in schema[:positional])
    node.kwargs = {k: bound[k] for k in schema[positional:] if k in node.kwargs or k in new}
