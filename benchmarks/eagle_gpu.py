"""An EAGLE draft layer made in one timed run: chat data the model writes for itself, then
the layer trained on it, each phase within its share of ``--seconds`` (a GPU machine is
lent for minutes, one call at most 10 of them).

    python benchmarks/eagle_gpu.py --model GGUF --device cuda --seconds 500 --out DIR

Phases, each ending at its deadline (a fraction of ``--seconds`` from the start):

1. ``--ask``: the model asks itself chat questions (``train_heads.self_asked``, Magpie),
   ``--question-batch`` at a time, up to ``--questions``;
2. ``--answer``: it answers them greedily (``--new-tokens``), together with
   ``--code-prompts`` code prompts (``train_heads.make_prompts``: code chunks and chat
   questions about them) and 48 held-out ones;
3. its last hidden states over every row (the features the layer reads);
4. the layer (``eagle_draft.Draft``, from random, or from the draft file ``--init``:
   a later run goes on from an earlier one's layer on new questions) trained until
   ``--seconds`` less ``--reserve``, checkpointed to ``DIR/eagle.safetensors`` every 100
   steps;
5. held-out top-1 of each draft step: the last ``--chat-heldout`` chat rows and the
   held-out code prompts (with ``--init``, the file's too, before training: what the run
   added).

``--train-vocab N`` trains on the ``N`` tokens ``EagleDraft(draft_vocab=N)`` drafts from
(``eagle_file.draft_vocab`` of the run's counts, the file's included): the loss is the
cross-entropy over the LM head's rows for them, a target outside them is no target, and
top-1 (``--init``'s too) is measured as the runtime drafts, a target outside them a miss.
On the 2-core Xeon a step of 32 rows costs about a third of the whole vocabulary's, so a
step can take every chain start of its rows (``--positions 4096``).

``DIR/eagle.safetensors`` is the draft file ``EagleDraft(weights=...)`` reads (with the
tokens' counts for ``draft_vocab``), ``DIR/eagle_gpu.json`` what was made and measured.

Without ``--data`` nothing is cached: the data lives for the run (the point is a GPU's
minutes). With ``--data ROWS`` (``eagle_rows``) the run keeps its answered rows there, and
trains on every earlier run's rows in that folder as well: a CPU adds a GPU call's data in
under an hour a session. Earlier runs' held-out code prompts, and their rows that ask one of
this run's held-out chat questions again, are left out. The draft file records the seeds
whose rows it trained on, and a later ``--init`` of it refuses them as it refuses its own.
A run whose seed already has rows there was cut short: it takes them instead of asking and
answering again, and goes on from its own checkpoint (``--init DIR/eagle.safetensors``,
made by a run of that seed). Token counts already in ``--init`` (earlier runs' rows, or a
resumed run's own) are counted again: they only rank the draft vocabulary (a resumed run
keeps its checkpoint's counts, so its ``--train-vocab`` stays the one it began with). Every earlier
row's hidden states are made again each run (about 3,400 positions a second in bfloat16 on
the 2-core Xeon), and held about twice over while the training set is built.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from rewriter import eagle, eagle_file
from rewriter.checkpoints import load_model
from rewriter.train_heads import (_continue, _ends, _eos_ids, _hidden_states, _merge, make_prompts,
                                  self_asked)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle_draft import Draft, produced_counts  # noqa: E402
import eagle_rows  # noqa: E402
from step_time import machine  # noqa: E402

HELD_CODE = 48  # held-out code prompts (train-heads' default)
PROMPT_TOKENS = 64  # code prompts' length (train-heads' default)


def main() -> None:
    args = parse()
    began = time.perf_counter()
    at = lambda fraction: began + fraction * args.seconds  # noqa: E731  a phase's deadline
    device = torch.device(args.device)
    model, tok = load_model(args.model, args.dtype)
    model = model.to(device).eval()
    eos = _eos_ids(model, tok)
    vocab = model.lm_head.weight.shape[0]
    lm = model.lm_head.weight.detach().cpu()
    earlier, resumed = rows_of(args, lm)  # refused now, not minutes later
    init = start_of(args, model, resuming=resumed is not None)
    report = {"args": dict(vars(args)), "cpu": machine(), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    report["seconds"] = {}

    def phase(name: str) -> None:  # the seconds since the last phase ended
        report["seconds"][name] = round(time.perf_counter() - began - sum(report["seconds"].values()), 1)
    phase("load")

    if resumed is None:
        tokens, start, kinds, questions = ask_and_answer(args, model, tok, at, phase)
        enough_rows(kinds, args, "give more --seconds")  # a resumed run would stop here again
        if args.data:
            eagle_rows.save(args.data, eagle_rows.Rows(tokens, start, kinds, args.seed, args.new_tokens,
                                                       args.chat_heldout), lm)
    else:
        tokens, start, kinds = resumed.tokens, resumed.start, resumed.kind
        questions = None  # not known: the cut-short run's count of distinct questions
        print(f"{len(tokens)} rows of this seed's cut-short run taken from {args.data}", flush=True)
        phase("rows")
    own_rows = len(tokens)
    tokens, start, kinds, dropped = eagle_rows.merged(tokens, start, kinds, args.chat_heldout, earlier)
    hidden, _ = _hidden_states(model, tokens, False, "train", chunk=args.hidden_chunk)
    phase("hidden")
    data = {"tokens": tokens, "start": start, "hidden": hidden}
    data["end"] = _ends(data, args.new_tokens, eos)
    part = lambda rows: {k: v[rows] for k, v in data.items()}  # noqa: E731
    chat = (kinds == eagle_rows.CHAT).nonzero().flatten()
    cut = len(chat) - args.chat_heldout
    code_rows = (kinds == eagle_rows.CODE).nonzero().flatten()
    old_chat = (kinds == eagle_rows.EARLIER_CHAT).nonzero().flatten()
    parts = [part(chat[:cut])] + [part(r) for r in (code_rows, old_chat) if len(r)]
    train = _merge(parts)
    heldout = {"chat": part(chat[cut:]), "code": part((kinds == eagle_rows.HELD).nonzero().flatten())}
    data.clear()  # the training set and the held-out rows hold their own copies
    del hidden
    positions = int((train["end"] - train["start"]).sum())
    report["data"] = {"questions": questions, "chat_rows": cut,
                      "code_rows": int((code_rows < own_rows).sum()),
                      "earlier_runs": [e.seed for e in earlier], "earlier_chat_rows": len(old_chat),
                      "earlier_code_rows": int((code_rows >= own_rows).sum()),
                      "earlier_rows_dropped": dropped,
                      "heldout_chat_rows": args.chat_heldout,
                      "heldout_code_rows": len(heldout["code"]["tokens"]),
                      "generated_positions": positions}
    print(report["data"], flush=True)

    torch.manual_seed(args.seed)
    draft = Draft(model, "random", args.depth, device)
    counts = counts_of(produced_counts(parts, vocab), init, resumed is not None)
    del parts  # their hidden states: the training set has them
    if init is not None:
        go_on_from(draft, init)
    if args.train_vocab:  # the runtime's EagleDraft(draft_vocab=N) takes the same N tokens
        kept = eagle_file.draft_vocab(counts, args.train_vocab)
        draft.trim(kept)
        report["train_vocab"] = {"tokens": len(kept), "covers": round(
            float(counts[kept].sum()) / max(1, float(counts.sum())), 4)}
        print(f"trained and measured on the {len(kept)} most produced tokens: "
              f"{report['train_vocab']['covers']:.1%} of the tokens counted", flush=True)
    if init is not None:
        # where it started, on the same held-out rows: what this run's training added
        report["heldout_top1_init"] = {k: draft.accuracy(v) for k, v in heldout.items()}
        print(f"--init's held-out top-1: {report['heldout_top1_init']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(step: int, accuracy: list) -> None:
        eagle_file.made({n: t.detach().cpu() for n, t in draft.p.items()}, draft.shape, lm,
                        accuracy=accuracy, counts=counts,
                        trained={"steps": step, "seconds": round(time.perf_counter() - began, 1),
                                 "rows": len(train["tokens"]), "positions": positions,
                                 "lr": args.lr, "seed": args.seed, "depth": args.depth,
                                 "batch_rows": args.rows, "batch_positions": args.positions,
                                 **({"train_vocab": args.train_vocab} if args.train_vocab else {}),
                                 "device": report["device_name"], "stored": args.save_dtype,
                                 "data_seeds": [e.seed for e in earlier],
                                 **({"init": {"file": args.init, **init.trained}} if init else {}),
                                 "accuracy_on": "held-out self-asked chat rows" + (
                                     f", within the {args.train_vocab} most produced tokens"
                                     if args.train_vocab else "")}
                        ).save(out / "eagle.safetensors", dtype=getattr(torch, args.save_dtype))
    phase("prepare")
    budget = at(1.0) - args.reserve - time.perf_counter()
    if budget <= 0:
        sys.exit(f"eagle_gpu: no time left to train ({budget:.0f} s): give more --seconds")
    def checkpoint(step: int) -> None:  # the last good one stays where a run diverges
        try:
            save(step, [])
        except eagle_file.DraftFileError as e:
            print(f"step {step}: no checkpoint: {e}", flush=True)
    loss = draft.train(train, args, seconds=budget, checkpoint=checkpoint)
    phase("train")
    accuracy = {k: draft.accuracy(v) for k, v in heldout.items()}
    phase("accuracy")
    save(args.steps_done, accuracy["chat"])
    report.update(steps=args.steps_done, final_loss=round(loss, 4), heldout_top1=accuracy)
    (out / "eagle_gpu.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("seconds", "data", "steps", "final_loss",
                                             "heldout_top1", "device_name")}), flush=True)


def ask_and_answer(args, model, tok, at, phase) -> tuple:
    """This run's rows: ``(tokens [N, L], start [N], kinds [N], questions asked)``, kinds 0
    held-out code, 1 chat, 2 code (``eagle_rows``)."""
    asked = self_asked(model, tok, args.questions, args.seed, progress=False,
                       batch=args.question_batch, deadline=at(args.ask))
    phase("ask")
    print(f"{len(asked)} questions asked", flush=True)
    held = make_prompts(tok, "heldout", HELD_CODE, PROMPT_TOKENS, args.seed, chat=True)
    code = make_prompts(tok, "train", args.code_prompts, PROMPT_TOKENS, args.seed, chat=True)
    # held-out first (answered unless the deadline passed before them), then chat and code
    # interleaved: a deadline keeps both kinds
    mixed = [("chat", p) for p in asked] + [("code", p) for p in code]
    random.Random(args.seed).shuffle(mixed)
    kinds = ["held"] * len(held) + [k for k, _ in mixed]
    tokens, start, _ = _continue(model, tok, held + [p for _, p in mixed], args.new_tokens,
                                 args.generate_batch, False, "train", deadline=at(args.answer))
    phase("answer")
    if len(tokens):  # padded to the widest prompt of all: only the answered ones' width
        tokens = tokens[:, :int(start.max()) + args.new_tokens]
    kinds = torch.tensor([("held", "chat", "code").index(k) for k in kinds[:len(tokens)]], dtype=torch.int64)
    return tokens, start, kinds, len(asked)


def counts_of(own: torch.Tensor, init, resuming: bool) -> torch.Tensor:
    """The token counts the draft file keeps, from which ``--train-vocab`` (and later the
    runtime's ``draft_vocab``) takes its tokens: this run's rows' ``own`` plus ``--init``'s.
    A resumed run keeps its checkpoint's, which already count its rows: counted again, they
    would rank the tokens otherwise, and the run would go on training on another
    vocabulary than its checkpoint's."""
    if init is None or init.counts is None:
        return own
    return init.counts.clone() if resuming else own + init.counts


def enough_rows(kinds: torch.Tensor, args, fix: str) -> None:
    """More chat rows than ``--chat-heldout`` and a held-out code prompt, or the run stops."""
    chat = int((kinds == eagle_rows.CHAT).sum())
    if chat <= args.chat_heldout:
        sys.exit(f"eagle_gpu: {chat} chat rows answered, --chat-heldout {args.chat_heldout}: {fix}")
    if not bool((kinds == eagle_rows.HELD).any()):
        sys.exit(f"eagle_gpu: no held-out code prompt was answered: {fix}")


def rows_of(args, lm_head: torch.Tensor) -> tuple:
    """``--data``'s earlier runs' rows, and this seed's own where a run of it was cut short
    (None: none), all checked before any minute is spent."""
    if not args.data:
        return [], None
    if Path(args.data).exists() and not Path(args.data).is_dir():
        sys.exit(f"eagle_gpu: --data {args.data}: exists and is not a folder")
    own = eagle_rows.path(args.data, args.seed)
    if (own.exists() or own.is_symlink()) and not (own.is_file() and not own.is_symlink()):
        sys.exit(f"eagle_gpu: --data: {own} is not a plain file")
    try:
        earlier = eagle_rows.earlier(args.data, args.seed, lm_head, args.new_tokens)
        resumed = eagle_rows.load(own, lm_head) if own.is_file() else None
    except eagle_rows.RowsError as e:
        sys.exit(f"eagle_gpu: --data: {e}")
    if resumed is not None:
        fix = f"remove {own} (this seed's rows) or give another --seed"
        if (resumed.new_tokens, resumed.chat_heldout) != (args.new_tokens, args.chat_heldout):
            sys.exit(f"eagle_gpu: --data: this seed's rows were answered with --new-tokens "
                     f"{resumed.new_tokens} and hold out {resumed.chat_heldout} chat rows; this "
                     f"run has {args.new_tokens} and {args.chat_heldout}: {fix}")
        enough_rows(resumed.kind, args, fix)
    return earlier, resumed


def start_of(args, model, resuming: bool = False):
    """The draft file ``--init`` names (None: none), checked against the model and the run
    before any minute is spent: its questions must be new ones, so neither its seed nor
    any seed of the files it went on from may be this run's (unless ``resuming``: the
    seed's own rows, kept in ``--data``, are what it trained on)."""
    if args.init is None:
        return None
    try:
        init = eagle_file.load(args.init)
        init.fits(model.lm_head.weight.detach().cpu(), f"--init {args.init}")
    except eagle_file.DraftFileError as e:
        sys.exit(f"eagle_gpu: {e}")
    if not same_shape(init.shape, eagle.Shape.of(model.config)):
        sys.exit(f"eagle_gpu: --init's layer {init.shape} is not this model's "
                 f"{eagle.Shape.of(model.config)}")
    if resuming and (not isinstance(init.trained, dict) or init.trained.get("seed") != args.seed):
        sys.exit(f"eagle_gpu: --init {args.init} was not made by a run of --seed {args.seed}: "
                 f"a run that takes this seed's kept rows goes on from its own checkpoint")
    if resuming and init.trained.get("train_vocab", 0) != getattr(args, "train_vocab", 0):
        sys.exit(f"eagle_gpu: --init {args.init} trained with --train-vocab "
                 f"{init.trained.get('train_vocab', 0)}: a cut-short run goes on as it began")
    trained, seeds, own = init.trained, [], resuming
    while isinstance(trained, dict):  # each run records the file it went on from
        # a resumed run's own checkpoints (cut short more than once) are the same questions
        own = own and trained.get("seed") == args.seed
        if not own:
            seeds.append(trained.get("seed"))
        data = trained.get("data_seeds")  # the earlier runs' rows it trained on (--data)
        seeds += data if isinstance(data, list) else []
        trained = trained.get("init")
    if args.seed in seeds:
        sys.exit(f"eagle_gpu: --init {args.init} was trained (or went on from a draft trained) "
                 f"with --seed {args.seed}: the same questions again; give another")
    return init


def same_shape(a: eagle.Shape, b: eagle.Shape) -> bool:
    """The same layer: sizes equal, RoPE's base and the norms' epsilon to float32's
    precision (a GGUF stores them rounded; a Hugging Face config does not)."""
    return (a.hidden, a.heads, a.kv_heads, a.intermediate) == (b.hidden, b.heads, b.kv_heads, b.intermediate) \
        and math.isclose(a.rope_theta, b.rope_theta, rel_tol=1e-6) and math.isclose(a.eps, b.eps, rel_tol=1e-6)


def go_on_from(draft: Draft, init) -> None:
    """Start ``draft``'s layer from the file's (float32, on the draft's device)."""
    if not same_shape(init.shape, draft.shape):
        sys.exit(f"eagle_gpu: --init's layer {init.shape} is not this model's {draft.shape}")
    draft.p = {n: init.params[n].to(draft.device, torch.float32).clone().requires_grad_(True)
               for n in eagle_file.NAMES}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF file, 'smollm2' or 'default'")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's, while it writes the data")
    ap.add_argument("--seconds", type=float, default=500.0, help="the whole run's budget")
    ap.add_argument("--ask", type=float, default=0.2, help="deadline of the questions (fraction)")
    ap.add_argument("--answer", type=float, default=0.5, help="deadline of the answers (fraction)")
    ap.add_argument("--reserve", type=float, default=30.0,
                    help="seconds kept after training for the held-out accuracy and the file")
    ap.add_argument("--questions", type=int, default=65536, help="at most this many")
    ap.add_argument("--question-batch", type=int, default=512)
    ap.add_argument("--code-prompts", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--generate-batch", type=int, default=256)
    ap.add_argument("--hidden-chunk", type=int, default=64, help="rows a hidden-state forward")
    ap.add_argument("--chat-heldout", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1_000_000, help="at most (the time ends it first)")
    ap.add_argument("--rows", type=int, default=32, help="whole rows the layer runs over a step")
    ap.add_argument("--positions", type=int, default=1024, help="chain starts trained on a step")
    ap.add_argument("--depth", type=int, default=4, help="draft steps unrolled")
    ap.add_argument("--train-vocab", type=int, default=0,
                    help="train (and measure top-1) on the N most produced tokens alone, the "
                         "vocabulary EagleDraft(draft_vocab=N) drafts from: a fraction of the "
                         "LM head's cost a step (0: the whole vocabulary)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=11,
                    help="the questions' and the training's (with --init: none of the file's)")
    ap.add_argument("--init", default=None,
                    help="a draft file (or 'smollm2', the shipped one) the layer starts from")
    ap.add_argument("--out", required=True, help="folder for eagle.safetensors and eagle_gpu.json")
    ap.add_argument("--data", default=None,
                    help="a folder that keeps each run's rows; earlier runs' rows there are trained on too")
    ap.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the draft file's parameters (the shipped one: bfloat16, half the bytes)")
    args = ap.parse_args()
    for name in ("questions", "question_batch", "code_prompts", "generate_batch", "hidden_chunk",
                 "chat_heldout", "steps", "rows", "positions", "depth"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.train_vocab < 0 or 0 < args.train_vocab < 10:
        ap.error("--train-vocab must be 0 (the whole vocabulary) or >= 10, as draft_vocab")
    if args.new_tokens < args.depth + 2:
        ap.error(f"--new-tokens must be at least --depth + 2 = {args.depth + 2}")
    if not (0 < args.ask < args.answer < 1):
        ap.error("need 0 < --ask < --answer < 1 (fractions of --seconds)")
    if not (args.seconds > 0 and args.reserve >= 0 and args.lr > 0):
        ap.error("--seconds and --lr must be > 0, --reserve >= 0")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        ap.error(f"--out {args.out}: exists and is not a folder")
    return args


if __name__ == "__main__":
    main()
