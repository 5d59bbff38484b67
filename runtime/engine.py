"""``Engine``: a lowered IR with a KV cache, that generates.

    engine.generate(input_ids, max_new_tokens=64)                          # greedy
    engine.generate(input_ids, max_new_tokens=64, do_sample=True, temperature=0.8,
                    top_k=50, top_p=0.95, seed=0)
    for token in engine.stream(input_ids, max_new_tokens=64): ...          # token: [B]
    engine.chat("What is the capital of France?", max_new_tokens=64)        # -> answer text
    engine.save("artifacts/model")

``rewriter.optimize`` returns one (an ``OptimizedModel``), and ``rewriter.load`` gives one
back from an artifact (``runtime.engine_load``). What callers pass is checked by
``runtime.settings`` (the generation parameters) and ``runtime.inputs`` (ids, positions).
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from rewriter.ir.core import IR
from rewriter.ir.shard import shard

from . import artifact
from .chat import Messages, TextConfig, answer_text, chat_prompt, split_tokenizer
from rewriter.errors import UncacheableError
from rewriter.values import check_flag, context_length, path_argument

from .decoding import Generation, strategy_for
from .decoding.plain import plain_tokens
from .generate import Batch, prepare, score_loop
from .inputs import check_length, check_positions, check_prefix, check_token_ids, token_count
from .kv_cache import KVCache, cache_table, read_bytes, unbounded_length
from .lower import program_code
from .collectives import check_same_program, distributed, program_digest, this_rank, world
from .programs import build_programs, kernel_files, lowering_key
from .replay import Replays
from .settings import PREFILL_CHUNK, GenerationSettings, token_ids
from .speed_guard import PLAIN, ROUNDS, SpeedGuard

Prompts = Union[Tensor, Sequence[Sequence[int]]]
BACKENDS = ("torch", "triton")


class Engine:
    """Runs a causal-LM IR with a static KV cache; ``ir`` stays inspectable."""

    def __init__(self, ir: IR, tokenizer=None, passes: Optional[list[dict]] = None,
                 backend: str = "torch", text: Optional[TextConfig] = None):
        self.ir = ir
        self.tokenizer = tokenizer  # any supported form; kept as a ``tokenizers.Tokenizer``
        if text is not None:  # an artifact's stored chat template and special tokens
            self.text = text
        self.pass_specs = passes or []
        self.backend = backend
        self._programs = None
        self._programs_key = None
        self._cache: Optional[KVCache] = None
        # Cost counters over every generate/stream call: forward_passes, layer_evals, tokens
        # (see ``decode_loop``); reset with ``stats.clear()``.
        self.stats: Counter = Counter()
        # The draft-head tree each (batch size, decoding strategy) verifies, learnt from the
        # text decoded so far (``runtime.decoding.tree.adapt``); clear it to start from the pass's.
        self.trees: dict = {}
        # Whether a speculative strategy's generations fall back to plain decode steps at a
        # batch size where those run faster on this machine, timed (``runtime.speed_guard``);
        # the timings, by (batch size, strategy), in ``guards``.
        self._fallback = True
        self.guards: dict = {}
        # Stored kernel sources (kernel name -> source) to run as they are; set by
        # ``rewriter.load(..., trust_code=True)`` only.
        self.trusted_kernels: dict[str, str] = {}
        # Run decode steps, and every step of a speculative or tree round, on fixed buffers
        # with device-side write positions (``runtime.replay``): always on CUDA, where each
        # is also captured in a CUDA graph; settable to test it on a CPU.
        self.static_decode: Optional[bool] = None
        # Those fixed-shape calls (and their CUDA graphs), kept across generations while the
        # cache and the programs they hold stay the same (a weight written or replaced
        # since lowering makes new programs and drops them: ``_lowered``).
        self.replays = Replays()
        # This rank's shard of a split model, with the lowering key of the IR it was cut
        # from (``_program_ir``).
        self._shard = None

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` (or None); ``text`` holds the chat template and the
        special tokens that a fast Hugging Face tokenizer set here brought along."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self._tokenizer, self.text = split_tokenizer(tokenizer)

    @property
    def fallback(self) -> bool:
        """Whether a speculative strategy's generations may run plain decode steps where
        those were timed faster at their batch size (``runtime.speed_guard``)."""
        return self._fallback

    @fallback.setter
    def fallback(self, value: bool) -> None:
        self._fallback = check_flag("fallback", value)

    @property
    def config(self) -> dict:
        return self.ir.info.get("config", {})

    @property
    def max_len(self) -> int:
        """Tokens one sequence may hold (prompt + generated): the model's context length."""
        return context_length(self.config)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(token_ids("eos_token_id (from the model config)",
                              self.config.get("eos_token_id")))

    def kv_bytes_per_token(self, tokens: Optional[int] = None) -> int:
        """KV-cache bytes per token of one sequence of ``tokens`` tokens (default: the
        context length), all caches, K and V: what is allocated, so a sink + window ring
        counts its slots, not the sequence's length, and so does a sliding-window layer
        (its ring of ``window`` slots under plain decoding, ``runtime.window_ring``). A model that ``TensorParallel``
        splits reports the whole model's, every rank's share together (comparable with
        the model unsplit, and known in one process); each rank holds its own KV heads'
        share (``cache_table(shard(ir, rank).gm)``, ``rewriter.ir.shard``). So does
        ``kv_read_bytes``."""
        tokens = token_count("kv_bytes_per_token", self.max_len if tokens is None else tokens)
        dtype = self._dtype()
        return sum(s.bytes_for(tokens, dtype) for s in cache_table(self.ir.gm).values()) // tokens

    def kv_read_bytes(self, tokens: Optional[int] = None) -> int:
        """KV-cache bytes one decode step of one sequence reads with ``tokens`` tokens
        cached (default: the context length): the sparse passes' savings in bandwidth,
        where ``kv_bytes_per_token`` is their savings in memory (``kv_cache.read_bytes``)."""
        tokens = token_count("kv_read_bytes", self.max_len if tokens is None else tokens)
        return read_bytes(self.ir.gm, self._dtype(), tokens)

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids: Prompts, max_new_tokens: int = 20,
                 attention_mask: Optional[Tensor] = None, do_sample: bool = False,
                 temperature: float = 1.0, top_k: Optional[int] = 50, top_p: float = 1.0,
                 seed: Optional[int] = None, eos_token_id=None, pad_token_id: Optional[int] = None,
                 progress: bool = False, prefill_chunk: int = PREFILL_CHUNK) -> Tensor:
        """Prompt + new tokens, ``[B, S + n]``, like ``transformers`` ``generate``.

        ``input_ids`` is a ``[B, S]`` tensor (with ``attention_mask`` marking padding, left
        or right) or a list of token-id lists of any lengths. Rows that end (an
        ``eos_token_id``) are filled with ``pad_token_id``; generation stops when all have.
        The prompt runs in steps of at most ``prefill_chunk`` tokens (a long prompt's
        attention masks then stay small). Every argument is checked
        (``GenerationSettings``) before anything runs.
        """
        settings = GenerationSettings(max_new_tokens, do_sample, temperature, top_k, top_p,
                                      seed, eos_token_id, pad_token_id, prefill_chunk)
        check_flag("progress", progress)
        batch, steps = self._start(input_ids, attention_mask, settings)
        if progress:
            from tqdm import tqdm
            steps = tqdm(steps, total=max_new_tokens, desc="generate", unit="tok", leave=False)
        new = [t[:, None] for t in steps]  # n x [B, 1]
        return torch.cat([batch.source, *new], dim=1)

    def stream(self, input_ids: Prompts, max_new_tokens: int = 20,
               attention_mask: Optional[Tensor] = None, do_sample: bool = False,
               temperature: float = 1.0, top_k: Optional[int] = 50, top_p: float = 1.0,
               seed: Optional[int] = None, eos_token_id=None,
               pad_token_id: Optional[int] = None,
               prefill_chunk: int = PREFILL_CHUNK) -> Iterator[Tensor]:
        """Yield each step's new tokens, ``[B]``, as they are made (arguments: ``generate``).
        The arguments are checked here, when ``stream`` is called, not at the first token."""
        settings = GenerationSettings(max_new_tokens, do_sample, temperature, top_k, top_p,
                                      seed, eos_token_id, pad_token_id, prefill_chunk)
        return self._start(input_ids, attention_mask, settings)[1]

    def chat(self, messages: Messages, max_new_tokens: int = 256, **generation) -> str:
        """The model's answer, as text, to ``messages`` (a string is one user message; or a
        list of ``{"role", "content"}`` dicts) laid out by its chat template. Generation
        stops at the model's end-of-sequence token; ``generation`` takes ``generate``'s
        sampling arguments."""
        ids = chat_prompt(self.tokenizer, self.text, messages)
        out = self.generate([ids], max_new_tokens=max_new_tokens, **generation)[0, len(ids):]
        eos = (GenerationSettings(eos_token_id=generation.get("eos_token_id"))
               .for_model(self.config).eos_token_id)
        return answer_text(self.tokenizer, out.tolist(), eos)

    def score(self, input_ids: Tensor, prefix: int) -> Tensor:
        """Log-probabilities ``[B, S - prefix]`` of the tokens after the first ``prefix`` of
        each row of ``input_ids`` ``[B, S]`` (no padding), each given all tokens before it,
        through the KV-cache runtime (prefill, then one decode step per token): perplexity
        as the runtime, caches and their policies included, computes it."""
        check_token_ids(input_ids, self.config.get("vocab_size"))
        b, s = input_ids.shape
        prefix = check_prefix(prefix, s)
        self._check(input_ids, 0)
        programs = self._lowered()
        cache = self._cache_for(b, s)
        ids = input_ids.to(device=self._device(), dtype=torch.int64)
        tokens = s - prefix
        self.stats.update(forward_passes=tokens, layer_evals=tokens * len(cache.table))
        return score_loop(programs["prefill"], programs["decode"], cache, ids, prefix)

    def _start(self, input_ids, attention_mask,
               settings: GenerationSettings) -> tuple[Batch, Iterator[Tensor]]:
        """Check everything, then return the batch and the (lazy) token iterator."""
        settings = settings.for_model(self.config)
        device = self._device()
        batch = prepare(input_ids, attention_mask, settings.pad_token_id, device)
        need = self._check(batch.ids, settings.max_new_tokens)
        programs = self._lowered()  # before the cache: an IR it refuses gets none
        strategy = strategy_for(self._program_ir())  # (runtime.decoding)
        cache = self._cache_for(batch.ids.shape[0], need + strategy.cache_slack(),
                                strategy.cache_slack())
        cuda = device.type == "cuda"
        # a merged cache (MiniCache) decodes from host starts: not replayed by default
        static = self.static_decode if self.static_decode is not None else cuda and not cache.merged
        g = Generation(programs, cache, batch, settings, settings.generator(device), self.stats,
                       static=static, cuda_graph=static and cuda, replays=self.replays)
        try:
            return batch, self._tokens(g, strategy, batch, settings, device)
        except BaseException:  # a refusal before the first token: the cache is free again
            g.release()
            raise

    def _tokens(self, g: Generation, strategy, batch: Batch, settings: GenerationSettings,
                device) -> Iterator[Tensor]:
        """The strategy's tokens, or plain decoding's where the speed guard chooses it."""
        if not strategy.speculative:
            return g.leased(strategy.tokens(g, self.trees))
        guard = self.guards.setdefault((batch.ids.shape[0], strategy.record), SpeedGuard())
        # ranks timing their own steps could choose apart and wait on each other: a split
        # model keeps the strategy's rounds (``runtime.collectives``)
        timed = self.fallback and world(self.ir) is None
        arm = guard.choose(settings.max_new_tokens) if timed else ROUNDS
        steps = strategy.tokens(g, self.trees) if arm == ROUNDS else None
        if steps is None:  # the guard's choice, or the strategy's own (no rounds pay here)
            arm = PLAIN
            self.stats.update(plain_generations=1)
            steps = plain_tokens(g)
        return guard.timed(g.leased(steps), arm, device)

    def __call__(self, input_ids: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """Logits ``[B, S, vocab]`` of the whole IR, no cache (the reference semantics)."""
        if not self.ir.is_causal_lm:
            return self.ir.gm(input_ids) if positions is None else self.ir.gm(input_ids, positions)
        check_token_ids(input_ids, self.config.get("vocab_size"))
        if positions is None:
            b, s = input_ids.shape
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
        else:
            check_positions(input_ids, positions, self.max_len, self.ir.gm)
        with torch.no_grad():
            out = self.ir.gm(input_ids, positions)
        return out[0] if isinstance(out, tuple) else out  # (logits, draft): draft heads

    def kernel_sources(self, templates: bool = False) -> dict[str, str]:
        """File name -> Triton source of every generated kernel (and, with ``templates``,
        of the template modules) the Triton backend runs for this IR."""
        return kernel_files(self._lowered(), templates) if self.backend == "triton" else {}

    # ------------------------------------------------------------------ artifacts
    def save(self, directory: Union[str, os.PathLike], progress: bool = False) -> None:
        """Write an artifact directory that ``rewriter.load`` reads (atomically)."""
        artifact.save(self, path_argument("directory", directory), progress=progress)

    # ------------------------------------------------------------------ internals
    def _check(self, ids: Tensor, max_new_tokens: int) -> int:
        check_token_ids(ids, self.config.get("vocab_size"))
        return check_length(ids, max_new_tokens, self.max_len, self.ir.gm)

    def _lowered(self) -> dict:
        """The named step programs (``runtime.programs``), lowered again only when the IR
        changed since (``ir.refresh()``, nodes added or removed by hand) or a weight was
        written in place or replaced: the programs read derived copies of weights
        (transposed, packed, 4-bit tables) that would otherwise go stale."""
        key = lowering_key(self.ir)
        if self._programs is None or self._programs_key != key:
            self._programs = None  # a failed lowering leaves none behind
            self.replays.clear()  # they call the old programs
            run = self._program_ir()
            self._programs = build_programs(run, self.backend, self.trusted_kernels,
                                            strategy_for(run))
            self._programs_key = key
        return self._programs

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy``: everything but the lowered programs, their replays and
        the KV cache, which a copy makes afresh on first use (lowered programs may hold
        packed weights, ``runtime.packed_linear``, which cannot be copied)."""
        state = dict(self.__dict__)
        state.update(_programs=None, _programs_key=None, _cache=None, replays=None, _shard=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.replays = Replays()

    def lower(self) -> None:
        """Lower the step programs now, so that their errors surface here (``optimize`` and
        ``load`` call it). An IR the cache cannot run still gives logits when called; its
        ``generate`` raises the reason."""
        if not self.ir.is_causal_lm:
            return
        try:
            if world(self.ir) is not None and not distributed():
                # the ranks run elsewhere: the first and the last rank's programs are built
                # here and dropped (verify checked every rank's split; an uneven split
                # leaves the last rank the fewest heads)
                for rank in sorted({0, world(self.ir) - 1}):
                    piece = shard(self.ir, rank)
                    build_programs(piece, self.backend, self.trusted_kernels, strategy_for(piece))
            else:
                self._lowered()
        except UncacheableError:
            pass

    def programs(self) -> dict[str, str]:
        """Name -> the Python code of each step program the runtime runs (``prefill``,
        ``decode``, and the decoding strategy's own, e.g. ``draft``)."""
        return {name: program_code(program) for name, program in self._lowered().items()}

    def _cache_for(self, batch: int, need: int, slack: int = 0) -> KVCache:
        """A cache of at least ``need`` tokens, reused across calls while it fits;
        ``slack``: the tokens a step may write that a later one rolls back, which its
        sliding-window rings keep room for (``runtime.window_ring``).

        Sized to the request (rounded up to 256), not to the context length: a 128k-token
        model asked for 200 tokens should not allocate 128k tokens of cache."""
        dtype, device = self._dtype(), self._device()
        if self._cache is None or not self._cache.fits(batch, need, dtype, device, slack):
            self._cache = None  # free the old one before allocating
            self.replays.bind(None)  # they hold it too
            length = min(self.max_len, -(-need // 256) * 256)
            run = self._program_ir()  # a rank of a split model caches its own heads
            if need > length and unbounded_length(run.gm):  # past the context: rings only
                length = -(-need // 256) * 256
            self._cache = KVCache(cache_table(run.gm), batch, length, dtype, device, slack)
            self.replays.bind(self._cache)
        return self._cache

    def _program_ir(self) -> IR:
        """The IR the step programs run: this rank's shard of a model ``TensorParallel``
        split (``rewriter.ir.shard``, made again when the whole IR changes, after checking
        every rank holds the same IR), else the IR itself."""
        if world(self.ir) is None:
            return self.ir
        key = lowering_key(self.ir)
        if getattr(self, "_shard", None) is None or self._shard[0] != key:
            rank = this_rank(self.ir)
            check_same_program(program_digest(self.ir, self.backend))
            self._shard = (key, shard(self.ir, rank))
        return self._shard[1]

    def _first_weight(self) -> Tensor:
        """The largest floating-point weight: its dtype and device are the model's (small
        buffers such as RoPE frequencies may stay float32 in a bf16 model)."""
        floats = [t for t in self.ir.weights().values() if t.is_floating_point()]
        return max(floats, key=torch.Tensor.numel) if floats else torch.empty(0)

    def _dtype(self) -> torch.dtype:
        return self._first_weight().dtype

    def _device(self) -> torch.device:
        return self._first_weight().device

    def __repr__(self) -> str:
        return f"Engine({self.ir.summary()}, passes={[p['name'] for p in self.pass_specs]})"
