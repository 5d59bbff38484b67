"""DuoAttention's calibration: one gate per layer and KV head, optimised with the model frozen.

Each attention head of the IR's whole-sequence graph computes both full attention and the
sink + window attention the runtime would give it (StreamingLLM's sink positions, as
``DuoAttention`` deploys it), and outputs their mix ``gate * full + (1 - gate) * streaming``,
one gate per KV head shared by its query group. On synthetic pass-key prompts (the
project's generator, ``rewriter.models.corpus``, with training-split code or fixed sentences as
filler, keys and seeds apart from the evaluation's), the loss is the mean squared
difference between the mixed model's and the full model's last hidden states at the
answer positions, plus ``reg`` times the mean gate (L1: gates are >= 0), as in the paper;
gates start at 1 and are clamped to [0, 1] after every step. Heads whose answer depends on
the middle of the context keep their gates up; the others fall toward 0.

Hidden states, not logits: the paper's distillation target, and cheaper than a vocabulary
projection. Steps checkpoint into ``OUT.work/`` and a rerun resumes.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from collections import abc
from pathlib import Path
from typing import Sequence, Union

import torch
from torch import Tensor, fx

from rewriter.drafts import duo_gates

from rewriter.files import safe_files, tensor_files
from rewriter.ops import OPS, REFERENCE, op_arguments
from rewriter.passes.streaming import rotary_frequencies

_SHORT = {op: name for name, op in OPS.items()}


def train_gates(opt, tokenizer, out: Union[str, os.PathLike], sinks: int = 16, window: int = 64,
                steps: int = 300, lengths: Sequence[int] = (256, 384, 512), lr: float = 0.02,
                reg: float = 0.05, seed: int = 0, positions: str = "cache",
                progress: bool = True) -> dict:
    """Calibrate gates for ``opt`` (an ``OptimizedModel`` of a causal LM, no passes needed)
    and write them to ``out`` (``rewriter.drafts.duo_gates``); returns the calibration record."""
    check_settings(sinks, window, steps, lengths, lr, reg, positions)
    context = opt.max_len
    if max(lengths) > context:
        raise ValueError(f"train_gates: lengths must be token counts in [64, {context}] (the "
                         f"model's context), got {lengths!r}")
    if tokenizer is None:
        raise ValueError("train_gates: the model has no tokenizer; the pass-key prompts "
                         "calibration runs on are text")
    out, work = check_out(out)
    layers, kv_heads = _shape(opt.ir)
    with safe_files.new_dirs(work):  # removed again if nothing is done
        return _calibrate(opt, tokenizer, out, work, layers, kv_heads, sinks, window, steps,
                          lengths, lr, reg, seed, positions, progress)


def check_settings(sinks: int, window: int, steps: int, lengths: Sequence[int], lr: float,
                   reg: float, positions: str) -> None:
    """A ``ValueError`` naming the first of ``train_gates``' settings that no model could
    calibrate with; checked before the model is loaded and traced (the lengths against
    its context are checked with it)."""
    for name, v, low in (("sinks", sinks, 0), ("window", window, 1), ("steps", steps, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"train_gates: {name} must be an integer >= {low}, got {v!r}")
    for name, v in (("lr", lr), ("reg", reg)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"train_gates: {name} must be a finite number >= 0, got {v!r}")
    if not isinstance(lengths, abc.Sequence) or not lengths or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 64 for n in lengths):
        raise ValueError(f"train_gates: lengths must be token counts of at least 64 (and at "
                         f"most the model's context), got {lengths!r:.200}")
    if sinks + window >= min(lengths):
        raise ValueError(f"train_gates: sinks + window = {sinks + window} must be below the "
                         f"shortest length {min(lengths)}, or streaming heads see everything "
                         f"and every gate falls to 0")
    if positions not in ("cache", "original"):
        raise ValueError(f"train_gates: positions must be 'cache' or 'original', got {positions!r}")


def check_out(out) -> tuple[Path, Path]:
    """``(out, its work directory)`` once a gates file may be written to ``out``
    (``safe_files.check_new_file``) and checkpoints to ``OUT.work``: checked before the
    model is traced or anything calibrated."""
    out = safe_files.check_new_file(out, "train_gates: out", "gates file", is_gates_file)
    work = out.with_name(out.name + ".work")
    if work.is_symlink() or work.exists() and not work.is_dir():
        raise ValueError(f"train_gates: {work} (the checkpoint directory) is not a directory")
    return out, work


def is_gates_file(path: Path) -> bool:
    """Whether ``path`` holds a gates file (JSON of this format), which a run may replace."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(duo_gates.MAX_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == duo_gates.FORMAT


def _calibrate(opt, tokenizer, out: Path, work: Path, layers: int, kv_heads: int, sinks: int,
               window: int, steps: int, lengths: Sequence[int], lr: float, reg: float,
               seed: int, positions: str, progress: bool) -> dict:
    device = opt._device()
    gates = torch.ones(layers, kv_heads, device=device, requires_grad=True)
    optim = torch.optim.Adam([gates], lr=lr)
    settings = {"sinks": sinks, "window": window, "steps": steps, "lengths": list(lengths),
                "lr": lr, "reg": reg, "seed": seed, "positions": positions,
                "model": _fingerprint(opt.ir)}
    start, history, seconds = _resume(work, settings, gates, optim)
    student = gated_program(opt.ir, sinks, window, gates, rotary=positions == "cache")
    teacher = gated_program(opt.ir)
    samples = _samples(tokenizer, lengths, seed)
    from tqdm import tqdm
    bar = tqdm(total=steps, initial=start, desc="calibrate gates", unit="step",
               disable=not progress, leave=False)
    for _ in range(start):  # the samples a resumed run has trained on already
        next(samples)
    began = time.perf_counter()
    for step in range(start, steps):
        ids, answer = next(samples)
        ids, answer = ids.to(device), answer.to(device)
        distill = _distill_loss(student, teacher, gates, ids, answer, opt.ir)
        loss = distill + reg * gates.abs().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        with torch.no_grad():
            gates.clamp_(0, 1)
        history.append([round(distill.item(), 6), round(gates.mean().item(), 4)])
        bar.update(1)
        bar.set_postfix(distill=f"{distill.item():.4f}", mean_gate=f"{gates.mean().item():.3f}")
        if (step + 1) % 25 == 0 or step + 1 == steps:
            _checkpoint(work, settings, gates, optim, history,
                        seconds + time.perf_counter() - began)
    bar.close()
    seconds += time.perf_counter() - began
    window_mean = lambda rows: round(sum(r[0] for r in rows) / max(1, len(rows)), 6)  # noqa: E731
    record = {**{k: v for k, v in settings.items() if k != "model"}, "resumed_at": start,
              "seconds": round(seconds, 1), "threads": torch.get_num_threads(),
              "distill_first_25": window_mean(history[:25]),
              "distill_last_25": window_mean(history[-25:])}
    table = duo_gates.Gates([[round(g, 4) for g in row] for row in gates.detach().tolist()],
                            sinks, window, {"layers": layers, "num_kv_heads": kv_heads,
                                            "head_dim": _fingerprint(opt.ir)["head_dim"]},
                            record, positions)
    duo_gates.save(table, out)
    return record


def _shape(ir) -> tuple[int, int]:
    """(layers the gates cover, KV heads per layer) of the IR's attention ops."""
    nodes = list(ir.graph.find_nodes(op="call_function", target=OPS["attention"]))
    if not nodes:
        raise ValueError("train_gates: the model's IR has no rw.attention op")
    args = [op_arguments("attention", tuple(n.args), dict(n.kwargs)) for n in nodes]
    heads = {a["num_kv_heads"] for a in args}
    if len(heads) != 1:
        raise ValueError(f"train_gates: layers have different KV head counts {sorted(heads)}")
    for n, a in zip(nodes, args):
        if a["window"] is not None or a["sinks"] is not None or a["select"] is not None:
            raise ValueError(f"train_gates: {n.name} limits what it attends to already; "
                             f"calibrate on the model without attention passes")
    return max(a["layer"] for a in args) + 1, heads.pop()


def _fingerprint(ir) -> dict:
    """What identifies the model gates are calibrated for: its shape and its LM head's
    first weights (a resumed calibration must be of the same model)."""
    from rewriter.drafts.heads import probe_of
    from rewriter.runtime.lower import logits_node
    head = logits_node(ir).args[1]
    weight = ir.weight(head.target) if head.op == "get_attr" else None
    node = next(iter(ir.graph.find_nodes(op="call_function", target=OPS["attention"])))
    args = op_arguments("attention", tuple(node.args), dict(node.kwargs))
    return {"head_dim": args["head_dim"], "num_heads": args["num_heads"],
            "probe": probe_of(weight.float()) if weight is not None else None}


def gated_program(ir, sinks: int | None = None, window: int | None = None,
                  gates: Tensor | None = None, rotary: bool = True) -> fx.GraphModule:
    """The whole-sequence graph on plain functions (autograd runs through them), returning
    the LM head's input ``[B, S, hidden]``. With ``gates`` ``[layers, kv_heads]`` each
    attention mixes full and sink + window attention per KV head."""
    from rewriter.runtime.lower import logits_node
    graph, env = fx.Graph(), {}
    gate_node = None
    for node in ir.graph.nodes:
        if node.op == "output":
            graph.output(env[logits_node(ir).args[0]])
            continue
        new = graph.node_copy(node, lambda n: env[n])
        name = _SHORT.get(node.target) if node.op == "call_function" else None
        if name == "attention" and gates is not None:
            if gate_node is None:
                gate_node = graph.placeholder("gates")  # placed first by the graph's order rules
            args = op_arguments("attention", tuple(node.args), dict(node.kwargs))
            freq = rotary_frequencies(node, args) if rotary else None
            new.target = _mixed_attention
            new.args = (*new.args[:3], gate_node)
            mapped = {k: env[v] if isinstance(v, fx.Node) else v for k, v in args.items()
                      if k not in ("q", "k", "v", "gates", "window", "sinks", "rotary")}
            new.kwargs = {**mapped, "sinks": sinks, "window": window,
                          "rotary": env[freq] if freq is not None else None}
        elif name is not None:
            new.target = REFERENCE[name]
        env[node] = new
    # placeholders must lead: move the gates input to the front
    if gate_node is not None:
        first = next(iter(graph.nodes))
        first.prepend(gate_node)
    graph.eliminate_dead_code()
    return fx.GraphModule(ir.gm, graph)


def _mixed_attention(q: Tensor, k: Tensor, v: Tensor, gates: Tensor, layer: int, num_heads: int,
                     num_kv_heads: int, head_dim: int, scale: float, causal: bool = True,
                     sinks: int = 0, window: int = 1, rotary=None, **rest) -> Tensor:
    """``gate * full + (1 - gate) * sink + window attention`` per KV head: [B, S, Hq*D]."""
    attend = REFERENCE["attention"]
    common = dict(layer=layer, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, scale=scale, causal=causal, cos=rest.get("cos"),
                  sin=rest.get("sin"))
    full = attend(q, k, v, **common)
    streaming = attend(q, k, v, **common, window=window, sinks=sinks, rotary=rotary)
    b, s, _ = q.shape
    g = gates[layer].repeat_interleave(num_heads // num_kv_heads)[:, None]  # [Hq, 1]
    full, streaming = full.float().view(b, s, num_heads, head_dim), streaming.float().view(
        b, s, num_heads, head_dim)  # mixed in float32: the gates are, the model may not be
    return (g * full + (1 - g) * streaming).reshape(b, s, num_heads * head_dim).to(q.dtype)


def _distill_loss(student, teacher, gates: Tensor, ids: Tensor, answer: Tensor, ir) -> Tensor:
    """Mean squared difference of the last hidden states at the positions that predict
    the answer tokens (``answer`` ``[A]`` indices)."""
    inputs = _inputs(ir, ids)
    with torch.no_grad():
        target = teacher(*inputs)[0, answer].float()  # [A, hidden]
    got = student(gates, *inputs)[0, answer].float()
    return (got - target).pow(2).mean()


def _inputs(ir, ids: Tensor) -> tuple:
    """The graph's inputs for one row of token ids ``[1, S]``: ids and positions."""
    names = [n.name for n in ir.graph.find_nodes(op="placeholder")]
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    return tuple(ids if "position" not in n else positions for n in names)


def _samples(tokenizer, lengths: Sequence[int], seed: int):
    """Endless ``(ids [1, S], answer positions [A])``: pass-key prompts with their answer,
    lengths and depths drawn by ``seed`` (the evaluation draws by its own seeds)."""
    from rewriter.models.corpus import code_lines, load_corpus, passkey_sample
    from rewriter.api.eval import _backend
    tok = _backend(tokenizer)
    lines = code_lines(load_corpus("train"))
    rng = random.Random(f"duo-gates-{seed}")
    while True:
        length, depth = rng.choice(list(lengths)), rng.uniform(0.05, 0.95)
        s = passkey_sample(tok, length, depth, rng, filler=rng.choice(["sentences", "code"]),
                           lines=lines)
        prompt = tok.encode(s.prompt).ids
        full = tok.encode(s.prompt + s.target).ids
        if full[:len(prompt)] != prompt or len(full) == len(prompt):
            continue  # the answer merged into the prompt's last token: no clean split
        ids = torch.tensor([full[:-1]])  # the last answer token is only a target
        yield ids, torch.arange(len(prompt) - 1, len(full) - 1)


def _checkpoint(work: Path, settings: dict, gates: Tensor, optim, history: list,
                seconds: float) -> None:
    state = optim.state_dict()["state"].get(0, {})
    tensors = {"gates": gates.detach().cpu().clone()}
    tensors.update({f"adam_{k}": v.detach().cpu().clone() for k, v in state.items()
                    if isinstance(v, Tensor)})
    meta = {"settings": json.dumps(settings), "history": json.dumps(history),
            "seconds": str(seconds)}
    tensor_files.save(work / "state.safetensors", tensors, meta)


def _resume(work: Path, settings: dict, gates: Tensor, optim) -> tuple[int, list, float]:
    """(first step, history, seconds) from ``work``'s checkpoint when its settings match."""
    loaded = tensor_files.load(work / "state.safetensors", "the calibration checkpoint")
    if loaded is None:  # none, or torn (a warning says so): start over
        return 0, [], 0.0
    tensors, meta = loaded
    try:
        same = lambda d: {k: v for k, v in d.items() if k != "steps"}  # noqa: E731  (more steps: go on)
        if same(json.loads(meta["settings"])) != same(settings) or tensors["gates"].shape != gates.shape:
            return 0, [], 0.0  # another calibration's state: start over
        history = json.loads(meta["history"])
        seconds = float(meta["seconds"])
        if len(history) > settings["steps"] or any(
                tensors.get(f"adam_{k}", torch.empty(0)).shape != gates.shape
                for k in ("exp_avg", "exp_avg_sq")) or "adam_step" not in tensors:
            return 0, [], 0.0  # a longer run than this one: start over
    except Exception:
        return 0, [], 0.0  # metadata that do not parse: start over rather than trust them
    state = [tensors[k] for k in ("gates", "adam_exp_avg", "adam_exp_avg_sq", "adam_step")]
    if not all(t.is_floating_point() and bool(torch.isfinite(t).all()) for t in state) \
            or tensors["adam_step"].numel() != 1 or len(history) != int(tensors["adam_step"]) \
            or not all(isinstance(r, list) and len(r) == 2 for r in history):
        return 0, [], 0.0  # a state that does not hold together: start over
    with torch.no_grad():
        gates.copy_(tensors["gates"].clamp(0, 1))
    # Adam's moments and step count, so a resumed run continues the same trajectory
    optim.state[gates] = {"step": tensors["adam_step"].float().cpu(),
                          "exp_avg": tensors["adam_exp_avg"].to(gates.device),
                          "exp_avg_sq": tensors["adam_exp_avg_sq"].to(gates.device)}
    return len(history), history, seconds
