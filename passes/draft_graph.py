"""The draft heads' ops in the graph: ``MedusaHeads``' and ``HydraHeads``' residual blocks on
the LM head's input, written as ordinary ops (the formulas are ``rewriter.passes.draft_heads``'
docstring), each node marked as a draft head's (``role``, ``pass``, ``head``); and the nodes
drafts read (the LM head, the token embedding), which ``EagleDraft`` reads too.
"""
from __future__ import annotations

import torch

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.nodes import DRAFT_HEAD, call, is_op
from rewriter.ops import op_arguments

ROLE = DRAFT_HEAD


def lm_head(ir: IR):
    """The LM head: a plain ``rw.linear`` on a stored weight whose output is the logits."""
    (out,) = ir.graph.find_nodes(op="output")
    node = out.args[0]
    if not is_op(node, "linear") or node.args[1].op != "get_attr" or \
            (len(node.args) > 2 and node.args[2] is not None):
        shown = node.target if hasattr(node, "target") else type(node).__name__
        raise PassError(f"draft heads share the LM head, which must be a plain linear without "
                        f"bias producing the logits (run them before Int4Weights(lm_head=True)); "
                        f"the graph returns {shown}")
    return node


def _add_weights(ir: IR, prefix: str, wb, vocab) -> None:
    """The heads' weights as ``{prefix}.w{k}``, ``{prefix}.b{k}`` and their deeper blocks;
    the draft vocabulary as ``medusa.vocab`` for both kinds (the runtime reads that name)."""
    w, b, deep = wb
    for k in range(len(w)):
        ir.add_weight(f"{prefix}.w{k}", w[k].clone())
        ir.add_weight(f"{prefix}.b{k}", b[k].clone())
    _add_deep(ir, prefix, deep)
    if vocab is not None:
        ir.add_weight("medusa.vocab", vocab.to(w[0].device, torch.int64))


def insert(ir: IR, head, wb, vocab, pass_name: str) -> None:
    """Add the heads after ``head`` and return ``(logits, draft)``."""
    w, b, deep = wb
    g = ir.graph
    x = head.args[0]
    _add_weights(ir, "medusa", wb, vocab)
    (out,) = g.find_nodes(op="output")
    with g.inserting_before(out):
        rows = []
        for k in range(w.shape[0]):
            wk, bk = g.get_attr(f"medusa.w{k}"), g.get_attr(f"medusa.b{k}")
            a = mark(call(ir, torch.ops.rw.linear.default, (x, wk, bk), f"medusa_{k}_linear"), k, pass_name)
            s = mark(call(ir, torch.ops.rw.silu.default, (a,), f"medusa_{k}_silu"), k, pass_name)
            r = mark(call(ir, torch.ops.aten.add.Tensor, (x, s), f"medusa_{k}"), k, pass_name)
            r = _blocks(ir, r, k, deep, "medusa", lambda n, k=k: mark(n, k, pass_name))
            rows.append(mark(call(ir, torch.ops.aten.unsqueeze.default, (r, -2), f"medusa_{k}_row"),
                              k, pass_name))
        stacked = mark(call(ir, torch.ops.aten.cat.default, (rows, -2), "medusa_rows"), None, pass_name)
        proj = head.args[1]
        if vocab is not None:  # the LM head's rows of the draft vocabulary (folded at lowering)
            proj = mark(call(ir, torch.ops.aten.index_select.default,
                              (proj, 0, g.get_attr("medusa.vocab")), "medusa_vocab_rows"), None, pass_name)
        draft = mark(call(ir, torch.ops.rw.linear.default, (stacked, proj), "medusa_logits"),
                      None, pass_name)
    out.args = ((head, draft),)


def embedding_weight(ir: IR, lm: torch.Tensor) -> tuple:
    """The token embedding's weight and scale, as the model's ``rw.embedding`` of its first
    input reads them: ``(weight get_attr node, scale or None)``. A draft embeds its tokens
    with both, so a model that scales its embeddings (Gemma's ``sqrt(hidden)``) gives the
    draft what it gives its own first layer."""
    ids = next(iter(ir.graph.find_nodes(op="placeholder")), None)
    for node in ir.graph.nodes:
        if is_op(node, "embedding") and _source(node.args[0]) is ids and node.args[1].op == "get_attr":
            e = ir.weight(node.args[1].target)
            if e.shape[1] != lm.shape[1]:
                break
            return node.args[1], op_arguments("embedding", tuple(node.args), dict(node.kwargs))["scale"]
    raise PassError("Hydra heads read the model's token embedding: the graph has no "
                    "rw.embedding of its input ids with the LM head's width")


def embedding_args(ids, embed: tuple) -> tuple:
    """``rw.embedding``'s arguments for ``ids`` and ``embedding_weight``'s ``(weight,
    scale)``; the scale left unsaid when there is none, as the frontend writes it."""
    weight, scale = embed
    return (ids, weight) if scale is None else (ids, weight, scale)


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default, torch.ops.aten.clone.default,
          torch.ops.aten.contiguous.default}


def _source(node):
    """``node`` before any view or copy of it (GPT-2 embeds ``input_ids.view(-1, S)``)."""
    while getattr(node, "op", None) == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def insert_hydra(ir: IR, head, embed, wb, vocab, pass_name: str) -> None:
    """Add Hydra's heads after ``head`` and return ``(logits, draft)``."""
    w, b, deep = wb
    g = ir.graph
    x = head.args[0]
    num = len(w)
    ids = next(iter(g.find_nodes(op="placeholder")))
    _add_weights(ir, "hydra", wb, vocab)
    (out,) = g.find_nodes(op="output")
    with g.inserting_before(out):
        m = lambda n, k=None: mark(n, k, pass_name)  # noqa: E731
        path = m(call(ir, torch.ops.rw.next_tokens.default, (ids, num), "hydra_path"))
        path.meta["draft_path"] = True  # the runtime's heads programs take it as an input
        embedded = []
        for j in range(num):
            col = m(call(ir, torch.ops.aten.select.int, (path, -1, j), f"hydra_path_{j}"))
            embedded.append(m(call(ir, torch.ops.rw.embedding.default, embedding_args(col, embed),
                                   f"hydra_e{j}")))
        proj = head.args[1]
        if vocab is not None:
            proj = m(call(ir, torch.ops.aten.index_select.default,
                          (proj, 0, g.get_attr("medusa.vocab")), "medusa_vocab_rows"))
        rows = []
        for k in range(num):
            wk, bk = g.get_attr(f"hydra.w{k}"), g.get_attr(f"hydra.b{k}")
            cat = m(call(ir, torch.ops.aten.cat.default, ([x, *embedded[:k + 1]], -1), f"hydra_{k}_in"), k)
            a = m(call(ir, torch.ops.rw.linear.default, (cat, wk, bk), f"hydra_{k}_linear"), k)
            s = m(call(ir, torch.ops.rw.silu.default, (a,), f"hydra_{k}_silu"), k)
            r = m(call(ir, torch.ops.aten.add.Tensor, (x, s), f"hydra_{k}"), k)
            r = _blocks(ir, r, k, deep, "hydra", lambda n, k=k: m(n, k))
            logits = m(call(ir, torch.ops.rw.linear.default, (r, proj), f"hydra_{k}_logits"), k)
            logits.meta["head_logits"] = k
            rows.append(m(call(ir, torch.ops.aten.unsqueeze.default, (logits, -2), f"hydra_{k}_row"), k))
        draft = m(call(ir, torch.ops.aten.cat.default, (rows, -2), "hydra_logits"))
    out.args = ((head, draft),)


def _add_deep(ir: IR, arch: str, deep) -> None:
    """The weights of the blocks after each head's first (``rewriter.drafts.heads.deepen``)."""
    for l, (v, c) in enumerate(zip(*deep) if deep is not None else (), start=1):  # [K, H, H], [K, H]
        for k in range(v.shape[0]):
            ir.add_weight(f"{arch}.block{l}.w{k}", v[k].clone())
            ir.add_weight(f"{arch}.block{l}.b{k}", c[k].clone())


def _blocks(ir: IR, r, k: int, deep, arch: str, m):
    """Head ``k``'s blocks after its first on ``r``: ``r + silu(linear(r, V, c))`` each."""
    g = ir.graph
    for l in range(1, 1 + (deep[0].shape[0] if deep is not None else 0)):
        v, c = g.get_attr(f"{arch}.block{l}.w{k}"), g.get_attr(f"{arch}.block{l}.b{k}")
        a = m(call(ir, torch.ops.rw.linear.default, (r, v, c), f"{arch}_{k}_block{l}_linear"))
        s = m(call(ir, torch.ops.rw.silu.default, (a,), f"{arch}_{k}_block{l}_silu"))
        r = m(call(ir, torch.ops.aten.add.Tensor, (r, s), f"{arch}_{k}_block{l}"))
    return r


def mark(node, k, pass_name: str):
    """``node`` marked as head ``k``'s (None: all heads') op, written by ``pass_name``
    (``Int4Weights`` leaves the draft heads' ops alone)."""
    node.meta["role"] = ROLE
    node.meta["pass"] = pass_name
    if k is not None:
        node.meta["head"] = k
    return node
