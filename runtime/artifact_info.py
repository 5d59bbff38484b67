"""The shape of an IR's ``info`` as an artifact stores it: every key and the type of every
value, checked before anything reads them (``ValueError`` names the key).

``info`` holds what the frontend learnt (``family``, ``causal_lm``, ``config``,
``inputs``, ``lift_report``, ``layers``; for causal LMs the modules it left unlifted,
``unlifted_attention`` and ``unlifted_embeddings``) and what passes recorded (``fusions``,
``skipped_layers``; ``measured_on``: the backend, device and machine whose timings chose
the strategy), plus the pass list the artifact was saved with (``passes``). A key
this rewriter does not know is refused: a renamed key would otherwise be dropped in silence.
"""
from __future__ import annotations

import math

from rewriter.decoding import check_record
from rewriter.ops.attributes import MAX_WORLD
from rewriter.values import MAX_INT, depth, shown

REQUIRED = ("family", "causal_lm", "config", "inputs", "lift_report", "layers", "passes")
OPTIONAL = ("fusions", "skipped_layers", "unlifted_attention", "unlifted_embeddings", "int4",
            "decoding", "medusa", "measured_on", "tensor_parallel")
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
          "float32", "float64")
MAX_CONFIG_DEPTH = 32  # Hugging Face configs nest 3 or 4 deep (text_config, rope_parameters)
MAX_INPUT_ELEMENTS = 1 << 24  # an input spec's example tensor is really allocated


def check_info(info) -> None:
    if not isinstance(info, dict):
        raise ValueError(f"must be an object, got {type(info).__name__}")
    missing = [k for k in REQUIRED if k not in info]
    unknown = sorted(set(info) - set(REQUIRED) - set(OPTIONAL))
    if missing or unknown:
        raise ValueError(f"missing keys {missing}, unknown keys {unknown}")
    for key, check in _CHECKS.items():
        if key in info:
            why = check(info[key])
            if why:
                raise ValueError(f"{key} must be {why}, got {shown(info[key], 120)}")
    if info["causal_lm"]:
        check_lm_config(info["config"])


def check_lm_config(config: dict) -> None:
    """The config keys the runtime reads: the vocabulary, the context, eos and pad ids."""
    if not _is_int(config.get("vocab_size"), 1):
        raise ValueError(f"config vocab_size must be an integer >= 1, got "
                         f"{shown(config.get('vocab_size'), 120)}")
    for key in ("max_position_embeddings", "n_positions"):
        if config.get(key) is not None and not _is_int(config[key], 1):
            raise ValueError(f"config {key} must be null or an integer >= 1, got "
                             f"{shown(config[key], 120)}")
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(_is_int(i, 0) for i in ids):
        raise ValueError(f"config eos_token_id must be null, a token id or a list of token ids, "
                         f"got {shown(eos, 120)}")
    pad = config.get("pad_token_id")
    if pad is not None and not _is_int(pad, 0):
        raise ValueError(f"config pad_token_id must be null or a token id, got {shown(pad, 120)}")


def _is_int(v, low: int) -> bool:
    return type(v) is int and low <= v <= MAX_INT


def _list_of(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _input_spec(s) -> bool:
    if not isinstance(s, dict) or set(s) != {"shape", "dtype", "dynamic"}:
        return False
    shape, dynamic = s["shape"], s["dynamic"]
    return (_list_of(lambda n: _is_int(n, 1))(shape) and len(shape) <= 8
            and math.prod(shape) <= MAX_INPUT_ELEMENTS and s["dtype"] in DTYPES
            and _list_of(lambda d: _is_int(d, 0) and d < len(shape))(dynamic)
            and len(set(dynamic)) == len(dynamic))


def _span(s) -> bool:
    return (isinstance(s, dict) and set(s) == {"index", "input", "output"}
            and _is_int(s["index"], 0) and isinstance(s["input"], str)
            and isinstance(s["output"], str))


def _pass_spec(p) -> bool:
    return (isinstance(p, dict) and set(p) == {"name", "params"} and isinstance(p["name"], str)
            and isinstance(p["params"], dict) and _shallow(p["params"]))


def _config(c) -> bool:
    return isinstance(c, dict) and _shallow(c)


def _shallow(value) -> bool:
    return depth(value, MAX_CONFIG_DEPTH) <= MAX_CONFIG_DEPTH


def measured_on_ok(v) -> bool:
    """``v`` is a ``measured_on`` record: ``{backend, device, machine, passes}``."""
    return (isinstance(v, dict) and set(v) == {"backend", "device", "machine", "passes"}
            and all(isinstance(v[k], str) for k in ("backend", "device", "machine"))
            and _list_of(lambda s: isinstance(s, str))(v["passes"]) and bool(v["passes"]))


def _why(check, what: str):
    return lambda v: None if check(v) else what


def _int4_record(v) -> bool:
    keys = ("linears", "group_size", "max_abs_error", "max_abs_weight")
    # exact_linears: recorded since K-quant GGUF files; older artifacts lack it
    return (isinstance(v, dict) and set(v) - {"exact_linears"} == set(keys)
            and _is_int(v["linears"], 1) and _is_int(v.get("exact_linears", 0), 0)
            and v.get("exact_linears", 0) <= v["linears"]
            and _is_int(v["group_size"], 2) and all(
                isinstance(v[k], (int, float)) and not isinstance(v[k], bool)
                and math.isfinite(v[k]) and v[k] >= 0 for k in keys[2:]))


_CHECKS = {
    "family": _why(lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "causal_lm": _why(lambda v: isinstance(v, bool), "true or false"),
    "config": _why(_config, f"an object nested at most {MAX_CONFIG_DEPTH} deep"),
    "inputs": _why(_list_of(_input_spec), "a list of {shape, dtype, dynamic} input specs"),
    "lift_report": _why(_list_of(lambda s: isinstance(s, str)), "a list of strings"),
    "layers": _why(_list_of(_span), "a list of {index, input, output} layer spans"),
    "fusions": _why(lambda v: isinstance(v, dict) and all(_is_int(n, 0) for n in v.values()),
                    "an object of pass name -> count"),
    "skipped_layers": _why(lambda v: _list_of(lambda i: _is_int(i, 0))(v) and v == sorted(set(v)),
                           "a sorted list of distinct layer indices"),
    "passes": _why(_list_of(_pass_spec), "a list of {name, params} pass specs"),
    "unlifted_attention": _why(_list_of(lambda s: isinstance(s, str)), "a list of module paths"),
    "unlifted_embeddings": _why(_list_of(lambda s: isinstance(s, str)), "a list of module paths"),
    "decoding": lambda v: check_record(v),
    "medusa": _why(lambda v: isinstance(v, dict) and _config(v), "an object (how the heads were made)"),
    "measured_on": _why(measured_on_ok, "an object {backend, device, machine, passes} of strings "
                        "(passes: a list)"),
    "tensor_parallel": _why(lambda v: isinstance(v, dict) and set(v) == {"world_size"}
                            and _is_int(v["world_size"], 2) and v["world_size"] <= MAX_WORLD,
                            f"an object {{world_size}}, an integer in [2, {MAX_WORLD}]"),
    "int4": _why(_int4_record, "an object {linears, exact_linears, group_size, max_abs_error, "
                                   "max_abs_weight}"),
}




def measured_elsewhere(info: dict, backend: str, device) -> str | None:
    """Why the timings in ``info["measured_on"]`` may not hold for an engine on ``backend``
    and ``device`` (another backend, kind of device or machine), or None when they were
    taken where it runs (or nothing was timed)."""
    import torch
    from rewriter.measure.machine import device_name, timed_backend
    where = info.get("measured_on")
    if not where:
        return None
    device = torch.device(device)
    here, timed = device_name(device), timed_backend(backend, device)
    there = where["device"].split(":")[0]  # a string as stored: not parsed by torch
    if (where["backend"], there, where["machine"]) == (timed, device.type, here):
        return None
    return (f"{', '.join(where['passes'])} chose its decoding by timings of the "
            f"{where['backend']} backend on {where['machine']} ({where['device']}); this engine "
            f"runs {backend} on {here} ({device}), where another choice may be faster: "
            f"optimize the model here to measure again")
