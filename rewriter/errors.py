"""The errors a user of rewriter can catch."""


class RewriterError(Exception):
    """Base class of every error rewriter raises on purpose."""


class TraceError(RewriterError):
    """The model could not be traced into a graph."""


class PassError(RewriterError):
    """A pass failed, or left an IR that does not verify."""


class VerificationError(RewriterError):
    """An IR broke one of its invariants (raised inside a PassError when a pass caused it)."""


class ArtifactError(RewriterError):
    """An artifact directory cannot be loaded: the message names the file and the reason."""


class CheckpointError(RewriterError, ValueError):
    """A checkpoint directory cannot be loaded as it is: the message names the file (or
    the weights) and the reason. Also a ValueError, which these errors were before."""


class UncacheableError(RewriterError):
    """The KV-cache runtime cannot run this IR (attention it could not lift, or values that
    mix positions): generation is refused; calling the model for logits still works."""
