"""The files of an artifact, made in memory from an ``Engine`` before anything is written
(an error here changes no file): the IR as data, the weights (each stored once), the
tokenizer and its chat template, the generated kernels, and the manifest last.
"""
from __future__ import annotations

import json
from typing import Optional

import torch

from rewriter.errors import ArtifactError
from rewriter.runtime.artifact_dir import (
    IR_FILE, KERNEL_NAME, KERNELS_DIR, MANIFEST, TEXT_FILE, TOKENIZER_FILE, WEIGHTS_FILE)
from rewriter.runtime.artifact_files import non_finite, sha256_bytes
from rewriter.runtime.artifact_manifest import manifest_of


def serialize(engine) -> dict[str, bytes]:
    """File name (``kernels/x.py`` for a kernel) -> content; ``manifest.json`` last."""
    from safetensors.torch import save as safetensors_bytes
    from rewriter.ir.serialize import graph_to_data
    stored, names = _unique_weights(engine.ir.weights())
    ir_data = {"graph": graph_to_data(engine.ir.gm), "weights": names,
               "info": {**engine.ir.info, "passes": engine.pass_specs}}
    problem = non_finite(stored)  # load refuses it: an artifact that cannot load is not written
    if problem:
        raise ArtifactError(f"cannot save the model: its {problem}")
    files = {IR_FILE: json_bytes(ir_data), WEIGHTS_FILE: safetensors_bytes(stored)}
    tokenizer = _tokenizer_json(engine.tokenizer)
    if tokenizer is not None:
        files[TOKENIZER_FILE] = tokenizer.encode()
        files[TEXT_FILE] = json_bytes(engine.text.to_json())
    for name, source in sorted(engine.kernel_sources().items()):
        if "/" not in name:  # templates/ are the package's own modules, not generated code
            if not KERNEL_NAME.fullmatch(name):  # what load accepts: a module name
                raise ArtifactError(f"cannot store a kernel named {name!r}")
            files[f"{KERNELS_DIR}/{name}"] = source.encode()
    entries = {name: {"bytes": len(data), "sha256": sha256_bytes(data)}
               for name, data in sorted(files.items())}
    files[MANIFEST] = json_bytes(manifest_of(engine, entries, tokenizer is not None))
    return files


def _unique_weights(weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(stored name -> tensor, every weight name -> stored name).

    safetensors refuses tensors that share memory, and tied weights (an LM head that is
    the embedding) do: identical views are stored once; other overlapping views are copied.
    """
    stored, names, seen, storages = {}, {}, {}, set()
    for name, t in weights.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        if key in seen:
            names[name] = seen[key]
            continue
        storage = t.untyped_storage().data_ptr()
        t = t.detach()
        t = t.clone() if storage in storages else t.contiguous()
        storages.add(storage)
        stored[name], names[name], seen[key] = t, name, name
    return stored, names


def _tokenizer_json(tokenizer) -> Optional[str]:
    """The ``tokenizers`` JSON of a ``tokenizers.Tokenizer`` or a fast HF tokenizer."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str"):
        raise ArtifactError(f"cannot store a tokenizer of type {type(tokenizer).__name__}; "
                            f"pass a tokenizers.Tokenizer or a fast Hugging Face tokenizer")
    return backend.to_str()


def json_bytes(data) -> bytes:
    return json.dumps(data, indent=1, default=_json_default).encode()


def _json_default(x):
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    raise TypeError(f"cannot store {type(x).__name__} {x!r} in JSON")
