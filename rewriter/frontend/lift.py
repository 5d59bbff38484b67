"""Lifting: rewrite ATen subgraphs of a traced model into the canonical ``rw`` ops.

Each lifter owns one kind of module (found through the module scope every node carries)
and checks that the region it would replace has the shape it expects: the ops inside, the
number of inputs and outputs, the child modules. A region that does not match is left as
ATen (it still runs) and the reason goes to the lift report; attention and embeddings
left so are also listed (``unlifted_attention``, ``unlifted_embeddings``), because the
KV-cache runtime cannot run them. The mask and position preamble Hugging Face builds from
the sequence length is replaced by an explicit ``positions`` input where the frontend
knows what it means (``frontend/positions.py``); whatever only fed it is dead and removed.
"""
from __future__ import annotations

import operator
from functools import reduce

import torch
from torch import fx, nn

from rewriter.frontend.attention_region import query_scaling, unexpected_math
from rewriter.frontend.fused import gate_up_halves, qkv_proj_rows
from rewriter.frontend.positions import position_offset
from rewriter.frontend.window import attention_window

from rewriter import ops
from rewriter.ops import op_arguments
from rewriter.ir.core import add_weight
from rewriter.frontend.regions import Region, data_ancestors, erase_region, region, scope_of
from rewriter.frontend.trace import Traced

aten = torch.ops.aten
rw = torch.ops.rw

# ATen noise left by export: metadata asserts, aliases, inference-mode dropout.
_NOISE = {aten._assert_tensor_metadata.default}
_IDENTITY = {aten.alias.default, aten.dropout.default, aten.clone.default}
_TO = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default}
_RMS_OPS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.pow.Tensor_Scalar,
            aten.mean.dim, aten.add.Tensor, aten.add.Scalar, aten.rsqrt.default, aten.mul.Tensor,
            aten.type_as.default}
_ATTN_CHILDREN = ({"q_proj", "k_proj", "v_proj", "o_proj"},  # Llama, Qwen2, Mistral
                  {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"},  # Qwen3, Gemma 3
                  {"q_proj", "k_proj", "v_proj", "dense"},  # Phi
                  {"qkv_proj", "o_proj"},  # Phi-3
                  {"q_proj", "k_proj", "v_proj", "out_proj"},  # OPT
                  {"c_attn", "c_proj", "attn_dropout", "resid_dropout"},  # GPT-2
                  {"query_key_value", "dense"})  # GPT-NeoX

# Phi-3's long-context RoPE: Hugging Face picks the short or the long factors for the whole
# call by its largest position, and its generate recomputes the entire KV cache the first
# time the sequence passes original_max_position_embeddings; a cache that keeps the keys it
# has computed cannot give the same tokens from that point on.
_LONGROPE = ("rotary embedding of type 'longrope' is not lifted: Hugging Face switches every "
             "key to the long factors (recomputing its KV cache) once the sequence passes "
             "original_max_position_embeddings, which a KV cache of kept keys cannot do")


class Lifter:
    def __init__(self, traced: Traced):
        self.gm = traced.gm
        self.graph = traced.gm.graph
        self.root = traced.root
        self.prefix = traced.scope_prefix
        self.report: list[str] = []
        self.unlifted_attention: list[str] = []  # module paths
        self.unlifted_embeddings: list[str] = []  # indexed by neither token ids nor positions
        self.tables: list[tuple[fx.Node, fx.Node]] = []  # (cos, sin) of each RoPE table
        self.positions = None
        self.input_ids = None
        self.layer_container = find_layer_container(self.root)

    # -- driver -------------------------------------------------------------------------
    def run(self, causal_lm: bool) -> fx.GraphModule:
        self.remove_noise()
        if causal_lm:
            self.add_positions()
        self.lift_leaf_ops()
        self.split_gate_up()
        for scope, cls in self.scopes():
            if cls == "Conv1D":
                self.lift_conv1d(scope)
            elif cls.endswith("RMSNorm"):
                self.lift_rms_norm(scope)
            elif "GELU" in cls:
                self.lift_gelu(scope, cls)
            elif cls.endswith("ScaledWordEmbedding"):
                self.lift_scaled_embedding(scope)
        if causal_lm:
            for scope, cls in self.scopes():
                if cls.endswith("RotaryEmbedding"):
                    self.lift_rotary(scope)
            self.lift_position_embeddings()
        for scope, cls in self.scopes():
            if cls.endswith("Attention") and not isinstance(self.module(scope), nn.MultiheadAttention):
                if self.lift_attention(scope) is None:
                    self.unlifted_attention.append(scope)
        self.graph.eliminate_dead_code()
        return self.rehome_weights()

    def scopes(self) -> list[tuple[str, str]]:
        seen: dict[str, str] = {}
        for n in self.graph.nodes:
            path, cls = scope_of(n, self.prefix)
            if path and path not in seen:
                seen[path] = cls
        return list(seen.items())

    def module(self, scope: str) -> nn.Module | None:
        try:
            return self.root.get_submodule(scope)
        except AttributeError:
            return None

    # -- clean-up -----------------------------------------------------------------------
    def remove_noise(self) -> None:
        for n in list(self.graph.nodes):
            if n.op != "call_function":
                continue
            if n.target in _NOISE:
                self.graph.erase_node(n)
            elif n.target in _IDENTITY or (n.target in _TO and _same_meta(n, n.args[0])):
                n.replace_all_uses_with(n.args[0])
                self.graph.erase_node(n)

    def add_positions(self) -> None:
        ids = next(iter(self.graph.find_nodes(op="placeholder")))
        ids.name = ids.target = "input_ids"
        with self.graph.inserting_after(ids):
            self.positions = self.graph.placeholder("positions")
        self.positions.meta["val"] = ids.meta.get("val")
        self.input_ids = ids

    # -- single ATen ops ----------------------------------------------------------------
    def lift_leaf_ops(self) -> None:
        for n in list(self.graph.nodes):
            if n.op != "call_function":
                continue
            a = n.args
            if n.target == aten.linear.default:
                self._swap(n, rw.linear, (a[0], a[1], a[2] if len(a) > 2 else None))
            elif n.target == aten.embedding.default:
                self._swap(n, rw.embedding, (a[1], a[0]))
            elif n.target == aten.layer_norm.default:
                eps = a[4] if len(a) > 4 else 1e-5
                self._swap(n, rw.layer_norm, (a[0], a[2] if len(a) > 2 else None,
                                              a[3] if len(a) > 3 else None, eps))
            elif n.target == aten.silu.default:
                self._swap(n, rw.silu, (a[0],))

    def split_gate_up(self) -> None:
        """Each ``gate_up_proj`` linear read as ``chunk(2, -1)`` becomes a gate and an up
        linear (``frontend/fused.py``), each half's rows of the fused weight."""
        for n in list(self.graph.find_nodes(op="call_function", target=rw.linear.default)):
            scope = scope_of(n, self.prefix)[0]
            if not scope.endswith(".gate_up_proj"):
                continue
            halves = gate_up_halves(n)
            x, weight, bias = n.args  # as lift_leaf_ops wrote it
            w = self.tensor(weight)
            if halves is None or w.shape[0] % 2:
                self.skip(scope, "gate_up_proj is not read as chunk(2, -1) of an even width")
                continue
            parent, half = scope[:-len(".gate_up_proj")], w.shape[0] // 2
            b = self.tensor(bias) if bias is not None else None
            for i, (item, name) in enumerate(zip(halves, ("gate_proj", "up_proj"))):
                rows = slice(i * half, (i + 1) * half)  # [I, hidden] of the [2 * I, hidden]
                wi = self.weight(f"{parent}.{name}.weight", w[rows].contiguous())
                bi = self.weight(f"{parent}.{name}.bias", b[rows].contiguous()) if b is not None else None
                lin = self.insert_before(n, rw.linear, (x, wi, bi), n)
                item.replace_all_uses_with(lin)

    def _swap(self, node: fx.Node, op, args: tuple, kwargs: dict | None = None) -> None:
        node.target, node.args, node.kwargs = op.default, args, kwargs or {}
        node.meta["pass"] = "lift"

    # -- module regions -----------------------------------------------------------------
    def replace(self, reg: Region, op, args: tuple, kwargs: dict | None = None) -> fx.Node:
        """Put ``op(*args)`` in place of a one-output region and erase the region."""
        (out,) = reg.outputs
        with self.graph.inserting_after(out):
            new = self.call(op, args, kwargs, like=out)
        out.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new and u not in reg.nodes)
        erase_region(self.graph, reg)
        return new

    def lift_conv1d(self, scope: str) -> None:
        """GPT-2's ``Conv1D`` (``addmm`` with an ``[in, out]`` weight) becomes a linear."""
        reg = region(self.graph, scope, self.prefix)
        mm = [n for n in reg.nodes if n.target == aten.addmm.default]
        if len(mm) != 1 or len(reg.inputs) != 1 or len(reg.outputs) != 1:
            return self.skip(scope, "Conv1D region is not view/addmm/view")
        bias, weight = mm[0].args[0], mm[0].args[2]
        w = self.weight(scope + ".weight", self.tensor(weight).t().contiguous())  # [out, in]
        self.replace(reg, rw.linear, (reg.inputs[0], w, bias))

    def lift_rms_norm(self, scope: str) -> None:
        reg = region(self.graph, scope, self.prefix)
        mod = self.module(scope)
        eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
        if eps is None or {n.target for n in reg.nodes} - _RMS_OPS:
            return self.skip(scope, "not the x * rsqrt(mean(x^2) + eps) * weight pattern")
        if len(reg.inputs) != 1 or len(reg.weights) != 1 or len(reg.outputs) != 1:
            return self.skip(scope, "RMSNorm region does not have one input, weight, output")
        args = (reg.inputs[0], reg.weights[0], float(eps))
        self.replace(reg, rw.rms_norm, args + ((True,) if _unit_offset(reg) else ()))

    def lift_scaled_embedding(self, scope: str) -> None:
        """Gemma's ``embedding(ids) * sqrt(hidden)`` (the scale a 0-d buffer cast to the
        table's dtype) becomes ``rw.embedding(ids, table, scale)``."""
        reg = region(self.graph, scope, self.prefix)
        emb = [n for n in reg.nodes if n.target == rw.embedding.default]
        muls = [n for n in reg.nodes if n.target == aten.mul.Tensor]
        if len(emb) != 1 or len(muls) != 1 or len(reg.outputs) != 1 or reg.outputs[0] is not muls[0] \
                or {n.target for n in reg.nodes} - {rw.embedding.default, aten.mul.Tensor, *_TO}:
            return self.skip(scope, "scaled embedding region is not embedding(ids) * scale")
        (e,), (mul,) = emb, muls
        scales = [w for w in reg.weights if w is not e.args[1] and self.tensor(w).numel() == 1]
        if len(scales) != 1 or e not in mul.args:
            return self.skip(scope, "scaled embedding region is not embedding(ids) * scale")
        table = self.tensor(e.args[1])
        scale = float(self.tensor(scales[0]).to(table.dtype))  # as the model rounds it
        self.replace(reg, rw.embedding, (e.args[0], e.args[1], scale))

    def lift_gelu(self, scope: str, cls: str) -> None:
        reg = region(self.graph, scope, self.prefix)
        if len(reg.inputs) != 1 or len(reg.outputs) != 1:
            return self.skip(scope, "GELU region does not have one input and output")
        single = reg.nodes[0] if len(reg.nodes) == 1 else None
        if single is not None and single.target == aten.gelu.default:
            approx = single.kwargs.get("approximate", "none")
        elif cls in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh"):
            approx = "tanh"
        else:
            return self.skip(scope, f"unknown GELU variant {cls}")
        self.replace(reg, rw.gelu, (reg.inputs[0], approx))

    def lift_rotary(self, scope: str) -> None:
        """Each cos/sin table becomes ``rw.rotary(positions, inv_freq, scaling)``: one
        table (``inv_freq``), or one per kind of layer (Gemma 3: ``<kind>_inv_freq`` with
        ``<kind>_attention_scaling``, local and global layers with their own bases)."""
        reg = region(self.graph, scope, self.prefix)
        mod = self.module(scope)
        rope_type = getattr(mod, "rope_type", "default")
        if mod is None or "dynamic" in str(rope_type):
            return self.skip(scope, f"rotary embedding of type {rope_type!r} is not lifted")
        if "longrope" in str(rope_type):
            return self.skip(scope, _LONGROPE)
        tables = self.rotary_tables(reg, mod)
        if tables is None:
            return self.skip(scope, "rotary region does not return (cos, sin) from an inv_freq")
        # by name: the trace computes the kinds' tables in an order that varies between
        # processes (a set of layer types), and ranks must build the same graph
        for name, (cos_out, sin_out) in sorted(tables.items()):
            kind = name[:-len("inv_freq")]  # "" or "sliding_attention_"
            inv_freq = self.weight(f"{scope}.{name}", getattr(mod, name).detach().clone())
            scaling = float(getattr(mod, kind + "attention_scaling", 1.0))
            with self.graph.inserting_after(reg.nodes[-1]):
                tab = self.call(rw.rotary, (self.positions, inv_freq, scaling), like=cos_out)
            with self.graph.inserting_after(tab):
                cos = self.call(operator.getitem, (tab, 0), like=cos_out, name=kind + "cos")
            with self.graph.inserting_after(cos):
                sin = self.call(operator.getitem, (tab, 1), like=cos_out, name=kind + "sin")
            cos_out.replace_all_uses_with(cos, delete_user_cb=lambda u: u not in reg.nodes)
            sin_out.replace_all_uses_with(sin, delete_user_cb=lambda u: u not in reg.nodes)
            self.tables.append((cos, sin))
        erase_region(self.graph, reg)

    def rotary_tables(self, reg: Region, mod: nn.Module):
        """``{inv_freq attribute: (cos output, sin output)}`` of a rotary region, told apart
        by the inv_freq buffer each output is computed from, or None."""
        found: dict[str, dict[str, fx.Node]] = {}
        for out in reg.outputs:
            ancestors = data_ancestors(out) | {out}
            freqs = {w.target.rsplit(".", 1)[-1] for w in reg.weights if w in ancestors}
            trig = {n.target for n in ancestors if n in reg.nodes} & {aten.cos.default, aten.sin.default}
            if len(freqs) != 1 or len(trig) != 1:
                return None
            (name,), (fn,) = freqs, trig
            if not name.endswith("inv_freq") or not isinstance(getattr(mod, name, None), torch.Tensor):
                return None
            found.setdefault(name, {})["cos" if fn == aten.cos.default else "sin"] = out
        if not found or any(len(pair) != 2 for pair in found.values()):
            return None
        return {name: (pair["cos"], pair["sin"]) for name, pair in found.items()}

    def lift_position_embeddings(self) -> None:
        """Embeddings indexed by ``arange(S) + c`` read ``positions + c`` (GPT-2's ``wpe``:
        c = 0; OPT's learned positions: c = 2). Any other index not made from the token
        ids (BERT's token types) is left as traced: ``positions`` would not mean it."""
        for n in list(self.graph.find_nodes(op="call_function", target=rw.embedding.default)):
            index = n.args[0]
            if index is self.input_ids or self.input_ids in data_ancestors(index):
                continue
            offset = position_offset(index, self.is_seq_len)
            rank = _rank(index)
            if offset is None or rank is None or rank > 2:
                scope = scope_of(n, self.prefix)[0]
                self.unlifted_embeddings.append(scope)
                self.skip(scope, "embedding index is neither the token ids nor arange(S) + c")
                continue
            positions = self.positions
            if offset:
                with self.graph.inserting_before(n):
                    positions = self.graph.call_function(aten.add.Tensor, (positions, offset))
                positions.meta["nn_module_stack"] = n.meta.get("nn_module_stack")
                positions.meta["pass"] = "lift"
            n.args = (positions, n.args[1])
            n.meta.pop("val", None)  # it read [1, S] position ids; now [B, S] positions

    def is_seq_len(self, a) -> bool:
        """Whether ``a`` is the sequence length of the token ids (a symbolic size)."""
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        seq = self.input_ids.meta["val"].shape[1]
        return isinstance(val, torch.SymInt) and isinstance(seq, torch.SymInt) \
            and val.node.expr == seq.node.expr

    def lift_attention(self, scope: str) -> fx.Node | None:
        """``rw.attention`` in place of the module's region (None when left as ATen)."""
        mod = self.module(scope)
        children = {name for name, _ in mod.named_children()} if mod is not None else set()
        cap = getattr(self.root.config, "attn_logit_softcapping", None)
        if cap:  # Gemma 2: tanh(scores / cap) * cap before the softmax
            return self.skip(scope, f"attention logit soft-capping (attn_logit_softcapping={cap}) "
                             "is not lifted: rw.attention has no cap on its scores")
        if not any(children == c for c in _ATTN_CHILDREN):
            return self.skip(scope, f"attention with children {sorted(children)} is not lifted")
        norm_scopes = tuple(f"{scope}.{c}" for c in ("q_norm", "k_norm") if c in children)
        reg = region(self.graph, scope, self.prefix, exact=True, also=norm_scopes)
        norms = self.qk_norms(reg, norm_scopes)
        if norms is None:
            return self.skip(scope, "q_norm/k_norm are not one lifted RMSNorm each")
        sdpa = [n for n in reg.nodes if n.target == aten.scaled_dot_product_attention.default]
        if len(sdpa) != 1 or len(reg.outputs) != 1:
            return self.skip(scope, "attention region has no single SDPA call and output")
        qkv = self.qkv_inputs(scope, mod, reg)
        if qkv is None:
            return self.skip(scope, "q/k/v projections not found")
        tables = [t for t in self.tables if t[0] in reg.inputs or t[1] in reg.inputs]
        if len(tables) > 1:
            return self.skip(scope, "attention reads more than one RoPE table")
        table = tables[0] if tables else None
        projections = {n for n in reg.inputs if n.target == rw.linear.default
                       and scope_of(n, self.prefix)[0].startswith(scope + ".")}
        known = set(qkv) | projections | set(table or ())
        for extra in reg.inputs:
            if extra not in known and not _is_mask(extra):
                return self.skip(scope, f"attention reads an unexpected input {extra.name}")
        why = self.qk_norm_misfit(mod, reg, norms, qkv, table)
        if why:
            return self.skip(scope, why)
        q_scale = query_scaling(reg, qkv[0])
        why = unexpected_math(reg, table is not None, q_scale is not None, set(norms.values()))
        if why:
            return self.skip(scope, why)
        args = self.attention_args(scope, mod, sdpa[0], qkv, table, q_scale or 1.0, norms)
        return self.replace(reg, rw.attention, args)

    def qk_norms(self, reg: Region, norm_scopes: tuple[str, ...]) -> dict[str, fx.Node] | None:
        """``{"q_norm": node, "k_norm": node}``, the lifted ``rw.rms_norm`` of each QK-norm
        child (none without them), or None when a child is not exactly one."""
        found = {}
        for child_scope in norm_scopes:
            nodes = [n for n in reg.nodes if scope_of(n, self.prefix)[0] == child_scope]
            if len(nodes) != 1 or nodes[0].target != rw.rms_norm.default:
                return None
            found[child_scope.rsplit(".", 1)[-1]] = nodes[0]
        return found if len(found) in (0, 2) else None

    def qk_norm_misfit(self, mod, reg: Region, norms: dict, qkv, table) -> str | None:
        """Why the QK-norms are not what ``rw.head_rms_norm`` before RoPE computes (a norm
        of each head of its own projection, RoPE after it), or None. OLMo 2's norms span
        the whole projection; a model could normalise after RoPE: both left as traced."""
        head_dim = self.head_dim(mod)
        for (name, norm), own, other in zip(norms.items(), qkv[:2], qkv[1::-1]):  # q, k
            read = data_ancestors(norm)
            rotated = any(set(table or ()) & set(n.all_input_nodes) for n in read & set(reg.nodes))
            if own not in read or other in read or rotated:
                return f"{name} does not normalise its own projection before RoPE"
            weight = op_arguments("rms_norm", tuple(norm.args), dict(norm.kwargs))["weight"]
            if self.tensor(weight).numel() != head_dim:
                return f"{name} normalises more than one head (weight is not [head_dim={head_dim}])"
        return None

    def head_dim(self, mod) -> int:
        config = self.root.config
        return getattr(mod, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def attention_args(self, scope, mod, sdpa, qkv, table, q_scale: float, norms: dict) -> tuple:
        config = self.root.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = self.head_dim(mod)
        # OPT scales q before SDPA (whose own scale is then 1): one scale for both.
        scale = (sdpa.kwargs.get("scale") or ops.default_scale(head_dim)) * q_scale
        q, k, v = qkv
        if norms:  # QK-norm: each head of q and of k normalised before RoPE
            q, k = (self.insert_before(sdpa, rw.head_rms_norm,
                                       _head_norm_args(x, norms[name], head_dim), x)
                    for x, name in ((q, "q_norm"), (k, "k_norm")))
        if table is not None:
            q, k = (self.insert_before(sdpa, rw.rope, (x, *table, head_dim), x) for x in (q, k))
        layer = self.layer_index(scope)
        return (q, k, v, layer, heads, kv_heads, head_dim, float(scale), True,
                attention_window(mod, config, layer))

    def insert_before(self, anchor: fx.Node, op, args: tuple, like: fx.Node) -> fx.Node:
        with self.graph.inserting_before(anchor):
            return self.call(op, args, like=anchor)

    def call(self, op, args: tuple, kwargs: dict | None = None, like: fx.Node | None = None,
             name: str | None = None) -> fx.Node:
        """A new node named after its op, in the module scope of ``like``."""
        target = op if op is operator.getitem else op.default
        name = name or (op.__name__ if op is not operator.getitem else "getitem")
        new = self.graph.create_node("call_function", target, args, kwargs or {}, name=name)
        new.meta["nn_module_stack"] = like.meta.get("nn_module_stack") if like is not None else None
        new.meta["pass"] = "lift"
        return new

    def qkv_inputs(self, scope: str, mod: nn.Module, reg: Region):
        if hasattr(mod, "q_proj"):
            found = []
            for child in ("q_proj", "k_proj", "v_proj"):
                hits = [n for n in reg.inputs if scope_of(n, self.prefix)[0] == f"{scope}.{child}"]
                if len(hits) != 1 or hits[0].target != rw.linear.default:
                    return None
                found.append(hits[0])
            return tuple(found)
        return self.split_fused_qkv(scope, mod, reg)

    def split_fused_qkv(self, scope: str, mod: nn.Module, reg: Region):
        """One GEMM computes q, k and v: split it into three linears. GPT-2's ``c_attn``
        lays its output out as ``[all q | all k | all v]``; GPT-NeoX's ``query_key_value``
        per head, ``[q_h | k_h | v_h]`` for each head ``h`` (it views the output as
        ``[B, S, H, 3 * D]`` and chunks the last dimension in three)."""
        fused = [n for n in reg.inputs if n.target == rw.linear.default and scope_of(n, self.prefix)[0]
                 in (f"{scope}.c_attn", f"{scope}.query_key_value", f"{scope}.qkv_proj")]
        if len(fused) != 1:
            return None
        (node,) = fused
        rows = self.qkv_rows(scope, mod, reg, node)
        if rows is None:
            return None
        x, weight, bias = node.args
        w, b = self.tensor(weight), self.tensor(bias) if bias is not None else None
        out = []
        for name, r in zip(("q_proj", "k_proj", "v_proj"), rows):
            wi = self.weight(f"{scope}.{name}.weight", w[r].contiguous())  # [H*D, hidden]
            bi = self.weight(f"{scope}.{name}.bias", b[r].contiguous()) if b is not None else None
            out.append(self.insert_before(node, rw.linear, (x, wi, bi), node))
        return tuple(out)

    def qkv_rows(self, scope: str, mod: nn.Module, reg: Region, fused: fx.Node):
        """Row indices of q, k and v in the fused weight, or None if the layout is unknown."""
        out_features = self.tensor(fused.args[1]).shape[0]
        config = self.root.config
        if scope_of(fused, self.prefix)[0].endswith(".qkv_proj"):  # Phi-3: [q | k | v], GQA sizes
            heads = config.num_attention_heads
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            head_dim = getattr(mod, "head_dim", None) or config.hidden_size // heads
            return qkv_proj_rows(fused, out_features, heads, kv_heads, head_dim)
        if scope_of(fused, self.prefix)[0].endswith(".c_attn"):
            size = getattr(mod, "split_size", None)
            if size is None or 3 * size != out_features:
                return None
            return tuple(torch.arange(3 * size).view(3, size))  # [all q | all k | all v]
        heads = self.root.config.num_attention_heads
        head_dim = out_features // (3 * heads)
        per_head = [n for n in reg.nodes if n.target in (aten.view.default, aten.reshape.default)
                    and n.args[0] is fused and n.args[1][-1] == 3 * head_dim]
        chunks = [n for n in reg.nodes if n.target == aten.chunk.default and n.args[1:] == (3, -1)]
        if 3 * heads * head_dim != out_features or len(per_head) != 1 or len(chunks) != 1:
            return None
        index = torch.arange(out_features).view(heads, 3, head_dim)  # [H, (q, k, v), D]
        return tuple(index[:, i].reshape(-1) for i in range(3))

    # -- helpers ------------------------------------------------------------------------
    def layer_index(self, scope: str) -> int:
        if self.layer_container and scope.startswith(self.layer_container + "."):
            return int(scope[len(self.layer_container) + 1:].split(".")[0])
        return -1

    def skip(self, scope: str, why: str) -> None:
        self.report.append(f"{scope}: {why}")

    def tensor(self, node: fx.Node) -> torch.Tensor:
        return reduce(getattr, node.target.split("."), self.gm)

    def weight(self, name: str, value: torch.Tensor) -> fx.Node:
        """A get_attr node for a new weight (``name`` is a path in the user's model)."""
        name = self.prefix + name
        add_weight(self.gm, name, value)
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(first):
            return self.graph.get_attr(name)

    def rehome_weights(self) -> fx.GraphModule:
        """A fresh GraphModule whose weights are named by their path in the user's model."""
        attrs: dict[str, torch.Tensor] = {}
        for n in self.graph.find_nodes(op="get_attr"):
            value = self.tensor(n)
            name = n.target[len(self.prefix):] if n.target.startswith(self.prefix) else n.target
            attrs[name] = value.detach()
            n.target = name
        _plain_output(self.graph)
        return fx.GraphModule(attrs, self.graph)


def find_layer_container(root: nn.Module) -> str | None:
    """Path of the ``ModuleList`` of decoder layers: repeated blocks holding attention."""
    best = None
    for path, mod in root.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        classes = {type(m).__name__ for m in mod}
        has_attn = any(type(s).__name__.endswith("Attention") for s in mod[0].modules())
        if len(classes) == 1 and has_attn and (best is None or len(mod) > best[1]):
            best = (path, len(mod))
    return best[0] if best else None


def _unit_offset(reg: Region) -> bool:
    """Whether an RMSNorm region scales by ``1 + weight`` (Gemma) rather than ``weight``."""
    (w,) = reg.weights
    seen = {w}
    for n in reg.nodes:  # graph order: the weight's casts come before its use
        if n.target in _TO and n.args[0] in seen:
            seen.add(n)
        elif n.target in (aten.add.Tensor, aten.add.Scalar) and n.args[0] in seen \
                and n.args[1] == 1.0 and any(u.target == aten.mul.Tensor for u in n.users):
            return True  # (1 + w) scaling the normalised row
    return False


def _head_norm_args(x: fx.Node, norm: fx.Node, head_dim: int) -> tuple:
    """``rw.head_rms_norm``'s arguments for ``x`` from a lifted per-head ``rw.rms_norm``."""
    a = op_arguments("rms_norm", tuple(norm.args), dict(norm.kwargs))
    return (x, a["weight"], a["eps"], head_dim) + ((True,) if a["unit_offset"] else ())


def _same_meta(a: fx.Node, b) -> bool:
    va, vb = a.meta.get("val"), getattr(b, "meta", {}).get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.dtype == vb.dtype and va.device == vb.device)


def _rank(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else None


def _is_mask(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool


def _plain_output(graph: fx.Graph) -> None:
    """Plain positional inputs and a single output, instead of export's pytree calling."""
    graph._codegen = fx.graph.CodeGen()
    out = graph.output_node()
    if isinstance(out.args[0], (list, tuple)) and len(out.args[0]) == 1:
        out.args = (out.args[0][0],)
