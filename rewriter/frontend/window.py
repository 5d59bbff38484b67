"""Sliding windows: which attention layers attend to only the last ``w`` positions.

The window comes only from what the model does, never from a config key alone (a stray
``sliding_window`` in a Llama or GPT-NeoX config changes nothing in Hugging Face, so it
must change nothing here):
- a module that keeps its own ``sliding_window`` attribute (Qwen2, Qwen3, Gemma 2: set per
  layer from ``layer_types``, None on full-attention layers) has that window;
- a module without one has ``config.sliding_window`` only if its forward reads it (Mistral,
  Mixtral, Starcoder2 pass ``sliding_window=getattr(self.config, ...)`` to attention and
  build a sliding mask from the same key); a forward that never names it has none.
"""
from __future__ import annotations

import inspect
from typing import Optional

from torch import nn

from rewriter.errors import TraceError


def attention_window(mod: nn.Module, config, layer: int) -> Optional[int]:
    """Sliding window of one layer's attention, or None for full attention."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and 0 <= layer < len(layer_types):
        if layer_types[layer] != "sliding_attention":
            return None
    if hasattr(mod, "sliding_window"):
        return int(mod.sliding_window) if mod.sliding_window else None
    window = getattr(config, "sliding_window", None)
    if not window or not reads_sliding_window(type(mod)):
        return None
    return int(window)


def reads_sliding_window(cls: type) -> bool:
    """Whether ``cls.forward`` names ``sliding_window``; TraceError when its source is not
    available (then whether the config's window applies cannot be told)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError) as e:
        raise TraceError(f"cannot tell whether {cls.__name__} uses config.sliding_window: "
                         f"the source of its forward is not available ({e})") from e
    return "sliding_window" in source
