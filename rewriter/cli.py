"""The ``rewriter`` command.

    rewriter optimize <hf-checkpoint-dir | default> --pass layer_skip:speedup=1.5 --out DIR
    rewriter run DIR --prompt "..." --max-new-tokens 64
    rewriter ir DIR
    rewriter info DIR

Errors print one line (``rewriter: error: ...``) and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # our own bars cover loading; one bar at a time
    from .errors import RewriterError
    try:
        return args.func(args) or 0
    except (RewriterError, ValueError, FileNotFoundError, NotADirectoryError) as e:
        print(f"rewriter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rewriter: interrupted", file=sys.stderr)
        return 130


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rewriter", description="A compiler for LLM inference.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    o = sub.add_parser("optimize", help="trace a checkpoint, run passes, save an artifact",
                       description="Trace a Hugging Face checkpoint directory (or 'default', the "
                                   "shipped model), run passes in order, save an artifact.")
    o.add_argument("model", help="checkpoint directory (config.json + safetensors) or 'default'")
    o.add_argument("--pass", dest="passes", action="append", default=[], metavar="NAME[:K=V,...]",
                   help="a pass and its parameters, e.g. layer_skip:speedup=1.5 or "
                        "layer_skip:layers=[2,3]; repeat for a pipeline")
    o.add_argument("--out", required=True, help="artifact directory to write")
    o.add_argument("--dump", help="also write the IR after every pass into this directory")
    o.add_argument("--backend", default="torch", choices=["torch", "triton"],
                   help="kernels the artifact runs with (triton: CUDA, or TRITON_INTERPRET=1)")
    o.set_defaults(func=cmd_optimize)

    r = sub.add_parser("run", help="generate text with an artifact (or a checkpoint)",
                       description="Generate from an artifact directory, a checkpoint directory "
                                   "or 'default'. Text is streamed as it is generated.")
    r.add_argument("model", help="artifact directory, checkpoint directory or 'default'")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (needs the model's tokenizer)")
    src.add_argument("--ids", help="comma-separated prompt token ids")
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=50)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--no-stream", action="store_true",
                   help="print the result at the end, with a progress bar meanwhile")
    r.add_argument("--backend", choices=["torch", "triton"], default=None,
                   help="override the artifact's backend")
    r.add_argument("--trust-code", action="store_true",
                   help="use code stored in the artifact (generated kernels) as is")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("ir", help="print the stored IR", description="Print an artifact's IR.")
    i.add_argument("model", help="artifact directory")
    i.set_defaults(func=cmd_ir)

    f = sub.add_parser("info", help="print the manifest: model, passes, versions, sizes",
                       description="Print an artifact's manifest.")
    f.add_argument("model", help="artifact directory")
    f.add_argument("--json", action="store_true", help="the manifest as JSON")
    f.set_defaults(func=cmd_info)
    return p


# ---------------------------------------------------------------------------- commands

def cmd_optimize(args) -> int:
    from .checkpoints import from_pretrained
    from .passes import from_spec
    passes = [from_spec(s) for s in args.passes]  # bad names/parameters fail before tracing
    opt = from_pretrained(args.model, passes, dump=args.dump, progress=True, backend=args.backend)
    opt.save(args.out, progress=True)
    print(opt.ir.summary())
    print(f"passes: {', '.join(map(repr, passes)) or 'none'}")
    print(f"saved: {args.out}")
    return 0


def cmd_run(args) -> int:
    engine = _engine(args.model, args.trust_code, args.backend)
    tok = engine.tokenizer
    if args.prompt is not None:
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer; give --ids instead of --prompt")
        ids = tok.encode(args.prompt).ids
    else:
        try:
            ids = [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--ids must be comma-separated integers, got {args.ids!r}") from None
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.no_stream:
        out = engine.generate([ids], progress=True, **kw)[0, len(ids):].tolist()
        print(_text(tok, ids) + _text(tok, out))
        return 0
    sys.stdout.write(_text(tok, ids))
    new: list[int] = []
    shown = ""
    for token in engine.stream([ids], **kw):
        new.append(int(token[0]))
        text = _text(tok, new)  # decode the whole tail: byte-level pieces join up later
        sys.stdout.write(text[len(shown):] if text.startswith(shown) else text)
        sys.stdout.flush()
        shown = text
    sys.stdout.write("\n")
    return 0


def cmd_ir(args) -> int:
    from .runtime.artifact import load
    print(load(args.model).ir)
    return 0


def cmd_info(args) -> int:
    from tabulate import tabulate
    from .runtime.artifact import read_manifest
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

def _engine(path: str, trust_code: bool, backend: Optional[str]):
    """An artifact, or else a checkpoint directory (or 'default') optimized with no passes."""
    from .checkpoints import from_pretrained
    from .runtime.artifact import MANIFEST, load
    if (Path(path) / MANIFEST).exists():
        return load(path, trust_code=trust_code, backend=backend)
    if path != "default" and not Path(path).exists():
        raise FileNotFoundError(f"{path}: no such artifact or checkpoint directory")
    return from_pretrained(path, progress=True, backend=backend or "torch")


def _text(tok, ids: list[int]) -> str:
    if tok is None:
        return " ".join(map(str, ids)) + (" " if ids else "")
    return tok.decode(ids, skip_special_tokens=True)


def _pass_text(p: dict) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in p["params"].items() if v is not None)
    return f"{p['name']}({shown})"


if __name__ == "__main__":
    sys.exit(main())
