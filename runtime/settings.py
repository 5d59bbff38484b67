"""``GenerationSettings``: every generation parameter, checked in one place.

    s = GenerationSettings(max_new_tokens=64, do_sample=True, temperature=0.8, top_k=50)
    s = s.for_model(engine.config)  # eos/pad from the config, ids checked against its vocabulary

``Engine.generate`` and ``Engine.stream`` build one from their keyword arguments and hand
that one object to the decode loop and the sampler; strategies built on the loop take it
as it is. Defaults are Hugging Face's (``max_new_tokens=20, temperature=1.0, top_k=50,
top_p=1.0``); ``prefill_chunk=2048`` bounds the prompt tokens of one forward call.

What is refused, with a ``ValueError`` that names the parameter:
- an integer parameter that is not an ``int``: ``bool`` is refused (``True`` is not token
  1), and so is every ``float``, integral or not (``3.0`` is refused, not truncated: a
  float where an id or a count belongs is a mistake upstream, and one rule is easier to
  trust than "floats that happen to be whole");
- a real parameter that is not a finite ``int``/``float`` (NaN, inf, bools, strings);
- out-of-range values: ``max_new_tokens >= 1``, ``top_k >= 0`` or None (0 and None: no
  limit, as in Hugging Face), ``temperature >= 1e-4`` (a smaller one overflows the
  scaled logits: greedy decoding is its limit) and ``top_p`` in (0, 1] when sampling
  (greedy decoding ignores them, as Hugging Face does, but they must still be numbers),
  ``prefill_chunk >= 16``, eos ids in ``[0, vocab_size)`` once the model is known
  (``pad_token_id`` may be any int64: it only marks output positions), ``seed`` what
  ``torch.Generator.manual_seed`` takes (64 bits, signed or not).

Numpy integers and floats are accepted as their Python values, and stored as those.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from functools import partial
from typing import Optional, Sequence, Union

import numpy
import torch

from rewriter.values import is_int

TokenIds = Union[None, int, Sequence[int]]

# torch.Generator.manual_seed takes any value that fits 64 bits, signed or not.
_SEED_RANGE = (-(2 ** 63), 2 ** 64)
# Output ids are an int64 tensor: pad_token_id must fit one.
_INT64_RANGE = (-(2 ** 63), 2 ** 63)
# Sampling divides float32 logits by the temperature: below this, logits of a few hundred
# already overflow to inf and the probabilities become NaN.
MIN_TEMPERATURE = 1e-4
# Prompt tokens per prefill step (``GenerationSettings.prefill_chunk``).
PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = 50
    top_p: float = 1.0
    seed: Optional[int] = None
    # None: the model config's; an int or a list of ints (stored as a tuple); () for none.
    eos_token_id: TokenIds = None
    # None: the model config's pad_token_id, else the first eos id, else 0. It only fills
    # the output (ended rows, the left padding of list prompts) and never reaches the
    # model, so any int will do (-1 as a marker, as Hugging Face users do).
    pad_token_id: Optional[int] = None
    # The prompt is run in steps of at most this many tokens: the attention masks and
    # scores of a step grow with its length times the cache's, so an 8k-token prompt in
    # one step needs gigabytes that 2048-token steps do not. Each token attends to the
    # same keys either way.
    prefill_chunk: int = PREFILL_CHUNK

    def __post_init__(self):
        # Every field is stored as the plain Python value it was checked as: a numpy or
        # other Integral scalar never reaches torch (manual_seed refuses numpy's).
        put = partial(object.__setattr__, self)
        put("max_new_tokens", whole("max_new_tokens", self.max_new_tokens, minimum=1))
        if not isinstance(self.do_sample, (bool, numpy.bool_)):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        put("do_sample", bool(self.do_sample))
        put("temperature", real("temperature", self.temperature))
        put("top_p", real("top_p", self.top_p))
        # >= 16: a prompt longer than one chunk is cut into near-equal steps of more than 8
        # tokens, so no prompt step is a one-token step, which selections treat as decode.
        put("prefill_chunk", whole("prefill_chunk", self.prefill_chunk, minimum=16))
        if self.top_k is not None:
            put("top_k", whole("top_k", self.top_k, minimum=0))
        if self.seed is not None:
            put("seed", whole("seed", self.seed, minimum=_SEED_RANGE[0], below=_SEED_RANGE[1]))
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
            if self.temperature < MIN_TEMPERATURE:
                raise ValueError(f"temperature must be >= {MIN_TEMPERATURE} when sampling (smaller "
                                 f"ones overflow the scaled logits; do_sample=False is the greedy "
                                 f"limit), got {self.temperature}")
            if not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.eos_token_id is not None:
            put("eos_token_id", token_ids("eos_token_id", self.eos_token_id))
        if self.pad_token_id is not None:
            put("pad_token_id", pad_id("pad_token_id", self.pad_token_id))

    def for_model(self, config: dict) -> "GenerationSettings":
        """These settings with eos and pad resolved from the model ``config`` (a
        ``config.json`` dict) and every token id checked against its ``vocab_size``."""
        vocab = config.get("vocab_size")
        eos, eos_name = self.eos_token_id, "eos_token_id"
        if eos is None:
            eos_name = "eos_token_id (from the model config)"
            eos = token_ids(eos_name, config.get("eos_token_id"))
        pad = self.pad_token_id
        if pad is None:
            pad = config.get("pad_token_id")
            if pad is not None:
                pad = pad_id("pad_token_id (from the model config)", pad)
        pad = pad if pad is not None else (eos[0] if eos else 0)
        if vocab is not None:
            for i in eos:
                if i >= vocab:
                    raise ValueError(f"{eos_name} {i} is outside the vocabulary [0, {vocab})")
        return replace(self, eos_token_id=eos, pad_token_id=pad)

    def generator(self, device) -> Optional[torch.Generator]:
        """The seeded random generator sampling draws from (None: torch's global one)."""
        if not self.do_sample or self.seed is None:
            return None
        return torch.Generator(device).manual_seed(self.seed)


def whole(name: str, value, minimum: Optional[int] = None, below: Optional[int] = None) -> int:
    """``value`` if it is an int in ``[minimum, below)``, else a ValueError naming ``name``."""
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if below is not None and value >= below:
        raise ValueError(f"{name} must be < {below}, got {value}")
    return int(value)


def pad_id(name: str, value) -> int:
    """``pad_token_id``: any int64 (it only marks output positions, -1 included)."""
    return whole(name, value, minimum=_INT64_RANGE[0], below=_INT64_RANGE[1])


def real(name: str, value) -> float:
    """``value`` if it is a finite int or float (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def token_ids(name: str, value) -> tuple[int, ...]:
    """An id or a list of ids as a tuple of non-negative ints (None: the empty tuple)."""
    if value is None:
        return ()
    if isinstance(value, numbers.Number):  # an id, or a bool/float that whole() names
        return (whole(name, value, minimum=0),)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}")
    return tuple(whole(f"{name}[{i}]", v, minimum=0) for i, v in enumerate(value))
