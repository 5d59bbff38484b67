"""Models from disk: Hugging Face checkpoint directories and the shipped default model.

No network: ``transformers`` is called with ``local_files_only=True`` and never with
``trust_remote_code``; a directory without ``config.json`` is refused by name. Only
safetensors weights are read, and they must match the config exactly: every bad file is a
``CheckpointError`` naming it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from rewriter.errors import CheckpointError
from rewriter.models.loading import check_loading_info, first_line, quiet
from rewriter.values import parse_json

DEFAULT_MODEL_DIR = Path(__file__).parent.parent / "assets" / "default_model"

PathLike = Union[str, os.PathLike]


def checkpoint_dir(path: PathLike) -> Path:
    """``path`` as a checkpoint directory (``"default"`` is the shipped model)."""
    d = DEFAULT_MODEL_DIR if str(path) == "default" else Path(path)
    if not d.exists():
        raise FileNotFoundError(f"{d}: no such checkpoint directory")
    if not d.is_dir():
        raise NotADirectoryError(f"{d}: not a directory (a checkpoint is a directory with "
                                 f"config.json and safetensors weights)")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: not a Hugging Face checkpoint (no config.json)")
    return d


def load_hf_model(path: PathLike, dtype=None):
    """The ``transformers`` causal LM stored in ``path``, in eval mode.

    Every weight the config calls for must be in the checkpoint with its shape, and every
    tensor in the checkpoint must be one the model has: ``transformers`` would fill a
    missing or mis-shaped weight with random values and carry on. Only safetensors are
    read (a pickled ``pytorch_model.bin`` runs code when loaded)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    d = checkpoint_dir(path)
    with quiet():  # what transformers would log or warn about, the errors below say
        _check_config(d)
        _check_safetensors(d)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                d, local_files_only=True, dtype=dtype, use_safetensors=True,
                output_loading_info=True, ignore_mismatched_sizes=True)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
            # TypeError, RuntimeError: the model is built from config.json's values as given
            # (a negative vocab_size fails inside torch)
            raise CheckpointError(f"{d}: cannot load the checkpoint ({first_line(e)})") from e
    check_loading_info(d, info)
    return model.eval()


def load_tokenizer(path: PathLike):
    """The checkpoint's fast tokenizer as a ``tokenizers.Tokenizer``, or None."""
    from tokenizers import Tokenizer
    f = checkpoint_dir(path) / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises bare Exception for every malformed file
        raise CheckpointError(f"{f}: not a valid tokenizer file ({first_line(e)})") from e


PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
ACTIVATION_FIELDS = ("hidden_act", "activation_function")  # Llama-likes, NeoX, Phi; GPT-2, OPT


def _json_object(f: Path) -> dict:
    """The JSON object in ``f``, or a ``CheckpointError`` naming it."""
    try:
        data = parse_json(f.read_bytes())
    except ValueError as e:  # not UTF-8 JSON, or nested past any config
        raise CheckpointError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{f}: must hold a JSON object, got {type(data).__name__}")
    return data


def _check_config(d: Path) -> None:
    """``config.json`` as a ``transformers`` config: JSON, an object, a model type
    ``transformers`` knows, and values its config class accepts."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING, AutoConfig
    f = d / "config.json"
    raw = _json_object(f)
    kind = raw.get("model_type")
    if not isinstance(kind, str) or kind not in CONFIG_MAPPING:
        raise CheckpointError(f"{f}: model_type {kind!r} is not a model type transformers knows")
    try:
        AutoConfig.from_pretrained(d, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StrictDataclassError) as e:
        # AttributeError: a "dtype" that names no torch dtype is looked up with getattr
        raise CheckpointError(f"{f}: not a valid {kind} config ({' '.join(str(e).split())})") from e
    _check_activation(f, raw)


def _check_activation(f: Path, raw: dict) -> None:
    """The MLP's activation is one ``transformers`` builds: it would fail building the
    model with a ``KeyError`` that names only the value."""
    from transformers.activations import ACT2FN
    for key in ACTIVATION_FIELDS:
        value = raw.get(key)
        if key in raw and not (isinstance(value, str) and value in ACT2FN):
            raise CheckpointError(f"{f}: {key} {value!r} is not an activation transformers "
                                  f"builds; supported: {', '.join(sorted(ACT2FN))}")


def _check_safetensors(d: Path) -> None:
    """Refuse a directory whose weights are only pickled; open every safetensors file's
    header (it covers the whole file: a truncated file fails here, by name)."""
    from safetensors import SafetensorError, safe_open
    files = sorted(d.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for pattern in PICKLED for p in d.glob(pattern))
        if pickled:
            raise CheckpointError(f"{d / pickled[0]}: pickled weights are refused (loading "
                                  f"them runs code); convert the checkpoint to safetensors")
        raise CheckpointError(f"{d}: no weights (no *.safetensors file)")
    for f in files:
        try:
            with safe_open(str(f), "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: not a valid safetensors file ({first_line(e)})") from e


def load_text_config(path: PathLike):
    """The chat template and special tokens of a Hugging Face checkpoint directory
    (``tokenizer_config.json``, ``chat_template.jinja``), as a ``TextConfig``."""
    from rewriter.runtime.chat import SPECIAL, TextConfig
    d = checkpoint_dir(path)
    f = d / "tokenizer_config.json"
    config = _json_object(f) if f.is_file() else {}
    template = config.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{f}: chat_template must be a string")
    special = {}
    for name in SPECIAL:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    return TextConfig(template, special)


def default_model():
    """(model, tokenizer) of the project's small trained Llama, from the package itself."""
    from transformers import PreTrainedTokenizerFast
    model = load_hf_model(DEFAULT_MODEL_DIR)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"),
                                        bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    return model, tokenizer


def cast(model, dtype=None, device=None):
    """``model`` moved to ``device`` and ``dtype``, its rotary frequencies (``inv_freq``
    buffers) kept in float32, as a model loaded in ``dtype`` has them: a plain
    ``model.to(torch.bfloat16)`` rounds them too, and at 8k positions the angles are then
    off by radians. ``None`` keeps the model's dtype or device."""
    import torch
    freqs = {n: b for n, b in model.named_buffers(remove_duplicate=False)
             if n.rpartition(".")[2].endswith("inv_freq")}  # and original_inv_freq
    model = model.to(device=device, dtype=dtype)
    for name, buffer in freqs.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buffer.to(device=device, dtype=torch.float32))
    return model


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
    return cast(LlamaForCausalLM(config), dtype, device).eval()


def load_model(path: PathLike, dtype=None):
    """(Hugging Face model, tokenizer) of a checkpoint directory, a GGUF file, ``"default"``
    or ``"smollm2"``: the unoptimized model, for tools that need it (training heads)."""
    from rewriter.models import gguf
    dtype = gguf.check_dtype(dtype)
    if str(path) == "default":
        model, tokenizer = default_model()
        return cast(model, dtype), tokenizer
    if gguf.is_gguf(path):
        return gguf.load_gguf(path, dtype)
    return load_hf_model(path, dtype), load_tokenizer(path)
