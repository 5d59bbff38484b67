"""What loading a checkpoint of either format (``checkpoints``, ``gguf``) shares:
transformers kept quiet, and its load report turned into errors."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from rewriter.errors import CheckpointError


@contextlib.contextmanager
def quiet():
    """transformers' log (its load report, config remarks), warnings and progress bars
    (the GGUF reader's own, which no setting of transformers turns off) silenced: the
    checks here turn what matters into errors, and the CLI's stderr is one line."""
    import functools
    import transformers.modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging as hf_logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    reader_bar = gguf_reader.tqdm
    gguf_reader.tqdm = functools.partial(reader_bar, disable=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        gguf_reader.tqdm = reader_bar


def check_loading_info(d: Path, info: dict, config: str = "config.json") -> None:
    """Missing, unexpected and mis-shaped weights are errors (tied weights that
    ``transformers`` ties itself are not reported missing)."""
    problems = []
    if info["missing_keys"]:
        problems.append(f"missing from the checkpoint: {_keys(info['missing_keys'])}")
    if info["unexpected_keys"]:
        problems.append(f"in the checkpoint but not in the model: "
                        f"{_keys(info['unexpected_keys'])}")
    mismatched = sorted(info["mismatched_keys"])
    if mismatched:
        key, stored, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        problems.append(f"shaped unlike {config}: {key} is {list(stored)} in the checkpoint, "
                        f"{list(wanted)} by the config{more}")
    if info.get("error_msgs"):
        problems.append(first_line(info["error_msgs"][0]))
    if problems:
        raise CheckpointError(f"{d}: weights do not match {config}; "
                              + "; ".join(problems))


def _keys(keys, shown: int = 3) -> str:
    keys = sorted(keys)
    more = f" (and {len(keys) - shown} more)" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def first_line(e) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
