"""rewriter: a compiler for LLM inference.

    import rewriter
    from rewriter.passes import LayerSkip
    opt = rewriter.optimize(model, passes=[LayerSkip(speedup=1.5)])
    out = opt.generate(input_ids, max_new_tokens=64)
    print(opt.ir)
    opt.save("artifacts/model"); engine = rewriter.load("artifacts/model")

    traced = rewriter.trace(model, tokenizer=tokenizer)  # traced once, for many pipelines
    fused = rewriter.optimize(traced, passes=[FuseQKV(), FuseSwiGLU()])
"""
from . import ops  # registers the rw ops before anything traces or loads a graph
from .checkpoints import default_model, from_pretrained
from .errors import ArtifactError, PassError, RewriterError, TraceError, VerificationError
from .ir.core import IR
from .optimized import OptimizedModel, optimize
from .pass_manager import Pass
from .traced import TracedModel, trace
from .runtime.engine import load
from .runtime.engine import Engine

from .version import __version__
__all__ = ["trace", "TracedModel", "optimize", "OptimizedModel", "Engine", "load",
           "from_pretrained", "default_model", "IR", "Pass", "ops", "RewriterError",
           "TraceError", "PassError", "VerificationError", "ArtifactError", "__version__"]
