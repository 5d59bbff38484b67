"""The ``rewriter`` command.

    rewriter optimize <hf-checkpoint-dir | model.gguf | smollm2 | gemma3-270m | default> --pass layer_skip:speedup=1.5 --out DIR
    rewriter run DIR --prompt "..." --max-new-tokens 64
    rewriter run smollm2 --chat "What is the capital of France?"
    rewriter run gemma3-270m --prompt "The capital of France is"   # a base model: no --chat
    rewriter run DIR --tp 2 --prompt "..."        # a TensorParallel split, on 2 ranks
    rewriter ir DIR
    rewriter info DIR

Every failure the user can cause (a bad argument, a missing or broken file, an unwritable
``--out``, a bad sampling parameter) prints one line, ``rewriter: error: ...``, on stderr
and exits with status 2; ``run`` prints nothing of a generation before its inputs are
checked. A closed stdout (``rewriter run ... | head -c1``) ends the command with that one
line and status 2. A traceback means a bug in rewriter.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from rewriter.cli.parser import UsageError, parser

def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parser().parse_args(argv)
    except UsageError as e:
        return _fail(str(e))
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --tp's ranks run again
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # our own bars cover loading; one bar at a time
    from rewriter.errors import RewriterError
    try:
        status = args.func(args) or 0
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        return _closed_stdout()
    except (RewriterError, ValueError, OSError) as e:
        return _fail(error_text(e))
    except KeyboardInterrupt:
        print("rewriter: interrupted", file=sys.stderr)
        return 130


def error_text(e: BaseException):
    """What ``rewriter: error:`` says of ``e``, or None for an exception that is a bug."""
    from rewriter.errors import RewriterError
    if isinstance(e, (RewriterError, ValueError)):
        return str(e)
    if isinstance(e, OSError):  # files the user named: missing, unwritable, under a regular file
        return _os_error_text(e)
    return None


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
