"""rewriter: a compiler for LLM inference.

    import rewriter
    from rewriter.passes import LayerSkip
    opt = rewriter.optimize(model, passes=[LayerSkip(speedup=1.5)])
    logits = opt(input_ids)
    print(opt.ir)
"""
from . import ops  # registers the rw ops before anything traces or loads a graph
from .errors import PassError, RewriterError, TraceError, VerificationError
from .ir.core import IR
from .optimized import OptimizedModel, optimize
from .pass_manager import Pass

__version__ = "0.1.0"
__all__ = ["optimize", "OptimizedModel", "IR", "Pass", "ops", "RewriterError", "TraceError",
           "PassError", "VerificationError", "__version__"]
