"""Passes over the rewriter IR; each file holds one pass or pass family."""
from .layer_skip import LayerSkip

__all__ = ["LayerSkip"]
