"""The training/evaluation corpus: a deterministic split and well-formed pass-key prompts."""
import random

import pytest

from rewriter.models import corpus


class WordTokenizer:
    """Counts whitespace-separated words: enough to check budgets without a trained BPE."""

    def __call__(self, text):
        return {"input_ids": text.split()}

    def encode(self, text):
        return text.split()


def test_split_is_deterministic_and_covers_every_file():
    files = corpus.list_stdlib_files()
    assert len(files) > 100
    splits = [corpus.split_of(f) for f in files]
    assert splits == [corpus.split_of(f) for f in files]
    assert set(splits) == {"train", "heldout"}
    assert 0.01 < splits.count("heldout") / len(splits) < 0.5


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_passkey_prompt_fits_the_budget_and_hides_the_key_at_depth(depth):
    tok = WordTokenizer()
    sample = corpus.passkey_sample(tok, 300, depth, random.Random(7))
    assert sample.n_tokens <= 300 and sample.n_tokens > 250
    assert sample.key.isdigit() and len(sample.key) == 5
    assert sample.key in sample.prompt[sample.key_char_offset:]  # the key line is where it says
    position = sample.key_char_offset / len(sample.prompt)
    assert abs(position - depth) < 0.15
    assert sample.check(sample.target) and not sample.check(" 00000")


def test_passkey_samples_repeat_under_the_same_seed():
    tok = WordTokenizer()
    a = corpus.passkey_sample(tok, 200, 0.5, random.Random(3))
    b = corpus.passkey_sample(tok, 200, 0.5, random.Random(3))
    c = corpus.passkey_sample(tok, 200, 0.5, random.Random(4))
    assert a == b and a.key != c.key
