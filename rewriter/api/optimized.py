"""``optimize()`` and the ``OptimizedModel`` it returns."""
from __future__ import annotations

import copy
import json
import os
from typing import Sequence

import torch
from torch import fx, nn

from rewriter.frontend import build_ir
from rewriter.ir.core import IR
from rewriter.ir.dump import Dumper
from rewriter.ir.verify import verify
from rewriter.ir.pass_manager import Pass, run_pipeline
from rewriter.ir.sharing import readers_of
from rewriter.runtime.chat import split_tokenizer
from rewriter.runtime.engine import BACKENDS, Engine
from rewriter.runtime.kv_cache import cache_table, describe
from rewriter.runtime.measurer import RuntimeMeasurer
from rewriter.api.traced import TracedModel, check_model
from rewriter.values import check_flag, path_argument
from rewriter.measure.machine import timed_backend


class OptimizedModel(Engine):
    """The optimized program: ``generate`` / ``stream`` / ``save`` (from ``Engine``), call it
    for logits, print ``.ir``, ``dump()`` the IR after every pass."""

    def __init__(self, ir: IR, passes: list[Pass], history: list[dict], backend: str,
                 snapshots: list[tuple[str, IR]] | None = None, tokenizer=None):
        super().__init__(ir, tokenizer, [{"name": p.name, "params": p.params()} for p in passes],
                         backend)
        self.passes = passes
        self.history = history
        self._snapshots = snapshots or []

    def dump(self, directory: str | os.PathLike) -> None:
        """Write the IR after every pass (text, DOT, op diff) into ``directory``, the step
        programs the runtime runs (``programs/<name>.py``), and with the Triton backend
        ``kernels/``: every generated kernel's source and the templates."""
        dumper = Dumper(path_argument("directory", directory))
        for name, ir in self._snapshots:
            dumper.write(name, ir)
        if self.ir.is_causal_lm and self._programs is not None:  # the code that runs
            for name, code in self.programs().items():
                dumper.write_text(f"programs/{name}.py", code.strip() + "\n")
            caches = cache_table(self.ir.gm)
            table = describe(caches, self._dtype(), readers_of(self.ir.graph, caches))
            dumper.write_text("programs/caches.json", json.dumps(table, indent=1) + "\n")
        if self.backend == "triton" and self.ir.is_causal_lm:
            for name, source in self.kernel_sources(templates=True).items():
                dumper.write_text(f"kernels/{name}", source)

    def __repr__(self) -> str:
        return f"OptimizedModel({self.ir.summary()}, passes={self.passes}, backend={self.backend!r})"


def optimize(model: nn.Module | TracedModel, passes: Sequence[Pass] = (), backend: str = "torch",
             check: bool = True, dump: str | os.PathLike | None = None,
             example_inputs: tuple | None = None, progress: bool = False,
             tokenizer=None) -> OptimizedModel:
    """Trace ``model``, lift it into the canonical IR, and run ``passes`` in order.

    ``model`` may be one ``rewriter.trace`` returned: the passes then run on a copy of its
    IR (no trace; the traced model stays as it was for the next pipeline), and its
    tokenizer is kept unless ``tokenizer`` names another.

    ``check`` verifies the IR after every pass; ``dump`` (or ``$REWRITER_DUMP``) writes the
    IR after every pass into a directory. ``example_inputs`` is needed only for modules that
    are not Hugging Face causal LMs. ``progress`` shows a progress bar (trace, then each pass).
    ``tokenizer`` (a fast Hugging Face tokenizer or a ``tokenizers.Tokenizer``) is kept with
    the result, its chat template too, and saved with it. Passes that choose by timing
    (``tree="auto"``, ``adapt``, ``calibrate``) time the programs ``backend`` lowers, on the
    model's device (``rewriter.runtime.measurer``).
    """
    _check_arguments(model, passes, check, dump, progress)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if backend == "triton":
        from rewriter.runtime.triton_backend import available
        reason = available(_device(model))
        if reason is not None:
            raise ValueError(reason)
    passes = list(passes)
    tokenizer = _tokenizer(model, example_inputs, tokenizer)
    bar = _progress(progress, 1 + len(passes))
    ir = model.ir if isinstance(model, TracedModel) else build_ir(model, example_inputs)
    if check:
        verify(ir)
    snapshots = [("lift", _snapshot(ir))]
    bar.update()

    def on_step(name: str, cur: IR) -> None:
        snapshots.append((name, _snapshot(cur)))
        bar.update()
    try:
        history = run_pipeline(ir, passes, check=check, on_step=on_step,
                               measurer=_measurer(backend, _device(model)))
    finally:
        bar.close()
    opt = OptimizedModel(ir, passes, history, backend, snapshots, tokenizer)
    opt.lower()  # errors surface here, not at the first generate
    dump = dump or os.environ.get("REWRITER_DUMP")
    if dump:
        opt.dump(dump)
    return opt


def _check_arguments(model, passes, check, dump, progress) -> None:
    """``optimize``'s arguments, by name, before anything is traced: objects of the wrong
    kind are a TypeError, as a tokenizer or a pass of the wrong kind is."""
    if not isinstance(model, TracedModel):
        check_model(model)
    if isinstance(passes, (str, bytes)) or not isinstance(passes, Sequence):
        raise TypeError(f"passes must be a list of passes, got {type(passes).__name__} (a "
                        f"spec string such as 'layer_skip:speedup=2' is read by "
                        f"rewriter.passes.from_spec)")
    check_flag("check", check)
    check_flag("progress", progress)
    if dump is not None and dump != "":  # "": none, as $REWRITER_DUMP unset is
        path_argument("dump", dump)


def _tokenizer(model, example_inputs, tokenizer):
    """The tokenizer to keep (a traced model's own unless another is given), checked now:
    one of the wrong kind fails before the trace."""
    if isinstance(model, TracedModel):
        if example_inputs is not None:
            raise ValueError("example_inputs: the model is traced already (rewriter.trace "
                             "takes them)")
        tokenizer = model.tokenizer if tokenizer is None else tokenizer
    split_tokenizer(tokenizer)
    return tokenizer


def _measurer(backend: str, device) -> RuntimeMeasurer:
    """The runtime's measurer for the engine's backend and device (``timed_backend``: the
    torch kernels where Triton would run in its CPU interpreter)."""
    return RuntimeMeasurer(timed_backend(backend, device), device)


def _device(model: nn.Module | TracedModel) -> torch.device:
    if isinstance(model, TracedModel):
        return model.device
    return next(iter(model.parameters()), torch.empty(0)).device


def _snapshot(ir: IR) -> IR:
    """A copy of the graph (nodes copied, weights and fake values shared) for dumps, so
    later passes do not change what an earlier step shows."""
    graph = fx.Graph()
    out = graph.graph_copy(ir.gm.graph, {})
    graph.output(out)
    return IR(fx.GraphModule(ir.gm, graph), copy.deepcopy(ir.info))


def _progress(enabled: bool, total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="optimize (trace, passes)", unit="step", disable=not enabled,
                leave=False)
