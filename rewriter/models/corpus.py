"""Text corpus and synthetic pass-key data for the default model.

Everything here is deterministic and uses only the standard library (and no
network): the corpus is the Python standard library source that ships with the
running CPython, split into train / held-out by a hash of each file's relative
path; pass-key samples are generated from an explicit ``random.Random``.

Typical use::

    from rewriter.models.corpus import load_corpus, passkey_sample
    heldout = load_corpus("heldout")                  # [(relpath, text), ...]
    s = passkey_sample(tok, 1024, depth=0.5, rng=random.Random(0))
    ids = tok(s.prompt)["input_ids"]                  # len(ids) + answer <= 1024
    ok = s.check(generated_text)                      # digits match?
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

# --------------------------------------------------------------------------- corpus

#: directory names anywhere in a path that exclude the file
EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
    "lib-dynload",
    "encodings",   # mostly generated charmap tables
    "pydoc_data",  # one generated 750 kB string of documentation
})
#: file-name prefixes that exclude the file (machine-specific build data)
EXCLUDED_PREFIXES = ("_sysconfigdata",)

HELDOUT_FRACTION = 0.08


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded_dir(name: str) -> bool:
    """True if files under a directory of this name are not part of the corpus."""
    return name in EXCLUDED_DIRS or name.startswith("config-")


def list_stdlib_files(root: Optional[Path] = None) -> List[str]:
    """Sorted relative paths (POSIX style) of the corpus's ``*.py`` files."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    # Excluded directories are not walked at all: site-packages alone can hold tens of
    # thousands of files under the root. Like ``rglob``, links to directories are not followed.
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not _excluded_dir(d)]
        rel = Path(top).relative_to(root)
        out.extend((rel / f).as_posix() for f in files
                   if f.endswith(".py") and os.path.isfile(os.path.join(top, f))
                   and not f.startswith(EXCLUDED_PREFIXES))
    return sorted(out)


def split_of(relpath: str, heldout_fraction: float = HELDOUT_FRACTION) -> str:
    """``"heldout"`` or ``"train"``, from a SHA-256 of the relative path."""
    h = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16)
    return "heldout" if h < heldout_fraction * 0x100000000 else "train"


def load_corpus(split: str = "train", root: Optional[Path] = None,
                heldout_fraction: float = HELDOUT_FRACTION) -> List[Tuple[str, str]]:
    """``[(relpath, text), ...]`` of one split (``train``, ``heldout`` or ``all``)."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}")
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for rel in list_stdlib_files(root):
        if split == "all" or split_of(rel, heldout_fraction) == split:
            out.append((rel, (root / rel).read_text(encoding="utf-8", errors="replace")))
    return out


def corpus_description(root: Optional[Path] = None) -> dict:
    """Provenance of the corpus: interpreter, root, file/byte counts, content hash."""
    root = Path(root) if root is not None else stdlib_root()
    desc = {"source": "CPython standard library *.py", "python": sys.version.split()[0],
            "root": str(root), "excluded_dirs": sorted(EXCLUDED_DIRS),
            "excluded_prefixes": list(EXCLUDED_PREFIXES),
            "heldout_fraction": HELDOUT_FRACTION, "split_rule": "sha256(relpath)"}
    for split in ("train", "heldout"):
        docs = load_corpus(split, root)
        h = hashlib.sha256()
        for rel, text in docs:
            h.update(rel.encode() + b"\0" + text.encode("utf-8") + b"\0")
        desc[split] = {"files": len(docs), "chars": sum(len(t) for _, t in docs),
                       "sha256": h.hexdigest()}
    return desc


def code_lines(docs: Iterable[Tuple[str, str]], max_len: int = 200) -> List[str]:
    """Non-blank source lines (with ``\\n``) usable as pass-key filler."""
    out = []
    for _, text in docs:
        out.extend(l + "\n" for l in text.splitlines() if l.strip() and len(l) <= max_len)
    return out


# --------------------------------------------------------------------------- pass key

PASSKEY_INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. "
                 "Find it and memorize it. I will quiz you about the pass key.\n")
PASSKEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "What is the pass key? The pass key is"
FILLER_SENTENCES = ("The grass is green. ", "The sky is blue. ", "The sun is yellow. ",
                    "Here we go. ", "There and back again.\n")


def token_counter(tokenizer) -> Callable[[str], int]:
    """A ``text -> number of tokens`` function for several tokenizer kinds.

    Accepts a transformers tokenizer (counts what ``tokenizer(text)`` returns,
    special tokens included), a ``tokenizers.Tokenizer`` (``encode(text).ids``),
    or a plain callable returning an int.
    """
    if hasattr(tokenizer, "encode") and hasattr(tokenizer, "get_vocab_size"):
        return lambda text: len(tokenizer.encode(text).ids)
    if hasattr(tokenizer, "encode"):
        return lambda text: len(tokenizer(text)["input_ids"])
    return tokenizer


@dataclass
class PasskeySample:
    """One pass-key prompt; the model should continue ``prompt`` with ``target``."""
    prompt: str
    key: str            #: the digits, e.g. "48213"
    depth: float        #: requested fractional depth of the key line in the filler
    n_tokens: int       #: tokens in ``prompt`` as counted by the tokenizer given
    context_tokens: int  #: requested budget for prompt + target
    filler: str
    key_char_offset: int = field(default=0)  #: where the key line starts in ``prompt``

    @property
    def target(self) -> str:
        """Exact expected continuation (a space, then the digits)."""
        return " " + self.key

    def check(self, continuation: str) -> bool:
        """True if the continuation's first run of digits equals the key."""
        m = re.match(r"\s*(\d+)", continuation)
        return bool(m) and m.group(1) == self.key


def _filler_units(kind: str, rng: random.Random, lines: Optional[Sequence[str]],
                  n: int) -> List[str]:
    """``n`` filler pieces: cycled fixed sentences, or consecutive code lines."""
    if kind == "sentences":
        return [FILLER_SENTENCES[i % len(FILLER_SENTENCES)] for i in range(n)]
    if kind == "code":
        if not lines:
            raise ValueError("filler='code' needs code_lines")
        start = rng.randrange(len(lines))
        return [lines[(start + i) % len(lines)] for i in range(n)]
    raise ValueError(f"unknown filler kind {kind!r}")


def _assemble(units: Sequence[str], n: int, k: int, key_line: str) -> Tuple[str, int]:
    """Prompt with ``units[:n]`` as filler and the key line after unit ``k``."""
    head = PASSKEY_INTRO + "".join(units[:k])
    return head + key_line + "".join(units[k:n]) + PASSKEY_QUESTION, len(head)


def _split_index(costs: Sequence[int], n: int, depth: float) -> int:
    """Unit index whose cumulative token cost first reaches ``depth`` of the total."""
    target, acc = depth * sum(costs[:n]), 0
    for i in range(n):
        if acc >= target:
            return i
        acc += costs[i]
    return n


def passkey_sample(tokenizer, context_tokens: int, depth: float, rng: random.Random,
                   n_digits: int = 5, filler: str = "sentences",
                   lines: Optional[Sequence[str]] = None) -> PasskeySample:
    """A prompt of at most ``context_tokens`` tokens *including* the answer.

    The key line sits at fractional ``depth`` (0 = right after the intro, 1 =
    just before the question) of the filler. ``rng`` alone decides the key and
    the code-filler offset, so the same seed gives the same sample. The prompt
    is filled to within a few tokens of the budget; ``n_tokens`` is exact.
    """
    count = token_counter(tokenizer)
    key = str(rng.randrange(1, 10)) + "".join(str(rng.randrange(10)) for _ in range(n_digits - 1))
    key_line = PASSKEY_LINE.format(key=key)
    empty, memo = count(""), {}
    budget = context_tokens - (count(" " + key) - empty)  # leave room for the answer
    base = count(_assemble([], 0, 0, key_line)[0])
    if base > budget:
        raise ValueError(f"context_tokens={context_tokens} too small (fixed part {base})")
    units = _filler_units(filler, rng, lines, budget - base + 8)
    for u in set(units):
        memo[u] = count(u) - empty
    costs = [memo[u] for u in units]
    n, acc = 0, base
    while n < len(units) and acc + costs[n] <= budget:
        acc, n = acc + costs[n], n + 1

    def build(m: int) -> Tuple[str, int, int]:
        text, off = _assemble(units, m, _split_index(costs, m, depth), key_line)
        return text, off, count(text)

    prompt, off, used = build(n)
    while used > budget and n > 0:  # the additive estimate overshot: drop units
        excess = used - budget
        while excess > 0 and n > 0:
            n, excess = n - 1, excess - costs[n - 1]
        prompt, off, used = build(n)
    while n < len(units):  # it undershot: add units while the exact count fits
        cand = build(n + 1)
        if cand[2] > budget:
            break
        n, (prompt, off, used) = n + 1, cand
    return PasskeySample(prompt, key, depth, used, context_tokens, filler, off)


# --------------------------------------------------------------------------- English prose

def prose_paragraphs() -> List[str]:
    """English prose that every CPython ships: the paragraphs of the language reference
    in ``pydoc_data/topics.py`` (the text ``help()`` shows), without its indented code and
    grammar blocks and its heading underlines. Deterministic, sorted by topic name."""
    from pydoc_data.topics import topics
    out = []
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            lines = para.split("\n")
            if not lines[0] or lines[0][0].isspace():
                continue  # an indented block: code, grammar or a table
            if all(re.fullmatch(r"[*=\-^~]+", ln.strip() or "*") for ln in lines[1:2]) and len(lines) <= 2:
                continue  # a heading and its underline
            text = " ".join(ln.strip() for ln in lines)
            if len(text.split()) >= 12:  # sentences, not labels
                out.append(text)
    return out
