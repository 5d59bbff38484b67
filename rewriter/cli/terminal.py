"""What the command shows on a terminal: progress bars, one-line warnings."""
from __future__ import annotations

import contextlib
import sys


def bars() -> bool:
    """Progress bars only on a terminal: in a log or a pipe they are noise around the one
    line an error is."""
    return sys.stderr.isatty()


@contextlib.contextmanager
def one_line_warnings():
    """Warnings (a torn data cache made again) as one line each: ``rewriter: warning: ...``."""
    import warnings

    def show(message, *rest, **kwargs):
        print(f"rewriter: warning: {' '.join(str(message).split())}", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
