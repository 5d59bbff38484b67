"""What an artifact's parts must agree on, checked at load: each disagreement is an
``ArtifactError`` naming both sides, instead of an IndexError (or wrong tokens) later.

- ``manifest.json``'s model section against the IR: family, config, layer count,
  parameter count, the dtype of the weights; its pass list, ``measured_on`` and
  ``kv_sharing`` against those ``ir.json`` records and against what the passes left in ``info`` (fusion counts,
  skipped layers);
- the weights' dtypes: one floating dtype for the model (RoPE frequencies may differ);
- the config against the graph: vocabulary size against the token embedding's rows and
  the logits' width, the context length against a learned position table, head counts,
  head size, window and norm epsilon against the ops' attributes.
"""
from __future__ import annotations

import torch
from torch import fx

from rewriter.decoding import TreeDecoding, strategy_of
from rewriter.errors import ArtifactError
from rewriter.ir.core import IR
from rewriter.ir.sharing import sources
from rewriter.ops import OPS, op_arguments
from rewriter.values import context_length, shown

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_NAMES = {op: name for name, op in OPS.items()}


def check_agreement(ir: IR, manifest: dict, where) -> None:
    dtype = _check_dtypes(ir, where)
    _check_manifest_model(ir, manifest, dtype, where)
    _check_passes(ir, manifest, where)
    if ir.is_causal_lm:
        _check_vocabulary(ir, where)
        _check_attention(ir, where)
        _check_norms(ir, where)


def _check_dtypes(ir: IR, where) -> torch.dtype | None:
    """The model's dtype (its largest floating weight's); every other floating weight has
    it, except tables only ``rw.rotary`` reads (RoPE frequencies stay float32)."""
    weights = ir.weights()
    floats = {name: t for name, t in weights.items() if t.is_floating_point()}
    for name, t in weights.items():
        if not t.is_floating_point() and t.dtype not in (torch.int64, torch.int32, torch.uint8, torch.bool):
            raise ArtifactError(f"{where.weights}: weight {name!r} is {t.dtype}, a dtype no op "
                                f"of {where.ir} takes")
    if not floats:
        return None
    dtype = max(floats.values(), key=torch.Tensor.numel).dtype
    if dtype not in FLOAT_DTYPES:
        raise ArtifactError(f"{where.weights}: the model's weights are {dtype}, not one of "
                            f"{[str(d) for d in FLOAT_DTYPES]}")
    readers = _readers(ir)
    for name, t in floats.items():
        if t.dtype != dtype and readers.get(name, set()) - {"rotary"}:
            raise ArtifactError(f"{where.weights}: weight {name!r} is {t.dtype} but the model is "
                                f"{dtype}; {where.ir} cannot run mixed weights")
    return dtype


def _readers(ir: IR) -> dict[str, set[str]]:
    """Weight name -> names of the ops that read it."""
    out: dict[str, set[str]] = {}
    for n in ir.graph.find_nodes(op="get_attr"):
        out.setdefault(n.target, set()).update(
            _NAMES.get(u.target, str(u.target)) for u in n.users)
    return out


def _check_manifest_model(ir: IR, manifest: dict, dtype, where) -> None:
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise ArtifactError(f"{where.manifest}: model must be an object, got {model!r:.80}")
    ours = {"family": ir.info["family"], "config": ir.info["config"], "layers": len(ir.layers),
            "parameters": ir.num_params(),
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None}
    if model.get("config") != ours.pop("config"):
        raise ArtifactError(f"{where.manifest}: model config differs from the config in "
                            f"{where.ir} ({_first_difference(model.get('config'), ir.info['config'])})")
    for key, value in ours.items():
        if model.get(key) != value or type(model.get(key)) is not type(value):
            raise ArtifactError(f"{where.manifest}: model {key} is {model.get(key)!r:.80}, but "
                                f"{where.ir} and {where.weights.name} give {value!r}")


def _first_difference(theirs, ours) -> str:
    if not isinstance(theirs, dict):
        return f"it is {type(theirs).__name__}"
    key = next(k for k in sorted(set(theirs) | set(ours), key=str)
               if theirs.get(k, KeyError) != ours.get(k, KeyError))
    return f"{key}: {theirs.get(key, 'absent')!r:.60} in the manifest, {ours.get(key, 'absent')!r:.60} in ir.json"


def _check_passes(ir: IR, manifest: dict, where) -> None:
    passes = manifest.get("passes")
    recorded = ir.info["passes"]  # written beside the graph by the same save
    if passes != recorded:
        raise ArtifactError(f"{where.manifest}: passes {_names(passes)} are not the passes "
                            f"{where.ir} records ({_names(recorded)})")
    names = {p.get("name") for p in passes if isinstance(p, dict)} if isinstance(passes, list) else set()
    fused = set(ir.info.get("fusions", {}))
    if fused - names:
        raise ArtifactError(f"{where.manifest}: passes {sorted(names)} lack {sorted(fused - names)}, "
                            f"which {where.ir} records as run (info fusions)")
    if "measured_on" in manifest and manifest["measured_on"] != ir.info.get("measured_on"):
        # absent: saved before manifests named it
        raise ArtifactError(f"{where.manifest}: measured_on {shown(manifest['measured_on'], 120)} is "
                            f"not what {where.ir} records ({shown(ir.info.get('measured_on'), 120)})")
    shared = {str(r): o for r, o in sorted(sources(ir.graph).items())}
    if manifest.get("kv_sharing") is not None and manifest["kv_sharing"] != shared:
        # absent or null: saved before manifests named it
        raise ArtifactError(f"{where.manifest}: kv_sharing {shown(manifest['kv_sharing'], 120)} "
                            f"is not the sharing of {where.ir}'s attention ({shown(shared, 120)})")
    if ("skipped_layers" in ir.info) != ("LayerSkip" in names):
        raise ArtifactError(f"{where.manifest}: passes {sorted(names)} and the skipped layers "
                            f"{where.ir} records ({ir.info.get('skipped_layers')}) disagree")


def _names(passes) -> list:
    return [p.get("name") if isinstance(p, dict) else p for p in passes] \
        if isinstance(passes, list) else passes


def _check_vocabulary(ir: IR, where) -> None:
    """Token ids up to ``vocab_size`` index the embedding; the logits have one per id."""
    config = ir.info["config"]
    vocab = config["vocab_size"]
    ids, positions = list(ir.graph.find_nodes(op="placeholder"))
    for n in ir.graph.find_nodes(op="call_function", target=OPS["embedding"]):
        rows = n.args[1].meta["val"].shape[0] if isinstance(n.args[1], fx.Node) else None
        if n.args[0] is ids and rows != vocab:
            raise ArtifactError(f"{where.ir}: config vocab_size is {vocab}, but the token "
                                f"embedding {n.args[1].target!r} has {rows} rows")
        context = context_length(config)
        if n.args[0] is positions and rows is not None and rows < context:
            raise ArtifactError(f"{where.ir}: the config's context is {context} tokens, but the "
                                f"position embedding {n.args[1].target!r} has {rows} rows")
    (out,) = ir.graph.find_nodes(op="output")
    value = out.args[0]
    if isinstance(value, (tuple, list)):  # (logits, draft): only draft heads add an output
        strategy = strategy_of(ir.info)
        drafted = isinstance(strategy, TreeDecoding) and strategy.drafts
        if len(value) != 2 or not drafted:
            raise ArtifactError(f"{where.ir}: the graph returns {len(value)} values; only a "
                                f"model with draft heads (a tree decoding record with a "
                                f"drafter) returns two, (logits, draft)")
        value = value[0]
    logits = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[-1] != vocab:
        shape = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ArtifactError(f"{where.ir}: config vocab_size is {vocab}, but the graph's output "
                            f"is {shape}, not logits [B, S, {vocab}] (the LM head's rows)")



def _config_heads(config: dict) -> dict:
    """num_heads, num_kv_heads and head_dim as the config gives them (None: not given)."""
    heads = config.get("num_attention_heads") or config.get("n_head")
    hidden = config.get("hidden_size") or config.get("n_embd")
    head_dim = config.get("head_dim")
    if not head_dim and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        head_dim = hidden // heads
    return {"num_heads": heads, "num_kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim": head_dim}


def _check_attention(ir: IR, where) -> None:
    config = ir.info["config"]
    expected = _config_heads(config)
    layers = config.get("num_hidden_layers") or config.get("n_layer")
    skipped = set(ir.info.get("skipped_layers", []))
    seen = set()
    for n in ir.graph.find_nodes(op="call_function", target=OPS["attention"]):
        args = op_arguments("attention", n.args, n.kwargs)
        for key, value in expected.items():
            if value is not None and args[key] != value:
                raise ArtifactError(f"{where.ir}: node {n.name}: {key}={args[key]}, but the "
                                    f"config says {value}")
        window = config.get("sliding_window")
        if args["sinks"] is not None:  # StreamingAttention's window: at most the model's
            if window is not None and args["window"] > window:
                raise ArtifactError(f"{where.ir}: node {n.name}: window={args['window']} with "
                                    f"sinks exceeds the config's sliding_window {window}")
            if window is not None and args["full_heads"] is not None:
                raise ArtifactError(f"{where.ir}: node {n.name}: full_heads on a model with a "
                                    f"sliding window ({window}): those heads would see past it")
        elif args["window"] is not None and args["window"] != window:
            raise ArtifactError(f"{where.ir}: node {n.name}: window={args['window']}, but the "
                                f"config's sliding_window is {window!r}")
        layer = args["layer"]
        if layer in seen or layer in skipped or (isinstance(layers, int) and layer >= layers):
            raise ArtifactError(f"{where.ir}: node {n.name}: layer {layer} is repeated, skipped "
                                f"or beyond the config's {layers} layers")
        seen.add(layer)
    for n in ir.graph.find_nodes(op="call_function", target=OPS["rope"]):
        head_dim = op_arguments("rope", n.args, n.kwargs)["head_dim"]
        if expected["head_dim"] is not None and head_dim != expected["head_dim"]:
            raise ArtifactError(f"{where.ir}: node {n.name}: head_dim={head_dim}, but the config "
                                f"says {expected['head_dim']}")


_EPS = {"rms_norm": ("rms_norm_eps",), "add_rms_norm": ("rms_norm_eps",),
        "all_reduce_add_rms_norm": ("rms_norm_eps",),
        "layer_norm": ("layer_norm_epsilon", "layer_norm_eps")}


def _check_norms(ir: IR, where) -> None:
    config = ir.info["config"]
    for name, keys in _EPS.items():
        want = next((config[k] for k in keys if config.get(k) is not None), None)
        for n in ir.graph.find_nodes(op="call_function", target=OPS[name]):
            eps = op_arguments(name, n.args, n.kwargs)["eps"]
            if want is not None and eps != want:
                raise ArtifactError(f"{where.ir}: node {n.name}: eps={eps}, but the config's "
                                    f"{keys[0]} is {want}")
