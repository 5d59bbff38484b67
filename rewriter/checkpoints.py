"""Models from disk: Hugging Face checkpoint directories and the shipped default model.

No network: ``transformers`` is called with ``local_files_only=True`` and never with
``trust_remote_code``; a directory without ``config.json`` is refused by name.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, Union

DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "default_model"

PathLike = Union[str, os.PathLike]


def checkpoint_dir(path: PathLike) -> Path:
    """``path`` as a checkpoint directory (``"default"`` is the shipped model)."""
    d = DEFAULT_MODEL_DIR if str(path) == "default" else Path(path)
    if not d.exists():
        raise FileNotFoundError(f"{d}: no such checkpoint directory")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: not a Hugging Face checkpoint (no config.json)")
    return d


def load_hf_model(path: PathLike, dtype=None):
    """The ``transformers`` causal LM stored in ``path``, in eval mode."""
    from transformers import AutoModelForCausalLM
    d = checkpoint_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{d}: cannot load the checkpoint ({str(e).splitlines()[0]})") from e
    return model.eval()


def load_tokenizer(path: PathLike):
    """The checkpoint's fast tokenizer as a ``tokenizers.Tokenizer``, or None."""
    from tokenizers import Tokenizer
    f = checkpoint_dir(path) / "tokenizer.json"
    return Tokenizer.from_file(str(f)) if f.is_file() else None


def from_pretrained(path: PathLike, passes: Sequence = (), **optimize_kwargs):
    """``optimize`` the checkpoint in ``path`` (a directory, or ``"default"``) with
    ``passes``; the result carries the checkpoint's tokenizer, if it has one."""
    from .optimized import optimize
    opt = optimize(load_hf_model(path), passes, **optimize_kwargs)
    opt.tokenizer = load_tokenizer(path)
    return opt


def default_model():
    """(model, tokenizer) of the project's small trained Llama, from the package itself."""
    from transformers import PreTrainedTokenizerFast
    model = load_hf_model(DEFAULT_MODEL_DIR)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"),
                                        bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    return model, tokenizer


def llama_1b(num_hidden_layers: int = 22, device="cpu", dtype=None, seed: int = 0):
    """A TinyLlama-shaped Llama (1.1B parameters at 22 layers) with seeded random weights:
    the GPU benchmarks' model, since nothing can be downloaded. Fewer layers keep every
    per-layer shape (the kernels' specializations) and cut the memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=32,
                         num_key_value_heads=4, max_position_embeddings=2048)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
