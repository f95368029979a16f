"""The generation engine: continuous batching over per-slot KV caches, sampling and stop
conditions (library; no side effects). Beside it: the CPU decode weights (pack.py, over the
products of cpu.py), the thread policy of a step (threads.py) and incremental detokenization
(detok.py).

    engine = Engine(model)                                  keep it to reuse its decode weights
    engine.generate(prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                    eos_id=None, seed=None) -> [[new ids], ...]
    engine.stream(prompt, ...)                              yields each new id as it is sampled
    generate(model, prompts, ...)                           one-off: a throwaway Engine
    b = engine.batcher(slots=8)                             continuous batching (serve):
    b.add(Sequence(ids, SamplingParams(...), tok=tok, sink=fn)); b.step() -> [Event, ...]
    engine.use_prefix_cache(budget_bytes)                   reuse the KV of prompt starts seen before
    engine.adapters.load(name, entry)                       a LoRA adapter rows can ask for
                                                            (SamplingParams(adapter=name), adapters.py)

Contract: greedy (temperature 0, or below ``GREEDY_BELOW``), temperature, top-k (0 disables),
top-p (1.0 disables); each sequence samples with a private ``torch.Generator`` seeded by its
``seed`` (the global RNG is untouched; None draws a fresh seed; ``generate`` gives row r
``seed + r``); EOS (one id or several) ends a row and is never returned; stop strings end it
and never appear in its text (detok.py ``TextStream``); a sequence with an output grammar
(``SamplingParams.grammar``, constrained.py) samples under its own token mask, the other rows
from their logits as they are. Every call goes through
:class:`Batcher`: a prompt is prefilled alone into its own cache slot, then all running rows
decode together, each at its own position, and rows join and leave at step boundaries; each
row gets what it would get alone (to float rounding, see Batcher). The model is put in eval
mode for a call and back in its previous mode after; each step runs in inference mode with its
own thread count (threads.py ``step_threads``), both restored before the caller's code runs
again, so ``stream`` can yield between steps and torch's global thread count is never left
changed.

Memory: a batcher's KV cache is slots x (layers x 2 x n_kv_heads x capacity x head_dim)
values in the engine's compute dtype (``Engine.dtype``: the weights', or its autocast's), allocated once (``generate``: one slot per prompt, capacity
longest prompt + max_new_tokens; serve: ``serve.max_batch`` slots of the model's context).
Infini-attention models (``model.attention`` "infini", utils/infini.py) keep per slot only the
current segment: its keys, values and sigma(K) (3 x n_kv_heads x segment x head_dim per
layer) and the float32 memory (n_kv_heads x (head_dim + 1) x head_dim per layer), so a slot's
size is fixed by the segment length, whatever the context: prompts are prefilled one segment
at a time, and the positions of a sequence are unbounded (``capacity`` only caps its length).
With fp32 weights on CPU the engine also keeps a transposed, contiguous copy of the weights
(:meth:`Engine.decode_pack`, utils/generation/pack.py: the weights' bytes once more plus the
head's, bounded by ``DECODE_PACK_MAX_BYTES``); it is rebuilt when the weights change (storage
or ``_version``: an optimizer step or ``load_state_dict``) and freed with the engine. Prompt
lookup's verify passes add a oneDNN-packed copy of the block weights at the first one
(speculative.py ``verify_layers``).

Prefix cache (``use_prefix_cache``; utils/generation/prefix_cache.py): the engine owns one
store of KV blocks for its model, shared by all its batchers; a prefill copies the longest
cached whole-block prefix of the prompt into the slot (never the last token: its logits give
the first new token) and computes the rest over it with a causal mask aligned to its
positions; the prompt's blocks are stored after its prefill, a finished sequence's prompt +
output when it leaves its slot. Logits agree with a whole prefill's to float rounding. Not for
Infini-attention models nor for sequences that score their prompt (``prompt_logprobs``).
A sequence run with a LoRA adapter finds and stores only its adapter's blocks.

LoRA adapters (``engine.adapters``, utils/generation/adapters.py): a sequence whose
``SamplingParams.adapter`` names a loaded adapter is prefilled and decoded with that adapter's
delta added to each adapted projection, unmerged, in the same batch as rows of other adapters
and base rows; a step with no adapter row is the base step unchanged (the compiled step and
prompt lookup apply to it only).

Decode steps (``Block.decode`` over the pack) pay a fixed dispatch cost per tensor operation on
CPU, which is most of a small model's token: the step fuses projections, rotates q and k
together, writes the cache with one ``index_copy_`` per tensor, skips the key mask when every
row is at the same position and takes the greedy token with NumPy (utils/generation/cpu.py).
Where the thread rule gives a decode step all threads, the count is chosen by measurement
(threads.py ``DecodeThreads``: on cores shared with other work one thread can be many times
faster). A lone greedy row may take several tokens per step by prompt-lookup speculative
decoding (speculative.py, ``Engine(prompt_lookup=k)`` or the request's
``SamplingParams.prompt_lookup``: the same tokens), and the step's network pass may run as one
``torch.compile`` graph (compiled.py, ``Engine(compile="auto"|"on"|"off")``, compiled by
``compile_now`` when a model loads: the same tokens).
"""
from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator, Optional
from typing import Sequence as Sequence_

import torch

from utils.attention import AttnSpec
from utils.generation import speculative
from utils.generation.adapters import AdapterSet
from utils.generation import threads as thread_policy
from utils.generation.compiled import (STATIC_MIN_CAPACITY, CompiledStep, compile_applies, compile_mode,
                                       static_capacity)
from utils.generation.constrained import Grammars, constrain
from utils.generation.cpu import greedy
from utils.generation.detok import TextStream
from utils.generation.pack import INT8, DecodePack, build_pack, pack_head, pack_key, traceable
from utils.generation.prefix_cache import DEFAULT_BLOCK_TOKENS, PrefixCache
from utils.generation.speculative import NgramIndex
from utils.generation.step import KVView, causal_bias, cells, decode_pass
from utils.generation.threads import DecodeThreads
from utils.infini import InfiniCache

UNBOUNDED = 1 << 62               # positions per sequence of an Infini-attention batcher by default
CALLER = object()                 # Engine(amp=CALLER): the autocast of the code that makes the engine


# --------------------------------------------------------------------------- sampling
def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits with all but the k largest per row set to -inf (k <= 0 or >= vocab: unchanged)."""
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches
    ``p`` (always at least one); the rest -inf. p >= 1 leaves the logits unchanged."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= p                 # mass before this token already >= p
    drop[..., 0] = False
    drop = drop.scatter(-1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


GREEDY_BELOW = 1e-20
"""Temperatures below this are greedy: logits / T overflows float32 there (a logit of 10^19
at 1e-20; of 20 at 1e-38), and the softmax of infinities is NaN, which failed the engine step
of every sequence in the batch. The distribution at such a temperature is the argmax's (a
token less likely by float32's smallest logit step gets e^-(10^13))."""


class NonFiniteLogits(ArithmeticError):
    """A step's logits hold NaN or inf: the model's arithmetic overflowed (weights near float32's
    limit, 3e38, give inf activations and then NaN) or its weights are damaged. Nothing can be
    sampled from them; the caller names the model (infer, benchmark: a PipelineError; serve: the
    request's error)."""


def check_finite(logits: torch.Tensor, where: str, use: str = "sampled") -> None:
    """NonFiniteLogits naming ``where`` (e.g. "position 12") when ``logits`` hold NaN or inf.
    argmax would pick a NaN, multinomial fails on one. The sum is non-finite when an entry is
    (or, never seen, when finite values overflow it: then the exact check clears them): one
    reduction, where torch.isfinite(...).all() first writes a boolean copy of the logits."""
    if not math.isfinite(float(logits.sum())) and not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits(
            f"the model's logits are not finite (NaN or inf) at {where}: its arithmetic overflows "
            f"(weights near float32's limit, 3e38, give inf, then NaN) or its weights are damaged; "
            f"nothing can be {use} from them")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids. Temperature 0 (below ``GREEDY_BELOW``) is greedy
    (argmax)."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    logits = top_p_filter(top_k_filter(logits.float() / temperature, top_k), top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


# --------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class SamplingParams:
    """What one sequence asks for. ``stop_ids``: token ids that end it (EOS; never returned);
    ``stop``: strings that end it (need a tokenizer; never part of the text, even when split
    across tokens); ``logprobs``: None, or k >= 0 to return each new token's log-probability
    and the k most likely alternatives (of the model's distribution, before temperature);
    ``prompt_logprobs``: also each prompt token's after the first (with ``logprobs``' k
    alternatives), in ``Sequence.prompt_logprobs`` once the prompt is prefilled (scoring text,
    as OpenAI's ``echo`` with ``logprobs``); ``grammar``: None, or an llguidance grammar the
    new tokens must follow (utils/generation/constrained.py ``json_grammar``; needs a
    tokenizer on the sequence)."""
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_ids: frozenset = frozenset()
    stop: tuple = ()
    logprobs: Optional[int] = None
    prompt_logprobs: bool = False
    grammar: Optional[str] = None
    prompt_lookup: Optional[int] = None     # draft tokens per step (speculative.py); None: the engine's
    adapter: Optional[str] = None           # the LoRA adapter of the engine's to run with (adapters.py)

    def problems(self) -> list[str]:
        out = []
        if self.max_new_tokens < 0:
            out.append("max_new_tokens must be >= 0")
        if self.temperature < 0:
            out.append("temperature must be >= 0")
        if self.top_k < 0:
            out.append("top_k must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            out.append("top_p must be in (0, 1]")
        if self.logprobs is not None and self.logprobs < 0:
            out.append("logprobs must be >= 0")
        if self.prompt_logprobs and self.logprobs is None:
            out.append("prompt_logprobs needs logprobs (the number of alternatives, 0 for none)")
        if self.prompt_lookup is not None and self.prompt_lookup < 0:
            out.append("prompt_lookup must be >= 0 (0 turns it off)")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class Sequence:
    """One request's state in a :class:`Batcher`: its prompt, parameters, private random
    generator, KV-cache slot, new tokens, text, and why it finished (None while running:
    "stop" for EOS or a stop string, "length" for max_new_tokens or a full cache slot,
    "cancelled")."""

    def __init__(self, prompt: Sequence_[int], params: SamplingParams, tok=None, sink=None, tag=None,
                 continues: bool = False, lead: str = "", text_by_caller: bool = False):
        self.prompt = [int(t) for t in prompt]
        self.params = params
        self.continues, self.lead, self.text_by_caller = continues, lead, text_by_caller
        self.tokens: list[int] = []
        # continues: the text continues the prompt's (a completion, a v2 chat answer); lead: text
        # left out at its start (see TextDecoder)
        stream = TextStream(tok, params.stop, self.prompt[-1:] if continues else (), lead) \
            if tok is not None else None
        if params.stop and tok is None:
            raise ValueError("stop strings need a tokenizer on the sequence")
        if params.grammar is not None and tok is None:
            raise ValueError("an output grammar needs a tokenizer on the sequence")
        self.tok = tok
        self.constraint = None          # params.grammar's state, from the first step (constrained.py)
        # text_by_caller, without stop strings (they decide when the sequence ends, so the engine
        # must read the text): the events carry no text and the caller feeds ``caller_text`` the
        # tokens on its own thread (see Event)
        own = not text_by_caller or bool(params.stop)
        self.text: Optional[TextStream] = stream if own else None          # pushed by the engine
        self.caller_text: Optional[TextStream] = None if own else stream   # pushed by the caller
        self.sink = sink                # called with each Event (from the thread that steps)
        self.tag = tag                  # the caller's own reference (a request id, a row)
        self.slot: Optional[int] = None
        self.pos = 0                    # positions in its cache slot
        self.finish: Optional[str] = None
        self.stop_id: Optional[int] = None     # the stop id sampled, when one ended it (not in tokens)
        self.error: Optional[str] = None       # why, when finish == "error" (utils.generation.loop)
        # params.prompt_logprobs: (token, logprob, [(id, logprob) x k]) of prompt[1:], set by the prefill
        self.prompt_logprobs: Optional[list[tuple[int, float, list]]] = None
        self.cancelled = False
        self.cached = 0                 # prompt tokens whose KV the prefix cache gave (set by the prefill)
        self.generator: Optional[torch.Generator] = None
        self.lookup: Optional[NgramIndex] = None    # prompt lookup's n-grams of its text (speculative.py)
        self.lora = None                # params.adapter's Adapter (adapters.py), bound when it is queued

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass
class Event:
    """What one step did to one sequence: a new token (None when it finished without one),
    the text that became final with it ("" without a tokenizer or while a character or a
    possible stop string is pending), the token's log-probability and top alternatives
    (``(id, logprob)``, when asked for), and ``finish`` once it is done.

    A sequence with ``caller_text`` gets no text here: its caller gives each new token to
    ``seq.caller_text.push`` and, when it finishes other than "cancelled" or "error", adds
    ``seq.caller_text.finish()`` (the same text, pieces and all, as the engine's own; ``serve``
    does it on its event loop, a wake-up's tokens together, to keep the per-token
    detokenization, and the caches it cools, off the engine's thread)."""
    seq: Sequence
    token: Optional[int]
    text: str = ""
    logprob: Optional[float] = None
    top: Optional[list] = None
    finish: Optional[str] = None


class _PrefillCache:
    """One layer's cache view for a prompt prefill into one slot (the model's ``update``);
    ``mem``: the layer's (sigma(K), M, z) buffers of an infini model (``infini``)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slot: int, mem: Optional[tuple] = None):
        self.k, self.v, self.slot, self.pos = k, v, slot, 0
        self.mem = mem

    @property
    def infini(self) -> InfiniCache:
        """The slot's segment and memory (utils/infini.py), new tokens from position 0."""
        i = slice(self.slot, self.slot + 1)
        sk, M, z = self.mem
        return InfiniCache(sk[i], self.v[i], M[i], z[i], torch.zeros(1, dtype=torch.long, device=M.device))

    def update(self, k, v):                                   # (1, Hkv, T, hd)
        end = self.pos + k.shape[2]
        self.k[self.slot, :, self.pos:end] = k[0]
        self.v[self.slot, :, self.pos:end] = v[0]
        self.pos = end
        return self.k[self.slot:self.slot + 1, :, :end], self.v[self.slot:self.slot + 1, :, :end]


# --------------------------------------------------------------------------- continuous batching
class Batcher:
    """Continuous batching over one engine's model: sequences wait in a queue, join the running
    batch at a step boundary when a slot is free (a prefill of their prompt alone), decode
    together one token per step each at its own position, and leave it (EOS, stop string,
    length, cancel) at a step boundary, freeing their slot for the next one in the queue.

    Memory: ``slots`` cache slots of ``capacity`` positions each, allocated on the first
    prefill: ``bytes_per_slot`` = layers x 2 x n_kv_heads x capacity x head_dim x the compute dtype's
    element size, so the cache never exceeds ``slots * bytes_per_slot``; a sequence that finds
    no free slot waits, and one whose prompt cannot fit a slot is refused when added. Running
    sequences stay in slots 0..n-1 (a leaving one's slot is filled by moving the last one's
    cache rows), so a decode step reads one contiguous block.

    Exactness: each sequence samples from its own ``torch.Generator`` seeded by its ``seed``
    and with its own temperature / top-k / top-p, so its tokens are what a lone run with the
    same seed gives. The logits of a row agree with a lone run's to float rounding only (BLAS
    sums a 4-row block in another order than a single row: ~1e-6 relative), so a token could
    flip only where two candidates tie within that rounding (tests: never seen).
    Not thread-safe: one thread calls ``add`` / ``step`` (``utils.generation.loop`` runs one)."""

    prompt_rows = 256           # positions per logits block when scoring a prompt (_prompt_logprobs)

    def __init__(self, engine: "Engine", slots: int, capacity: int):
        if slots < 1 or capacity < 2:
            raise ValueError("need at least one slot and a capacity of 2 positions")
        self.engine, self.model = engine, engine.model
        self.slots, self.capacity = slots, capacity
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
        self.kv_flat: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None   # the same, (-1, hd) views
        self._weights: Optional[tuple] = None      # see weights()
        # infini: positions kept per slot (one segment) and each layer's (sigma(K), M, z)
        self.segment = self.model.args.segment
        self.cache_len = min(capacity, self.segment) if self.segment else capacity
        self.mem: Optional[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = None

    @property
    def bytes_per_slot(self) -> int:
        a = self.model.args
        size = torch.empty((), dtype=self.engine.dtype).element_size()
        if self.segment:                        # k, v, sigma(K) of one segment + fp32 M and z
            return a.n_layers * a.n_kv_heads * a.head_dim * (3 * self.cache_len * size
                                                             + (a.head_dim + 1) * 4)
        return a.n_layers * 2 * a.n_kv_heads * self.capacity * a.head_dim * size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> Sequence:
        """Queue ``seq`` (ValueError for an empty or out-of-vocabulary prompt, bad parameters,
        or a prompt that leaves no room for one new token in a slot)."""
        V = self.model.args.vocab_size
        if not seq.prompt:
            raise ValueError("the prompt is empty (give at least one token, e.g. BOS)")
        if min(seq.prompt) < 0 or max(seq.prompt) >= V:
            raise ValueError(f"the prompt holds a token id outside the vocabulary (0..{V - 1})")
        bad = seq.params.problems()
        if bad:
            raise ValueError("; ".join(bad))
        if len(seq.prompt) >= self.capacity:
            raise ValueError(f"the prompt has {len(seq.prompt)} tokens: a cache slot holds "
                             f"{self.capacity} positions with the new tokens")
        if seq.params.adapter is not None and seq.lora is None:
            seq.lora = self.engine.adapters.get(seq.params.adapter)    # ValueError: not loaded
        seq.generator = torch.Generator(device=self.model.device)
        if seq.params.seed is None:
            seq.generator.seed()
        else:
            seq.generator.manual_seed(int(seq.params.seed) % (1 << 64))   # any int: torch takes 64 bits
        self.waiting.append(seq)
        return seq

    def step(self) -> list[Event]:
        """One step: drop cancelled sequences, decode one token for every running one, then
        prefill waiting ones into the free slots (each gives its first token). Each event goes
        to its sequence's sink, also when a later part of the step raises (a prefill out of
        memory, also of the KV cache's first allocation): a sequence that finished before it has
        left the batch, so only its sink hears of it; the exception then propagates, with the
        failing sequence and the others still in the batch (``running`` or ``waiting``)."""
        events: list[Event] = []
        try:
            with self.engine.precision():
                self._step(events)
        finally:
            for e in events:
                if e.seq.sink is not None:
                    e.seq.sink(e)
        return events

    def _step(self, events: list[Event]) -> None:
        """:meth:`step`'s work, each event appended to ``events`` as it happens."""
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            events.append(self._finish_event(seq, "cancelled"))
        gone = [s for s in self.running if s.cancelled]
        for seq in sorted(gone, key=lambda s: -s.slot):
            events.append(self._finish_event(seq, "cancelled"))
            self._release(seq)
        if self.running:
            events += self._decode()
        while self.waiting and len(self.running) < self.slots:
            seq = self.waiting.popleft()
            if seq.params.max_new_tokens == 0:
                events.append(self._finish_event(seq, "length"))
                continue
            try:
                events += self._prefill(seq)
            except BaseException:
                if seq not in self.running:         # e.g. the KV cache's first allocation failed
                    self.waiting.appendleft(seq)    # still in the batch: whoever handles it sees it
                raise

    # -- the forward passes
    def weights(self) -> tuple[Optional[DecodePack], object, int]:
        """(decode pack, head, weights multiplied per token) of this batcher's steps, read from
        the engine on the first step and kept: checking every parameter's version per step
        is a pass over all parameters per token, a visible share of a small model's token (a
        batcher lives for one ``generate`` call or one server, while the weights stay the same)."""
        if self._weights is None:
            self._weights = (self.engine.decode_pack(), self.engine.head(), self.engine.n_weights())
        return self._weights

    @property
    def kv_shape(self) -> tuple:
        """(slots, n_kv_heads, cache_len, head_dim): each layer's keys (and values) per slot."""
        a = self.model.args
        return self.slots, a.n_kv_heads, self.cache_len, a.head_dim

    def _alloc(self) -> None:
        """The caches, in the engine's compute dtype (utils/generation/step.py: the cache rule)."""
        a, device, dtype = self.model.args, self.model.device, self.engine.dtype
        shape = self.kv_shape
        # the flat (slots * Hkv * positions, hd) tensors own the memory (the compiled step takes
        # them: a 1-slot cache is then no size-1 dimension, which dynamo would specialize)
        rows = (math.prod(shape[:3]), a.head_dim)
        self.kv_flat = [(torch.zeros(rows, dtype=dtype, device=device), torch.zeros(rows, dtype=dtype, device=device))
                        for _ in range(a.n_layers)]
        self.kv = [(k.view(shape), v.view(shape)) for k, v in self.kv_flat]
        self.engine.static_caches(self.kv_flat)
        if self.segment:
            mem = (self.slots, a.n_kv_heads, a.head_dim)
            self.mem = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(*mem, a.head_dim, device=device),
                         torch.zeros(mem, device=device)) for _ in range(a.n_layers)]

    def _prefill(self, seq: Sequence) -> list[Event]:
        if self.kv is None:
            self._alloc()
        model = self.model
        seq.slot = len(self.running)
        self.running.append(seq)
        idx = torch.tensor([seq.prompt], dtype=torch.long, device=model.device)
        _, head, n_weights = self.weights()
        with thread_policy.step_mode(self.engine.step_threads(len(seq.prompt), n_weights)):
            hs = []                                                         # (1, t, d_model) pieces
            if self.segment:                     # infini: a fresh memory, one segment at a time
                for _, M, z in self.mem:
                    M[seq.slot].zero_()
                    z[seq.slot].zero_()
                for s in range(0, idx.shape[1], self.segment):
                    caches = [_PrefillCache(k, v, seq.slot, m) for (k, v), m in zip(self.kv, self.mem)]
                    hs.append(model.trunk(idx[:, s:s + self.segment], None, AttnSpec("causal"), caches))
            else:
                with self.engine.adapters.prefill(seq.lora):
                    hs.append(self._prefill_plain(seq, idx))                # (1, T - cached, d_model)
            h = hs[-1]
            if seq.params.prompt_logprobs:
                seq.prompt_logprobs = self._prompt_logprobs(seq, torch.cat(hs, dim=1)[0], head)
            logits = head(h[:, -1]).float()                                 # (1, V)
            seq.pos = len(seq.prompt)
            return self._sample([seq], logits)

    def _prefill_plain(self, seq: Sequence, idx: torch.Tensor) -> torch.Tensor:
        """The prefill of a prompt (1, T) into its slot -> hidden states (1, T - n, d_model):
        the engine's prefix cache (utils/generation/prefix_cache.py) gives the KV of its first n
        tokens (whole blocks, at least the last token recomputed for its logits; none when every
        prompt position is scored), the rest attends over them with an explicit causal mask
        (SDPA's ``is_causal`` aligns a shorter query block to the first key), and the prompt's
        full blocks are then stored."""
        store, model = self.engine.prefix_cache, self.model
        n = 0
        if store is not None and not seq.params.prompt_logprobs:
            n = store.load(model, seq.prompt, self.kv, seq.slot, len(seq.prompt) - 1, root=_root(seq))
        caches = [_PrefillCache(k, v, seq.slot) for k, v in self.kv]
        spec = AttnSpec("causal")
        if n:
            for c in caches:
                c.pos = n
            T = idx.shape[1]
            keys = torch.arange(T, device=idx.device)
            spec = AttnSpec("mask", mask=keys[None, None, None, :] <= keys[n:, None])
        h = model.trunk(idx[:, n:], None, spec, caches)
        if store is not None:
            store.save(model, seq.prompt, self.kv, seq.slot, root=_root(seq))
        seq.cached = n
        return h

    def _prompt_logprobs(self, seq: Sequence, h: torch.Tensor, head) -> list:
        """Each prompt token after the first: (id, its log-probability given the tokens before
        it, the k most likely alternatives), from the prefill's hidden states h (T, d_model),
        ``prompt_rows`` positions' logits at a time (a 2,048-token prompt's whole (T, V) logits
        of a 32k vocabulary would be 256 MiB)."""
        ids, k, rows = seq.prompt, seq.params.logprobs or 0, self.prompt_rows
        out = []
        for a in range(0, len(ids) - 1, rows):
            logits = head(h[a:min(a + rows, len(ids) - 1)]).float()                   # (r, V)
            check_finite(logits, f"prompt positions {a}..{a + logits.shape[0] - 1}", "scored")
            lp = logits.log_softmax(dim=-1)
            nxt = torch.tensor(ids[a + 1:a + 1 + lp.shape[0]], device=lp.device)
            got = lp.gather(1, nxt[:, None])[:, 0].tolist()
            if k:
                vals, alt = lp.topk(min(k, lp.shape[1]), dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(alt.tolist(), vals.tolist())]
            else:
                tops = [[] for _ in got]
            out += [(t, g, top) for t, g, top in zip(ids[a + 1:], got, tops)]
        return out

    def _decode(self) -> list[Event]:
        model, run = self.model, self.running
        lora = self.engine.adapters.decode_step([s.lora for s in run])    # None: no adapter row
        if len(run) == 1 and lora is None:  # a lone greedy row may take several tokens (speculative.py)
            events = speculative.step(self, run[0])
            if events is not None:
                return events
        n, device = len(run), model.device
        at = [s.pos % self.segment if self.segment else s.pos for s in run]   # infini: within the segment
        length = max(at) + 1
        cos_all, sin_all = model.rope(length, device)                       # outside inference mode: kept
        pack, head, n_weights = self.weights()
        compiled = self.engine.compiled_step(pack) if lora is None else None    # adapter rows: eager
        threads, chooser = self.engine.decode_threads(n, n_weights)
        with thread_policy.step_mode(threads):
            pos = torch.tensor(at, device=device)                           # (n,) the new tokens' positions
            tokens = torch.tensor([s.tokens[-1] for s in run], device=device)
            if compiled is not None:                                        # the same pass as one graph
                logits = compiled(self.kv_flat, self.kv_shape, tokens, pos, cos_all, sin_all)
            else:
                logits = self._decode_logits(tokens, pos, at, length, cos_all, sin_all, lora)
            if chooser is not None:
                chooser.done()
            for s in run:
                s.pos += 1
            return self._sample(list(run), logits)

    def _decode_logits(self, tokens: torch.Tensor, pos: torch.Tensor, at: list[int], length: int,
                       cos_all: torch.Tensor, sin_all: torch.Tensor, lora=None) -> torch.Tensor:
        """The eager decode step: (n, V) fp32 logits of rows 0..n-1 (utils/generation/step.py
        ``decode_pass``), each attending the first ``length`` positions of its slot (a key mask
        only where the rows are not all at the last of them). ``lora``: the step's adapter rows
        (adapters.py ``decode_step``): the pack's products add each row's delta, or, without a
        pack, forward hooks on the Linear layers do."""
        model, dtype = self.model, self.engine.dtype
        n = len(at)
        pack, head, _ = self.weights()
        packs = pack.layers if pack is not None else [None] * len(model.layers)
        if lora is not None and pack is not None:
            packs = lora.packs(packs)
        key_bias = None if min(at) == length - 1 else causal_bias(pos, length, dtype)
        slots = torch.arange(n, device=pos.device)
        view = KVView(slice(0, n), length, cells(slots, pos, model.args.n_kv_heads, self.cache_len), pos,
                      self.mem)
        with lora.hooks() if lora is not None and pack is None else contextlib.nullcontext():
            return decode_pass(model, packs, head, self.kv_flat, self.kv_shape, view, tokens, cos_all, sin_all,
                               key_bias)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Event]:
        check_finite(logits, f"position {max(s.pos for s in seqs)}")
        allowed, broken = constrain(seqs, logits, self.engine.grammars)     # per-row token masks
        if all(s.params.greedy for s in seqs):
            toks = greedy(allowed)
        else:
            toks = [int(sample_next(allowed[r:r + 1], s.params.temperature, s.params.top_k,
                                    s.params.top_p, s.generator)) for r, s in enumerate(seqs)]
        events, finished = [], []
        for r, (s, t) in enumerate(zip(seqs, toks)):
            e = Event(s, t)
            if r in broken:                                # its grammar failed: it ends, alone
                s.error, e.token = broken[r], None
                e.finish = s.finish = "error"
                finished.append(s)
                events.append(e)
                continue
            if s.params.logprobs is not None:
                lp = logits[r].log_softmax(dim=-1)
                e.logprob = float(lp[t])
                if s.params.logprobs:
                    vals, ids = lp.topk(min(s.params.logprobs, lp.numel()))
                    e.top = list(zip(ids.tolist(), vals.tolist()))
            hit = False                                    # a stop string ended it
            if t in s.params.stop_ids:
                e.token, e.logprob, e.top, e.finish = None, None, None, "stop"
                s.stop_id = t
            else:
                s.tokens.append(t)
                if s.text is not None:
                    e.text, hit = s.text.push(t)
                    e.finish = "stop" if hit else None
                if e.finish is None and s.constraint is not None and s.constraint.advance(t):
                    e.finish = "stop"                      # the JSON is complete: nothing can follow
                if e.finish is None and (len(s.tokens) >= s.params.max_new_tokens or s.pos >= self.capacity):
                    e.finish = "length"
            if e.finish is not None:
                if s.text is not None and not hit:
                    e.text += s.text.finish()
                s.finish = e.finish
                finished.append(s)
            events.append(e)
        for s in sorted(finished, key=lambda s: -s.slot):
            self._release(s)
        return events

    def _finish_event(self, seq: Sequence, why: str) -> Event:
        seq.finish = why
        text = seq.text.finish() if (seq.text is not None and why != "cancelled") else ""
        return Event(seq, None, text, finish=why)

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s slot; the last running sequence moves into it (cache rows copied)."""
        i, last = seq.slot, self.running[-1]
        if self.engine.prefix_cache is not None and seq.finish in ("stop", "length"):   # the next turn's prefix
            self.engine.prefix_cache.save(self.model, (seq.prompt + seq.tokens)[:seq.pos], self.kv, i,
                                          root=_root(seq))
        self.running.pop()
        if last is not seq:
            for k, v in self.kv:
                k[i, :, :last.pos] = k[last.slot, :, :last.pos]
                v[i, :, :last.pos] = v[last.slot, :, :last.pos]
            for t in (x for m in self.mem or () for x in m):               # infini: sigma(K), M, z
                t[i] = t[last.slot]
            last.slot = i
            self.running[i] = last
        seq.slot = None


def _root(seq: Sequence):
    """The prefix-cache chain a sequence's blocks hang from: its adapter's (KV computed with a
    LoRA delta is that adapter's alone), or the base model's."""
    return 0 if seq.lora is None else seq.lora.key


# --------------------------------------------------------------------------- the engine
class Engine:
    """Generation over one model (see the module docstring). ``threads``: intra-op threads of
    every step (None: the ``step_threads`` rule); ``prompt_lookup``: draft tokens per step of a
    greedy sequence whose parameters leave it None (utils/generation/speculative.py; 0: off);
    ``product``: the fp32 decode pack's kernel, "auto" (the faster, timed when the pack is
    made), "torch" or "blas" (utils/generation/pack.py ``build_pack``).

    Precision, ``amp``: the autocast dtype every step runs under, or None for none (the
    weights' dtype); by default (``CALLER``) the caller's autocast on the model's device when
    the engine is made (the trainer's samples and validation run under the run's autocast, so
    an engine made there decodes as the training forward computes). Either way a step sets
    its own autocast state, so one engine computes alike wherever its steps are driven from
    (a generator resumed outside the caller's context, the server's thread). ``dtype``, the
    compute dtype (the autocast dtype, else the weights'), is the KV cache's
    (utils/generation/step.py: the cache rule). Under autocast the fp32 decode pack, a CPU
    shortcut that multiplies outside autocast, is not used: steps run the model's own
    modules, as on CUDA (an int8 model's pack is its weights and stays)."""

    def __init__(self, model, threads: Optional[int] = None, prompt_lookup: int = 0, compile: str = "off",
                 product: str = "auto", amp=CALLER):
        self.model = model
        device_type = model.device.type
        if amp is CALLER:
            amp = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        self.amp: Optional[torch.dtype] = amp
        self.dtype: torch.dtype = amp or model.tok_embeddings.weight.dtype
        self.threads = threads
        self.product = product
        self.prompt_lookup = prompt_lookup
        self.compile = compile
        self._compiled: Optional[CompiledStep] = None
        self._decode_threads: Optional[DecodeThreads] = None
        self.verify_weights: Optional[tuple] = None   # (pack, block weights of verify passes), speculative.py
        self._pack: Optional[DecodePack] = None
        self.grammars = Grammars()          # output grammars' vocabularies, one per tokenizer
        self.prefix_cache: Optional[PrefixCache] = None
        self.adapters = AdapterSet(model, self.dtype)   # LoRA adapters served unmerged (adapters.py)

    def use_prefix_cache(self, budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Optional[str]:
        """Reuse the KV of prompt prefixes seen before, within ``budget_bytes`` (0: off), across
        every batcher of this engine (utils/generation/prefix_cache.py); None, or why not (an
        Infini-attention model: its slots hold a segment and a compressive memory, no
        per-position KV to reuse)."""
        self.prefix_cache = None
        if budget_bytes <= 0:
            return "off (a budget of 0)"
        if self.model.args.segment:
            return "off: Infini-attention models keep no per-position KV to reuse"
        self.prefix_cache = PrefixCache(budget_bytes, block_tokens, self.dtype)
        self.prefix_cache.bind(self.model)
        return None

    def precision(self):
        """The autocast state of this engine's steps (see the class docstring): ``amp``'s, or
        autocast off."""
        device_type = self.model.device.type
        if self.amp is None:
            return torch.autocast(device_type, enabled=False)
        return torch.autocast(device_type, dtype=self.amp)

    def static_caches(self, kv_flat: list) -> None:
        """Mark a batcher's caches as static inputs of the compiled step where it runs with CUDA
        graphs: the step writes them in place, and CUDA graph trees record a graph over mutated
        inputs only when their addresses are static (a batcher's caches never move), as for
        a module's buffers (gpt-fast keeps its caches as buffers); otherwise inductor skips
        the graphs ("mutated inputs") and every step launches each kernel."""
        if self._compiles() and compile_mode(self.model.device.type) is not None:
            for k, v in kv_flat:
                torch._dynamo.mark_static_address(k)
                torch._dynamo.mark_static_address(v)

    def batcher(self, slots: int, capacity: Optional[int] = None) -> Batcher:
        """A continuous-batching :class:`Batcher` with ``slots`` cache slots of ``capacity``
        positions (default: the model's context, ``max_seq_len``; for Infini-attention, whose
        slots hold one segment whatever the length, ``UNBOUNDED`` positions)."""
        return Batcher(self, slots, capacity or self.model.args.context or UNBOUNDED)

    def run(self, batcher: Batcher) -> Iterator[list[Event]]:
        """Step ``batcher`` until it has no work, yielding each step's events; the model is in
        eval mode meanwhile and back in its previous mode after (also when the caller stops
        early)."""
        model = self.model
        was_training = model.training
        model.eval()
        try:
            while batcher.has_work():
                events = batcher.step()
                if events:
                    yield events
        finally:
            model.train(was_training)
            if was_training:
                self._pack = None      # training moves the weights on: the copy would only hold memory
                self.verify_weights = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, eos_id: int | Iterable[int] | None = None,
                 seed: Optional[int] = None) -> list[list[int]]:
        """New tokens for each prompt (EOS ends a row and is not included). Row r samples with
        ``seed + r`` (a lone run of prompt r with that seed gives the same tokens)."""
        out: list[list[int]] = [[] for _ in prompts]
        for events in self._run_prompts(prompts, max_new_tokens, temperature, top_k, top_p, eos_id, seed):
            for e in events:
                if e.token is not None:
                    out[e.seq.tag].append(e.token)
        return out

    def stream(self, prompt: list[int], max_new_tokens: int, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, eos_id: int | Iterable[int] | None = None,
               seed: Optional[int] = None) -> Iterator[int]:
        """Yield each new token of one prompt as soon as it is sampled (EOS ends, not yielded)."""
        for events in self._run_prompts([prompt], max_new_tokens, temperature, top_k, top_p, eos_id, seed):
            for e in events:
                if e.token is not None:
                    yield e.token

    def _run_prompts(self, prompts, max_new_tokens, temperature, top_k, top_p, eos_id, seed):
        prompts = [list(p) for p in prompts]
        if not prompts:
            return
        stop_ids = frozenset() if eos_id is None else (
            frozenset({int(eos_id)}) if isinstance(eos_id, int) else frozenset(int(e) for e in eos_id))
        capacity = max(len(p) for p in prompts) + max(max_new_tokens, 1)
        if self._compiles():                             # a few capacities, one compile each
            capacity = static_capacity(capacity, self.model.args.context)
        b = self.batcher(len(prompts), capacity)
        for r, p in enumerate(prompts):
            params = SamplingParams(max_new_tokens, temperature, top_k, top_p,
                                    None if seed is None else int(seed) + r, stop_ids)
            try:
                b.add(Sequence(p, params, tag=r))
            except ValueError as e:
                raise ValueError(f"prompt {r}: {e}") from None
        yield from self.run(b)

    def head(self):
        """The output projection of generation steps, x (n, d_model) -> (n, vocab): the decode
        pack's (its oneDNN copy for 2 or more rows, where it has one) or the model's."""
        pack = self.decode_pack()
        return self.model.lm_head if pack is None else pack_head(pack)

    def decode_pack(self) -> Optional[DecodePack]:
        """The weights of generation steps on CPU (utils/generation/pack.py): fp32 weights
        transposed, in ``pack_panels`` column panels; an int8 model's fused int8 weights (no
        copy); None elsewhere. Made on the first call and kept while the weights stay the same
        (``pack_key``: same storage, no in-place update since), so interactive prompts pay it
        once; a call made on a model in training mode drops it on return (``run``)."""
        key = pack_key(self.model)
        if self.amp is not None and key != INT8:         # see the class docstring: under autocast, no copy
            key = None
        if self._pack is None or self._pack.key != key:
            self._pack = None                                                # free the old copy first
            self._pack = build_pack(self.model, key, self.pack_panels(), self.product) if key is not None else None
        return self._pack

    def compiled_step(self, pack: Optional[DecodePack]) -> Optional[CompiledStep]:
        """The compiled decode step over ``pack`` (the batcher's decode weights; None: the
        model's modules) where ``compile`` turns it on for this model and device
        (utils/generation/compiled.py ``compile_applies``), else None (the eager step). Made
        on the first call and kept while the decode weights stay the same."""
        m = self.model
        if not self._compiles():
            return None
        if self._compiled is None or self._compiled.pack is not pack:
            traced = traceable(pack) if pack is not None else None     # torch's products only
            packs = traced.layers if traced is not None else [None] * len(m.layers)
            head = m.lm_head if traced is None else pack_head(traced, onednn=False)
            self._compiled = CompiledStep(m, packs, head, pack, mode=compile_mode(m.device.type))
        return self._compiled

    def _compiles(self) -> bool:
        """Whether this engine's decode steps run compiled (``compile`` on this model and device)."""
        m = self.model
        return compile_applies(self.compile, m.device.type, m.args.segment)

    @torch.no_grad()
    def compile_now(self, slots: int = 1, capacity: Optional[int] = None) -> Optional[float]:
        """Compile the decode step now (where ``compile`` turns it on) for the batcher shape the
        caller will run, ``slots`` and ``capacity`` (serve: its lane's; by default
        ``generate``'s for one prompt of its smallest capacity: infer's), on a throwaway
        batcher of that shape, so that no request waits for it: the seconds it took, None
        when the step is not compiled."""
        step = self.compiled_step(self.decode_pack())
        if step is None:
            return None
        b = self.batcher(slots, capacity or static_capacity(STATIC_MIN_CAPACITY, self.model.args.context))
        b._alloc()
        cos, sin = self.model.rope(b.cache_len, self.model.device)
        with thread_policy.step_mode(self.step_threads(1, self.n_weights())), self.precision():
            return step.warm(b.kv_flat, b.kv_shape, cos, sin, slots)

    def decode_threads(self, n: int, n_weights: int, kind: Hashable = None) -> tuple[Optional[int], Optional[DecodeThreads]]:
        """(threads, chooser) of a decode step of ``n`` rows (or ``n`` tokens of one row's
        verify pass, utils/generation/speculative.py: ``kind`` "verify", all lengths measured
        together): ``step_threads``' count where it gives one (chooser None); else, on CPU,
        the count this engine's :class:`~utils.generation.threads.DecodeThreads` picks by
        measurement (call its ``done`` after the step)."""
        threads = self.step_threads(n, n_weights)
        if threads is not None or self.model.device.type != "cpu":
            return threads, None
        if self._decode_threads is None:
            self._decode_threads = DecodeThreads(torch.get_num_threads())
        return self._decode_threads.pick(n if kind is None else kind), self._decode_threads

    def n_weights(self) -> int:
        """Weights a token multiplies by (utils/generation/threads.py ``n_weights``)."""
        return thread_policy.n_weights(self.model)

    def step_threads(self, n_tokens: int, n_weights: int) -> Optional[int]:
        """Intra-op threads for one step over ``n_tokens`` tokens of this engine's model, which
        multiplies by ``n_weights`` weights per token: the engine's ``threads`` when given, else
        the rule of utils/generation/threads.py ``step_threads``."""
        return thread_policy.step_threads(self.model, n_tokens, n_weights, self.threads)

    def pack_panels(self) -> int:
        """Column panels of the fp32 decode pack: the threads of a one-token step
        (utils/generation/threads.py ``pack_panels``)."""
        return thread_policy.pack_panels(self.model, self.threads)


def generate(model, prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
    """``Engine(model).generate(...)`` for a one-off call (the trainer's samples): the decode
    weights, if any, are freed on return."""
    return Engine(model).generate(prompts, max_new_tokens, **kw)


__all__ = ["Engine", "CALLER", "Batcher", "Sequence", "SamplingParams", "Event", "generate", "NonFiniteLogits",
           "sample_next", "top_k_filter", "top_p_filter", "check_finite", "GREEDY_BELOW", "UNBOUNDED"]
