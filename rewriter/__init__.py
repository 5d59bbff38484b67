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
from rewriter import ops  # registers the rw ops before anything traces or loads a graph
from rewriter.models.checkpoints import default_model
from rewriter.api.pretrained import from_pretrained
from rewriter.errors import ArtifactError, PassError, RewriterError, TraceError, VerificationError
from rewriter.ir.core import IR
from rewriter.api.optimized import OptimizedModel, optimize
from rewriter.ir.pass_manager import Pass
from rewriter.api.traced import TracedModel, trace
from rewriter.runtime.engine_load import load
from rewriter.runtime.engine import Engine

from rewriter.version import __version__
__all__ = ["trace", "TracedModel", "optimize", "OptimizedModel", "Engine", "load",
           "from_pretrained", "default_model", "IR", "Pass", "ops", "RewriterError",
           "TraceError", "PassError", "VerificationError", "ArtifactError", "__version__"]
