"""What the passes that select from a whole cache (Quest's pages, TidalDecode's tokens)
check of the IR before they change it."""
from __future__ import annotations

from torch import fx

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.nodes import attention_args
from rewriter.ops import OPS


def attention_nodes(ir: IR) -> list[fx.Node]:
    """The IR's attention nodes in layer order."""
    return sorted(ir.graph.find_nodes(op="call_function", target=OPS["attention"]),
                  key=lambda n: attention_args(n)["layer"])


def local_layers(nodes: list[fx.Node]) -> set[int]:
    """The layers of ``nodes`` that are a model's local layers: a sliding window of the
    model's own (no sinks, no selection) in a model whose other layers see the whole
    context (Gemma 3's local:global pattern). Empty when every layer has a window
    (Mistral) or none has.

    The sparse passes leave these layers as they are: the window is what the model was
    trained with, a decode step already reads at most ``window`` keys of them (the runtime
    keeps them in a window-sized ring), and a selection or sinks on top would change the
    arithmetic for nothing in memory or reads; the global layers are the whole caches a
    sparse pass is for."""
    local = {attention_args(n)["layer"] for n in nodes if _native_window(attention_args(n))}
    whole = {attention_args(n)["layer"] for n in nodes} - local
    return local if whole else set()


def _native_window(args: dict) -> bool:
    return args["window"] is not None and args["sinks"] is None and args["select"] is None \
        and args["full_heads"] is None


def check_not_speculative(p, ir: IR) -> None:
    """``PassError`` naming pass ``p`` after a speculative strategy."""
    if ir.info.get("decoding") is not None:
        raise PassError(f"{p!r} cannot follow a speculative strategy: a verify step "
                        f"spans several tokens, which the runtime attends densely")


def check_whole(p, nodes: list[fx.Node], selector: str) -> None:
    """``PassError`` naming pass ``p`` where a selection cannot go: an attention that
    already limits what it sees, or one after FuseRoPE (the selection reads the rotated
    q and k)."""
    for n in nodes:
        args = attention_args(n)
        if args["window"] is not None or args["sinks"] is not None or args["select"] is not None:
            raise PassError(f"{p!r}: {n.name} already limits what it sees (window="
                            f"{args['window']}, sinks={args['sinks']}, select="
                            f"{'a selection' if args['select'] is not None else None}); "
                            f"{selector} selects from a whole cache")
        if args["cos"] is not None:
            raise PassError(f"{p!r} must run before FuseRoPE: the selection reads the "
                            f"rotated q and k")
