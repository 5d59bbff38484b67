"""On a CUDA device: every decoding strategy (plain, self-speculative, Medusa, Hydra and EAGLE
tree verification) on both backends gives plain greedy decoding's tokens, ragged batches
included. Skipped without a GPU; ``benchmarks/gpu_suite.sh tests`` runs them on one."""
import pytest
import torch

import rewriter
from rewriter.models.checkpoints import default_model
from rewriter.passes import (EagleDraft, FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU, HydraHeads,
                             MedusaHeads, SelfSpeculative)

from conftest import random_draft

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROWS = [[3, 17, 42, 5, 99, 8, 64], [1, 2, 3], [50, 60, 70, 80, 90]]
STRATEGIES = {
    "plain": lambda: [],
    "self": lambda: [SelfSpeculative(skip_layers=[1], max_draft=4, threshold=0.0)],
    "medusa": lambda: [MedusaHeads(weights="default")],
    "hydra": lambda: [HydraHeads(weights="default", draft_vocab=512)],
    "eagle": lambda draft: [EagleDraft(weights=draft, nodes=6, depth=3)],  # a random draft
}


def passes(strategy: str, draft: str) -> list:
    return STRATEGIES[strategy](draft) if strategy == "eagle" else STRATEGIES[strategy]()


@pytest.fixture(scope="module")
def cuda_model():
    model, _ = default_model()
    return model.cuda()


@pytest.fixture(scope="module")
def eagle_draft(tmp_path_factory):
    """A seeded random EAGLE draft for the default model: it is rarely right, so a round
    accepts little, and every token is the model's."""
    model, _ = default_model()  # on the CPU: the file is written from there
    return str(random_draft(model, tmp_path_factory.mktemp("eagle") / "draft.safetensors"))


@pytest.fixture(scope="module")
def reference(cuda_model):
    plain = rewriter.optimize(cuda_model)
    plain.static_decode = False  # the eager torch step: the plainest reference there is
    return plain.generate(ROWS, max_new_tokens=24, eos_token_id=[])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_strategies_on_cuda_give_plain_greedy_tokens(cuda_model, reference, eagle_draft, strategy,
                                                     backend):
    fusions = [FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm(), FuseRoPE()] if backend == "triton" else []
    if strategy == "self":  # a fused add + norm joins two layers: refused with a skip set
        fusions = [f for f in fusions if not isinstance(f, FuseAddRMSNorm)]
    opt = rewriter.optimize(cuda_model, passes=[*passes(strategy, eagle_draft), *fusions], backend=backend)
    if strategy != "plain":
        opt.fallback = False  # never the speed guard's plain arm
    got = opt.generate(ROWS, max_new_tokens=24, eos_token_id=[])
    assert got.device == reference.device
    assert torch.equal(got, reference), (got != reference).nonzero()[:4].tolist()
    assert strategy == "plain" or opt.stats["rounds"] > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_ragged_batch_on_cuda_equals_each_row_alone(cuda_model, backend):
    opt = rewriter.optimize(cuda_model, passes=[MedusaHeads(weights="default")], backend=backend)
    kw = dict(max_new_tokens=16, eos_token_id=[])
    together = opt.generate(ROWS, **kw)
    for i, row in enumerate(ROWS):
        alone = opt.generate([row], **kw)
        assert torch.equal(together[i, -16:], alone[0, -16:])


@pytest.mark.parametrize("strategy", ["self", "medusa", "hydra", "eagle"])
def test_rounds_on_cuda_replay_captured_graphs(cuda_model, reference, eagle_draft, strategy, monkeypatch):
    """Every step of a round (drafts, the verification, the heads) is replayed from a CUDA
    graph with the torch backend, and gives the eager rounds' tokens."""
    import warnings

    from rewriter.runtime.replay import Replay
    replays = []
    real = Replay.__init__

    def keep(self, *args, **kwargs):
        replays.append(self)
        real(self, *args, **kwargs)
    monkeypatch.setattr(Replay, "__init__", keep)
    opt = rewriter.optimize(cuda_model, passes=passes(strategy, eagle_draft))
    opt.fallback = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a capture that fails warns
        got = opt.generate(ROWS, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(got, reference)
    called = [r for r in replays if r.calls >= 2]  # the second call captures (or fails)
    assert opt.stats["rounds"] > 0 and called and all(r.graph is not None for r in called)
    opt.static_decode = False  # the eager rounds
    assert torch.equal(opt.generate(ROWS, max_new_tokens=24, eos_token_id=[]), reference)
