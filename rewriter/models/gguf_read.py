"""One quick parse of a GGUF file for ``transformers``' GGUF loader.

Loading a model or a tokenizer from GGUF, ``transformers`` builds a ``gguf.GGUFReader`` of
the file several times (for the config, again for the tensors or the tokenizer), and each
build walks every key-value field through ``numpy.memmap`` slices: a file with a large
vocabulary (Gemma 3's 262,144 tokens: three arrays of that length) spends most of its load
time there. Inside ``one_read(path)`` every reader of ``path`` is one shared reader whose
fields are views of a plain array over the same mapping (the same bytes; memmap's
per-slice bookkeeping is what made it slow), and the config parse is done once.
"""
from __future__ import annotations

import contextlib
import copy
import os
import threading
from pathlib import Path

from rewriter.errors import CheckpointError


def fast_reader_class():
    """``gguf.GGUFReader`` with field reads from a plain-array view of its memory map."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the class itself: one_read patches the name

    class QuickReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:  # the first read, just after __init__ mapped the file
                plain = self._plain = self.data.view(np.ndarray)
            dtype = np.dtype(dtype)
            arr = plain[offset:offset + dtype.itemsize * int(count)].view(dtype)
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return QuickReader


# one_read patches process-wide names: one at a time (another thread's load, or a nested
# one, waits), and the originals are taken from where one_read never patches them
_LOCK = threading.RLock()
_ORIGINAL: dict = {}
_OPEN: list = []  # the files of the one_read entries now open, innermost last


@contextlib.contextmanager
def one_read(path: os.PathLike):
    """Within: ``path`` parsed once (``_one_read``). An entry for the file the innermost
    open entry reads shares that entry's parse (a model and its tokenizer, loaded inside
    one ``one_read``, read the file once)."""
    target = Path(path).resolve()
    with _LOCK:
        if _OPEN and _OPEN[-1] == target:
            yield
            return
        _OPEN.append(target)
        try:
            with _one_read(path):
                yield
        finally:
            _OPEN.pop()


def _originals():
    """gguf's reader class and transformers' config parse as their modules define them."""
    if not _ORIGINAL:
        import gguf.gguf_reader
        import transformers.modeling_gguf_pytorch_utils as hf_gguf
        _ORIGINAL.update(reader=gguf.gguf_reader.GGUFReader, load=hf_gguf.load_gguf_checkpoint)
    return _ORIGINAL["reader"], _ORIGINAL["load"]


@contextlib.contextmanager
def _one_read(path: os.PathLike):
    """Within: readers of ``path`` made through ``gguf.GGUFReader`` are one quick reader,
    and ``transformers``' config parse of it (``load_gguf_checkpoint`` without tensors)
    runs once; other files are read as usual."""
    try:
        import gguf
    except ImportError as e:  # a dependency of ours; say so, naming the file
        raise CheckpointError(f"{path}: reading GGUF needs the 'gguf' package ({e})") from e
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    target = Path(path).resolve()
    real_reader, real_load = _originals()
    saved = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint  # a nested entry's wrappers
    quick, shared, configs = fast_reader_class(), {}, {}

    def reader(p, mode="r"):
        if mode != "r" or Path(p).resolve() != target:
            return real_reader(p, mode)
        if "reader" not in shared:
            shared["reader"] = quick(p, mode)
        return shared["reader"]

    def load(p, return_tensors=False, **kwargs):
        if return_tensors or kwargs or Path(p).resolve() != target:
            return real_load(p, return_tensors=return_tensors, **kwargs)
        if "config" not in configs:
            configs["config"] = real_load(p)
        return copy.deepcopy(configs["config"])  # callers pop and edit what they get

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = reader, load
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = saved
