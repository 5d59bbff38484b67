"""``python -m rewriter``: the command line."""
import sys

from rewriter.cli import main

sys.exit(main())
