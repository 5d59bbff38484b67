"""The draft trainers' loop (``rewriter.training.draft_loop.train_rows``, which
``rewriter train-eagle`` trains with): a step count, or a time budget that
ends training and runs the learning rate's cosine down to it."""
import types

import pytest
import torch

from rewriter.training import draft_loop
from conftest import Clock

VOCAB, DEPTH = 11, 2


def _data(rows: int = 6, length: int = 12) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, VOCAB, (rows, length), generator=g),
            "start": torch.full((rows,), 3), "end": torch.full((rows,), length)}


def _run(monkeypatch, steps: int, seconds=None, tick: float = 1.0, every: int = 0):
    bias = torch.zeros(VOCAB, requires_grad=True)
    opt = torch.optim.AdamW([bias], lr=0.1, weight_decay=0.0)
    lrs, saved = [], []

    def logits_of(data, rows, pairs):  # [P, DEPTH, V]: one learnt bias
        lrs.append(opt.param_groups[0]["lr"])
        return bias.expand(len(pairs), DEPTH, VOCAB)
    monkeypatch.setattr(draft_loop, "time", types.SimpleNamespace(perf_counter=Clock(tick)))
    args = types.SimpleNamespace(steps=steps, rows=2, positions=8, seed=0)
    loss = draft_loop.train_rows(opt, _data(), args, logits_of, DEPTH, warmup=2, every=every,
                                   seconds=seconds, checkpoint=saved.append if every else None)
    return args.steps_done, lrs, saved, loss, bias


def test_without_a_budget_it_takes_every_step_at_warmup_cosines_rates(monkeypatch):
    """Without a budget the loop trains as it did before budgets existed:
    the same steps at ``warmup_cosine``'s rates, to the last bit."""
    done, lrs, _, loss, bias = _run(monkeypatch, steps=30)
    assert done == 30 and len(lrs) == 30 and loss == loss  # a number, not NaN
    assert bias.abs().sum() > 0  # it trained
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched, want = draft_loop.warmup_cosine(opt, 30, 2), []
    for _ in range(30):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == want and lrs[-1] < 0.002  # the cosine ran down over the steps (from 0.1)


def test_a_time_budget_ends_training_early_with_the_cosine_run_down(monkeypatch):
    """Every clock read moves a second: a 20 s budget ends long before 1000 steps, and
    the learning rate falls to near zero as the seconds run out."""
    done, lrs, _, _, _ = _run(monkeypatch, steps=1000, seconds=20.0)
    assert 3 <= done < 20 and len(lrs) == done
    peak = max(lrs)
    assert lrs[-1] < 0.35 * peak  # well down the cosine by the last step
    after = lrs[lrs.index(peak):]
    assert all(b <= a + 1e-12 for a, b in zip(after, after[1:]))  # falling after the warm-up


def test_steps_end_it_first_when_they_run_out_before_the_seconds(monkeypatch):
    done, _, _, _, _ = _run(monkeypatch, steps=7, seconds=1e9)
    assert done == 7


def test_the_checkpoint_is_called_after_every_every_th_step(monkeypatch):
    done, _, saved, _, _ = _run(monkeypatch, steps=25, every=10)
    assert done == 25 and saved == [10, 20]


def test_a_budget_of_no_seconds_or_a_checkpoint_never_called_is_refused(monkeypatch):
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="seconds must be > 0"):
            _run(monkeypatch, steps=5, seconds=bad)
    bias = torch.zeros(VOCAB, requires_grad=True)
    args = types.SimpleNamespace(steps=5, rows=2, positions=8, seed=0)
    with pytest.raises(ValueError, match="give every >= 1"):
        draft_loop.train_rows(torch.optim.AdamW([bias]), _data(), args,
                                lambda d, r, p: bias.expand(len(p), DEPTH, VOCAB), DEPTH,
                                warmup=2, checkpoint=lambda step: None)
