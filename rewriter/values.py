"""Checks of plain values that the passes and the runtime both apply."""
from __future__ import annotations

import numbers


def context_length(config: dict) -> int:
    """Tokens one sequence may hold, from a model's ``config.json`` dict: Llama-style
    ``max_position_embeddings``, GPT-2's ``n_positions``, else 2048."""
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)


def is_int(value) -> bool:
    """An integer that is not a bool (numpy integers count; floats never do)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
