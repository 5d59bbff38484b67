"""Checks of plain values that the passes and the runtime both apply."""
from __future__ import annotations

import numbers


def is_int(value) -> bool:
    """An integer that is not a bool (numpy integers count; floats never do)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
