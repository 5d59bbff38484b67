"""The commands on artifacts and checkpoints: optimize, run, ir, info."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

from rewriter.cli.terminal import bars
from rewriter.files import safe_files
from rewriter.models.named import NAMES
from rewriter.values import path_problem, utf8_text

NAMED_MODELS = ("default", "smollm2", *NAMES)

def cmd_optimize(args) -> int:
    from rewriter.api.pretrained import from_pretrained
    from rewriter.passes import from_spec
    passes = [from_spec(s) for s in args.passes]  # bad names/parameters fail before tracing
    _check_writable("--out", args.out)
    if args.dump:
        _check_writable("--dump", args.dump)
    opt = from_pretrained(args.model, passes, dump=args.dump, progress=bars(),
                          backend=args.backend, dtype=args.dtype)
    opt.save(args.out, progress=bars())
    print(opt.ir.summary())
    print(f"passes: {', '.join(map(repr, passes)) or 'none'}")
    print(f"saved: {args.out}")
    return 0


def cmd_run(args) -> int:
    from rewriter.cli import tensor_parallel as tp
    from rewriter.runtime.process_group import launched
    from rewriter.runtime.settings import GenerationSettings
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
              prefill_chunk=args.prefill_chunk)
    GenerationSettings(**kw)  # bad parameters fail before the model loads
    ids = _parse_ids(args.ids) if args.ids is not None else None
    if args.tp > 1 and args.model not in NAMED_MODELS and not Path(args.model).exists():
        raise FileNotFoundError(f"{args.model}: no such artifact or checkpoint")  # before ranks
    tp.check_split(args.model, args.tp, args.do_sample, args.seed is not None)
    if args.tp == 1:
        _generate(args, kw, ids, sys.stdout)
        return 0
    if not launched():  # start the ranks; each runs this command again, as a rank
        tp.launch(args.tp, tp.rank_argv(args.argv))
        return 0
    return tp.run_rank(args, lambda out: _generate(args, kw, ids, out))


def _generate(args, kw: dict, ids: Optional[list[int]], out) -> list[int]:
    """Generate as ``args`` say, written to ``out``; the new tokens."""
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
        shown = bars() and out is sys.stdout
        new = engine.generate([ids], progress=shown, **kw)[0, len(ids):].tolist()
        out.write((_text(tok, ids) if echo else "") + _text(tok, new) + "\n")
        return new
    steps = engine.stream([ids], **kw)  # checks the prompt and settings: nothing printed yet
    if echo:
        out.write(_text(tok, ids))
    new: list[int] = []
    shown = ""
    for token in steps:
        new.append(int(token[0]))
        text = _text(tok, new)  # decode the whole tail: byte-level pieces join up later
        out.write(text[len(shown):] if text.startswith(shown) else text)
        out.flush()
        shown = text
    out.write("\n")
    return new


def cmd_ir(args) -> int:
    from rewriter.runtime.engine_load import load
    print(load(args.model).ir)
    return 0


def cmd_info(args) -> int:
    from tabulate import tabulate
    from rewriter.runtime.artifact_manifest import read_manifest
    m = read_manifest(args.model)
    if args.json:
        print(json.dumps(m, indent=1))
        return 0
    model = m["model"]
    rows = [["model", f"{model['family']}, {model['layers']} layers, "
                      f"{model['parameters'] / 1e6:.2f}M params, {model['dtype']}"],
            ["passes", ", ".join(_pass_text(p) for p in m["passes"]) or "none"],
            ["backend", m["backend"]],
            *_measured_row(m.get("measured_on")),
            *_sharing_row(m.get("kv_sharing")),
            *_split_row(args.model),
            ["tokenizer", m["tokenizer"] or "none"],
            ["format", f"{m['format']} v{m['format_version']}, created {m['created']}"],
            ["versions", ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)]]
    rows += [[f"file {name}", f"{e['bytes'] / 1e6:.2f} MB  sha256 {e['sha256'][:16]}…"]
             for name, e in m["files"].items()]
    print(tabulate(rows, tablefmt="plain"))
    return 0


def _measured_row(where: Optional[dict]) -> list:
    """The row naming whose timings chose the decoding, if a pass timed anything."""
    if not where:
        return []
    return [["measured on", f"{where['backend']} backend, {where['device']} ({where['machine']}) "
                            f"by {', '.join(where['passes'])}"]]


def _split_row(model: str) -> list:
    """The row saying how many ranks a split artifact (TensorParallel) runs on."""
    from rewriter.cli.tensor_parallel import split_of
    world = split_of(model)
    if world is None:
        return []
    if world == -1:
        return [["tensor parallel", "a TensorParallel pass without a world_size"]]
    return [["tensor parallel", f"split over {world} ranks: rewriter run {model} --tp {world}"]]


def _sharing_row(sharing: Optional[dict]) -> list:
    """The row naming the layers that read another layer's KV cache (ShareKV)."""
    if not sharing:
        return []
    by_owner: dict = {}
    for reader, owner in sharing.items():
        by_owner.setdefault(owner, []).append(int(reader))
    return [["KV sharing", "; ".join(
        (f"layers {', '.join(map(str, sorted(r)))} read" if len(r) > 1 else f"layer {r[0]} reads")
        + f" layer {o}'s cache" for o, r in sorted(by_owner.items()))]]


def _engine(path: str, trust_code: bool, backend: Optional[str], dtype: Optional[str] = None):
    """An artifact, or else a checkpoint (or a named model) optimized with no passes."""
    from rewriter.api.pretrained import from_pretrained
    from rewriter.runtime.artifact_dir import is_artifact
    from rewriter.runtime.engine_load import load
    if is_artifact(path):
        return load(path, trust_code=trust_code, backend=backend)
    if path not in NAMED_MODELS and not Path(path).exists():
        raise FileNotFoundError(f"{path}: no such artifact or checkpoint")
    return from_pretrained(path, progress=bars(), backend=backend or "torch", dtype=dtype)


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
