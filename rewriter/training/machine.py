"""The machine a measurement ran on (``rewriter.measure.machine``), for the training reports."""
from __future__ import annotations

from rewriter.measure.machine import machine  # noqa: F401 (the training's name for it)
