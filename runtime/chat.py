"""The text side of an engine: its tokenizer, chat template and special tokens.

A model's chat template is a Jinja template (Hugging Face's convention): it turns a list of
``{"role", "content"}`` messages into the prompt text the model was trained on. It is
rendered in Jinja's immutable sandbox, set up as Hugging Face sets it up (``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``), so a template read
from an artifact or a GGUF file is data, not code: attribute tricks raise a security
error. Beyond Hugging Face's sandbox, ``*`` and ``**`` may not build strings, lists or
numbers past ``MAX_SIZE`` (``'a' * 10**10`` allocated gigabytes), and a template is at most
``MAX_TEMPLATE`` characters. Loops are bounded by Jinja's own ``range`` limit only: a
hostile template can still spend CPU time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from rewriter.errors import RewriterError
from rewriter.values import utf8_text

Messages = Union[str, Sequence[dict]]
SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")
MAX_TEMPLATE = 1 << 16  # characters; real templates are a few KB
MAX_SIZE = 1 << 20      # elements (characters, items) or digits one * or ** may produce


@dataclass
class TextConfig:
    """What a tokenizer file does not hold: the chat template and the special tokens'
    text (templates refer to ``bos_token``/``eos_token``)."""
    chat_template: Optional[str] = None
    special_tokens: dict = field(default_factory=dict)  # name in SPECIAL -> token text

    def to_json(self) -> dict:
        return {"chat_template": self.chat_template, **self.special_tokens}

    @classmethod
    def from_json(cls, data, where: str) -> "TextConfig":
        """From ``to_json``'s form; anything else raises ``ValueError`` naming ``where``."""
        if not isinstance(data, dict) or set(data) - {"chat_template", *SPECIAL}:
            raise ValueError(f"{where}: expected an object with chat_template and "
                             f"{', '.join(SPECIAL)} only")
        for key, value in data.items():
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{where}: {key} must be a string or null, got "
                                 f"{type(value).__name__}")
        special = {k: data[k] for k in SPECIAL if data.get(k) is not None}
        return cls(data.get("chat_template"), special)


def split_tokenizer(tokenizer):
    """``(tokenizers.Tokenizer or None, TextConfig)`` from a fast Hugging Face tokenizer,
    a ``tokenizers.Tokenizer``, or None."""
    if tokenizer is None:
        return None, TextConfig()
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str") or not hasattr(backend, "encode"):
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer or a fast Hugging Face "
                        f"tokenizer, got {type(tokenizer).__name__}")
    template = getattr(tokenizer, "chat_template", None)
    if template is not None and not isinstance(template, str):
        template = None  # a dict of named templates: the default one is not chosen for the user
    special = {}
    for name in SPECIAL:
        value = getattr(tokenizer, name, None) if backend is not tokenizer else None
        if isinstance(value, str):
            special[name] = value
    return backend, TextConfig(template, special)


def chat_prompt(tokenizer, text: TextConfig, messages: Messages,
                add_generation_prompt: bool = True) -> list[int]:
    """The token ids of ``messages`` laid out by the chat template (a string is one user
    message), encoded as Hugging Face's ``apply_chat_template`` encodes them."""
    messages = _messages(messages)  # the argument first, whatever the model
    if tokenizer is None:
        raise RewriterError("this model has no tokenizer (none was given to optimize, or its "
                            "artifact was saved without one), so it cannot chat: give token "
                            "ids to generate (--ids), or optimize it with its tokenizer")
    if text.chat_template is None:
        raise RewriterError("this model's tokenizer has no chat template; give it a plain "
                            "prompt instead")
    rendered = render(text, messages, add_generation_prompt)
    try:  # the template and special tokens are JSON text, where "\\ud800" is a lone surrogate
        utf8_text("the rendered chat template", rendered)
    except ValueError as e:
        raise RewriterError(f"{e}: the template or its special tokens hold it") from None
    return tokenizer.encode(rendered, add_special_tokens=False).ids


def answer_text(tokenizer, tokens: list[int], eos: Sequence[int]) -> str:
    """The text of ``tokens`` up to the first end-of-sequence id, special tokens skipped."""
    stop = set(eos)
    ended = [i for i, t in enumerate(tokens) if t in stop]
    return tokenizer.decode(tokens[:ended[0] if ended else len(tokens)], skip_special_tokens=True)


def render(text: TextConfig, messages: list[dict], add_generation_prompt: bool = True) -> str:
    if len(text.chat_template) > MAX_TEMPLATE:
        raise RewriterError(f"the chat template is {len(text.chat_template)} characters, more "
                            f"than the {MAX_TEMPLATE} allowed")
    try:
        template = _environment().from_string(text.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **text.special_tokens)
    except Exception as e:  # jinja raises TemplateError, SecurityError and friends
        raise RewriterError(f"the chat template failed to render: {type(e).__name__}: {e}") from e


def _environment():
    import json
    from datetime import datetime

    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and _is_number(right) and abs(right) > 4096 and _is_number(left) \
                    and abs(left) > 1:
                raise SecurityError(f"{left!r:.20} ** {right!r:.20} is too large")
            sequence = isinstance(left, _SEQUENCES) or isinstance(right, _SEQUENCES)
            if operator == "*" and sequence and _size(left) * _size(right) > MAX_SIZE:
                raise SecurityError(f"a product of {_size(left)} x {_size(right)} elements is "
                                    f"more than the {MAX_SIZE} allowed")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise TemplateError(message)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


_SEQUENCES = (str, bytes, list, tuple)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _size(x) -> int:
    """How many elements ``x`` contributes to a product: its length, or the number itself."""
    if isinstance(x, (str, bytes, list, tuple)):
        return max(1, len(x))
    if isinstance(x, int) and not isinstance(x, bool):
        return max(1, abs(x))
    return 1


def _messages(messages: Messages) -> list[dict]:
    """``messages`` as ``{"role", "content"}`` dicts of text the tokenizer takes, every
    part checked by name (a lone surrogate would reach the tokenizer as a TypeError). The
    roles are the template's to define (``tool``, ``ipython``): any string."""
    if isinstance(messages, str):
        return [{"role": "user", "content": utf8_text("messages", messages)}]
    if isinstance(messages, (bytes, bytearray, dict)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a string or a list of {{'role', 'content'}} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', "
                             f"got {m!r:.80}")
        for key in ("role", "content"):
            utf8_text(f"messages[{i}][{key!r}]", m.get(key))
    return [{"role": m["role"], "content": m["content"]} for m in messages]
