"""``python -m rewriter``: the command line."""
import sys

from .cli import main

sys.exit(main())
