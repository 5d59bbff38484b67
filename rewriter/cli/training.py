"""The training commands: train-heads, train-gates, train-eagle, train-share."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rewriter.cli.terminal import bars, one_line_warnings

def cmd_train_heads(args) -> int:
    from rewriter.training.train_heads import check_paths, train_heads
    device = _training_device(args.device)  # what is checked here fails before the model loads
    check_paths(args.out, args.work_dir)
    model, tokenizer = _training_model(args.model, args.dtype)
    with one_line_warnings():
        report = train_heads(model.to(device), tokenizer, args.out, num_heads=args.num_heads,
                             prompts=args.prompts, new_tokens=args.new_tokens, epochs=args.epochs,
                             lr=args.lr, batch=args.batch, seed=args.seed, progress=bars(),
                             arch=args.arch, loss=args.loss, work_dir=args.work_dir, data=args.data,
                             rows=args.rows, questions=args.questions, init=args.init,
                             blocks=args.blocks, generate_batch=args.generate_batch)
    print(json.dumps(report, indent=1))
    return 0


def cmd_train_gates(args) -> int:
    from rewriter.api.optimized import optimize
    from rewriter.training.train_gates import check_out, check_settings, train_gates
    device = _training_device(args.device)  # what is checked here fails before the model loads
    check_out(args.out)
    settings = dict(sinks=args.sinks, window=args.window, steps=args.steps,
                    lengths=tuple(args.lengths), lr=args.lr, reg=args.reg, positions=args.positions)
    check_settings(**settings)
    model, tokenizer = _training_model(args.model, args.dtype)
    with one_line_warnings():
        record = train_gates(optimize(model.to(device), tokenizer=tokenizer), tokenizer, args.out,
                             seed=args.seed, progress=bars(), **settings)
    print(json.dumps(record, indent=1))
    print(f"saved: {args.out}")
    return 0


def cmd_train_eagle(args) -> int:
    from rewriter.training.train_eagle import train_eagle
    from rewriter.training.train_eagle_settings import DRAFT, EagleSettings, check_paths, check_settings
    device = _training_device(args.device)  # what is checked here fails before the model loads
    settings = EagleSettings(**{k: v for k, v in vars(args).items()
                                if k in EagleSettings.__dataclass_fields__})
    check_settings(settings)
    check_paths(settings)
    model, tokenizer = _training_model(args.model, args.dtype)
    with one_line_warnings():
        train_eagle(model, tokenizer, settings, device)
    print(f"saved: {Path(args.out) / DRAFT}")
    return 0


def cmd_train_share(args) -> int:
    from rewriter.training.train_share import check_paths, check_settings, train_share
    device = _training_device(args.device)  # what is checked here fails before the model loads
    settings = dict(init=args.init, queries=args.queries, steps=args.steps, lr=args.lr,
                    batch=args.batch, length=args.length, rows=args.rows, seed=args.seed,
                    passkey=args.passkey,
                    eval_chunks=args.eval_chunks, eval_length=args.eval_length,
                    dtype=args.save_dtype, save_every=25)
    check_settings(**settings)
    check_paths(args.out, args.work_dir)
    sharing = dict(every=args.every, last=args.last, sources=_json_map(args.sources))
    from rewriter.passes import ShareKV
    ShareKV(**sharing)  # a bad map fails before the model loads
    model, tokenizer = _training_model(args.model, args.dtype)
    import rewriter
    with one_line_warnings():
        traced = rewriter.trace(model.to(device), tokenizer=tokenizer)
        report = train_share(traced, tokenizer, args.out, **sharing, **settings,
                             work_dir=args.work_dir, progress=bars())
    report.pop("kl_history")  # in the file's metadata; the screen gets its summary
    print(json.dumps(report, indent=1))
    print(f"saved: {args.out}")
    return 0


def _json_map(text: Optional[str]):
    """``--sources``' JSON map, or None."""
    if text is None:
        return None
    from rewriter.values import parse_json
    try:
        return parse_json(text)
    except ValueError as e:
        raise ValueError(f"--sources must be a JSON map like '{{\"3\": 2}}': {e}") from None


def _training_device(name: Optional[str]) -> str:
    """``--device`` of the training commands, if this machine has it (default: cuda when
    present): cpu, cuda or cuda:N."""
    import torch
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"--device {name!r} is not a device: give cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: training runs on cpu or cuda (cuda:N)")
    count = torch.cuda.device_count() if device.type == "cuda" and torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        have = f"cuda:0 to cuda:{count - 1}" if count else "none"
        raise ValueError(f"--device {name!r}: no such CUDA device on this machine ({have})")
    return str(device)


def _training_model(path: str, dtype: Optional[str]):
    """(model, tokenizer) of a checkpoint the training commands can use: not an artifact
    (its passes changed the model; train the checkpoint it came from), with a tokenizer
    (the training prompts are text)."""
    from rewriter.models.checkpoints import load_model
    from rewriter.runtime.artifact_dir import is_artifact
    if is_artifact(path):
        raise ValueError(f"{path} is an artifact; training needs the checkpoint it was "
                         f"optimized from (a model directory, a .gguf file, or a named model)")
    model, tokenizer = load_model(path, dtype)
    if tokenizer is None:
        raise ValueError(f"{path}: the checkpoint has no tokenizer (tokenizer.json); "
                         f"training writes its prompts as text and needs one")
    return model, tokenizer
