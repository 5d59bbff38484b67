"""``rewriter train-share``'s checkpoint: the trained tensors, Adam's moments and step
counts, the loss history and the settings, in ``WORK/state.safetensors``.

A rerun with the same settings (the step count aside: more steps go on) resumes at the
step the checkpoint holds and, the batches being drawn by step, ends where an
uninterrupted run ends. A checkpoint of other settings, or one that does not hold
together, is not used: the run starts over.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from rewriter.files import tensor_files

STATE = "state.safetensors"


def checkpoint(work: Path, settings: dict, params: dict, optim, history: list,
               seconds: float) -> None:
    """Write the run's state (atomically: a kill leaves the previous checkpoint)."""
    tensors = {}
    for name, p in params.items():
        state = optim.state.get(p, {})
        tensors[f"param/{name}"] = p.detach()
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in state:
                tensors[f"{key}/{name}"] = torch.as_tensor(state[key]).detach()
    meta = {"settings": json.dumps(settings), "history": json.dumps(history),
            "seconds": str(seconds)}
    tensor_files.save(work / STATE, tensors, meta)


def resume(work: Path, settings: dict, params: dict, optim, steps: int) -> tuple[int, list, float]:
    """``(first step, history, seconds)``: the checkpoint's, loaded into ``params`` and
    ``optim``, when it is this run's; else ``(0, [], 0.0)`` and nothing changed."""
    loaded = tensor_files.load(work / STATE, "the train-share checkpoint")
    if loaded is None:
        return 0, [], 0.0
    tensors, meta = loaded
    try:
        history, seconds = json.loads(meta["history"]), float(meta["seconds"])
        same = json.loads(meta["settings"]) == settings
    except (KeyError, ValueError, TypeError, RecursionError):
        return 0, [], 0.0  # metadata that do not parse: start over rather than trust them
    done = len(history) if isinstance(history, list) else -1
    if not same or not 0 < done <= steps or not _holds(tensors, params, done):
        return 0, [], 0.0
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[f"param/{name}"])
            optim.state[p] = {"step": tensors[f"step/{name}"].float(),
                              "exp_avg": tensors[f"exp_avg/{name}"].to(p.device),
                              "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].to(p.device)}
    return done, history, seconds


def _holds(tensors: dict, params: dict, done: int) -> bool:
    """Whether ``tensors`` hold every parameter's value and Adam state, of its shape, finite,
    ``done`` steps into the run."""
    want = {f"{k}/{n}" for n in params for k in ("param", "exp_avg", "exp_avg_sq", "step")}
    if set(tensors) != want:
        return False
    for name, p in params.items():
        parts = [tensors[f"{k}/{name}"] for k in ("param", "exp_avg", "exp_avg_sq")]
        step: Tensor = tensors[f"step/{name}"]
        if any(t.shape != p.shape or not t.is_floating_point() or not bool(torch.isfinite(t).all())
               for t in parts) or step.numel() != 1 or int(step) != done:
            return False
    return True
