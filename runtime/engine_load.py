"""``load``: the ``Engine`` stored in an artifact directory, its step programs built.

    engine = load("artifacts/model")                    # rewriter.load
    engine = load("artifacts/model", backend="torch")   # a Triton artifact on a CPU
"""
from __future__ import annotations

import warnings
from typing import Optional

from rewriter.errors import ArtifactError, RewriterError
from rewriter.values import check_flag, path_argument

from .artifact import Stored, read
from .artifact_dir import IR_FILE, KERNELS_DIR
from .artifact_info import measured_elsewhere
from .engine import BACKENDS, Engine


def load(directory, trust_code: bool = False, backend: Optional[str] = None) -> Engine:
    """The ``Engine`` stored in an artifact directory (``runtime.artifact.read`` checks
    every file first). Stored kernel sources run only with ``trust_code=True``; ``backend``
    overrides the one it was saved with. The step programs are built here, so an IR they
    cannot be built from is an ``ArtifactError`` now, not at the first ``generate``."""
    check_flag("trust_code", trust_code)  # "no" is truthy: it must not run stored code
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None (the "
                         f"artifact's own), got {backend!r}")
    stored = read(path_argument("directory", directory), backend)
    engine = Engine(stored.ir, stored.tokenizer, stored.passes, stored.backend, stored.text)
    if trust_code:
        engine.trusted_kernels = stored.kernels
    try:
        engine.lower()
    except RewriterError as e:
        raise _lowering_error(stored, trust_code, e) from e
    elsewhere = measured_elsewhere(engine.ir.info, engine.backend, engine._device())
    if elsewhere:  # still exact, perhaps slower: said, not refused
        warnings.warn(f"{stored.directory}: {elsewhere}", RuntimeWarning, stacklevel=2)
    return engine


def _lowering_error(stored: Stored, trust_code: bool, e: RewriterError) -> ArtifactError:
    """A stored kernel that does not import (run only with ``trust_code``) is named by its
    file in the artifact; anything else is the IR's."""
    if trust_code and stored.backend == "triton":
        from rewriter.codegen.pointwise import KernelSourceError  # triton is here: it lowered
        if isinstance(e, KernelSourceError) and e.kernel in stored.kernels:
            return ArtifactError(f"{stored.directory / KERNELS_DIR / e.kernel}.py: "
                                 f"{e.problem} (a stored kernel, run as trust_code=True asked)")
    return ArtifactError(f"{stored.directory / IR_FILE}: the step programs cannot "
                         f"be built: {e}")
