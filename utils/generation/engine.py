"""The generation engine: KV cache, CPU decode weights, thread policy, the step loop,
sampling and stop conditions, incremental detokenization (library; no side effects).

    engine = Engine(model)                                  keep it to reuse its decode weights
    engine.generate(prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                    eos_id=None, seed=None) -> [[new ids], ...]
    engine.stream(prompt, ...)                              yields each new id as it is sampled
    generate(model, prompts, ...)                           one-off: a throwaway Engine

Contract: greedy (temperature 0), temperature, top-k (0 disables), top-p (1.0 disables);
``seed`` seeds a private ``torch.Generator`` (the global RNG is untouched; None draws a fresh
seed); EOS (one id or several) ends a row and is never returned; a batch of prompts of
different lengths is left-padded with an attention mask and positions per row, and each row
gets exactly what it would get alone (greedy). The model is put in eval mode for the call and
back in its previous mode after; each step runs in inference mode with its own thread count
(``step_threads``), both restored before the caller's code runs again, so ``stream`` can
yield between steps and torch's global thread count is never left changed.

Memory: the KV cache is (layers x 2 x B x n_kv_heads x (prompt + max_new_tokens) x head_dim)
values in the weights' dtype, allocated once per call. With fp32 weights on CPU the engine also
keeps a transposed, contiguous copy of the weights (``decode_pack``: ~2.2x faster tokens at
batch 1, at the cost of a second copy of the weights while the engine lives, bounded by
``DECODE_PACK_MAX_BYTES``); it is rebuilt when the weights change (storage or ``_version``:
an optimizer step or ``load_state_dict``) and freed with the engine.

:class:`TextDecoder` turns the stream of ids into text pieces without ever cutting a UTF-8
character (or a multi-token grapheme the tokenizer has not finished) in two.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, NamedTuple, Optional

import torch

from utils.attention import AttnSpec

DECODE_PACK_MAX_BYTES = 1 << 30   # models with more weights generate without a transposed copy


def decode_pack_applies(device_type: str, dtype: torch.dtype, weight_bytes: float) -> bool:
    """Whether generation keeps a transposed copy of the weights (``Engine.decode_pack``):
    fp32 weights on CPU, at most DECODE_PACK_MAX_BYTES of them."""
    return device_type == "cpu" and dtype == torch.float32 and weight_bytes <= DECODE_PACK_MAX_BYTES


# --------------------------------------------------------------------------- state of a call
class KVCache:
    """Pre-allocated keys and values of one layer, (B, n_kv_heads, capacity, head_dim)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.pos = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, T, D = k.shape
        if self.k is None:
            self.k = k.new_zeros(B, H, self.capacity, D)
            self.v = v.new_zeros(B, H, self.capacity, D)
        end = self.pos + T
        if end > self.capacity:
            raise RuntimeError(f"KV cache full ({self.capacity} positions)")
        self.k[:, :, self.pos:end] = k
        self.v[:, :, self.pos:end] = v
        self.pos = end
        return self.k[:, :, :end], self.v[:, :, :end]


class PackedLayer(NamedTuple):
    """One block's weights for CPU decoding, transposed to (in, out) and contiguous."""
    qkv: torch.Tensor      # (d_model, (n_heads + 2 n_kv_heads) * head_dim): wq | wk | wv
    wo: torch.Tensor       # (n_heads * head_dim, d_model)
    gate_up: torch.Tensor  # (d_model, 2 hidden): w_gate | w_up
    down: torch.Tensor     # (hidden, d_model)


class DecodePack(NamedTuple):
    """The weights generation steps multiply by on CPU in fp32, see ``Engine.decode_pack``."""
    key: tuple
    layers: list
    head: torch.Tensor     # (d_model, vocab)


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


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids. Temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = top_p_filter(top_k_filter(logits.float() / temperature, top_k), top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


@contextlib.contextmanager
def step_mode(threads: Optional[int]):
    """Inference mode, and ``threads`` intra-op threads (None: unchanged), for one generation
    step; both are restored before the caller's code runs again (``Engine.stream`` yields
    between steps)."""
    prev = torch.get_num_threads()
    change = threads is not None and threads != prev
    if change:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            yield
    finally:
        if change:
            torch.set_num_threads(prev)


# --------------------------------------------------------------------------- the engine
class Engine:
    """Generation over one model (see the module docstring). ``threads``: intra-op threads of
    every step (None: the ``step_threads`` rule)."""

    def __init__(self, model, threads: Optional[int] = None):
        self.model = model
        self.threads = threads
        self._pack: Optional[DecodePack] = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, eos_id: int | Iterable[int] | None = None,
                 seed: Optional[int] = None) -> list[list[int]]:
        """New tokens for each prompt (EOS ends a row and is not included)."""
        out: list[list[int]] = [[] for _ in prompts]
        for row_tokens in self.steps(prompts, max_new_tokens, temperature, top_k, top_p, eos_id, seed):
            for r, t in row_tokens:
                out[r].append(t)
        return out

    def stream(self, prompt: list[int], max_new_tokens: int, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, eos_id: int | Iterable[int] | None = None,
               seed: Optional[int] = None) -> Iterator[int]:
        """Yield each new token of one prompt as soon as it is sampled (EOS ends, not yielded)."""
        for row_tokens in self.steps([prompt], max_new_tokens, temperature, top_k, top_p, eos_id, seed):
            for _, t in row_tokens:
                yield t

    def steps(self, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, eos_id=None,
              seed=None) -> Iterator[list[tuple[int, int]]]:
        """The step loop: yields, per step, [(row, token), ...] of the rows still running."""
        model = self.model
        prompts = [list(p) for p in prompts]
        V = model.args.vocab_size
        if not prompts:
            return
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty (give at least one token, e.g. BOS)")
            if min(p) < 0 or max(p) >= V:
                raise ValueError(f"prompt {i} holds a token id outside the vocabulary (0..{V - 1})")
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1 or max_new_tokens < 0:
            raise ValueError("need temperature >= 0, top_k >= 0, 0 < top_p <= 1, max_new_tokens >= 0")
        if max_new_tokens == 0:
            return
        eos = set() if eos_id is None else ({int(eos_id)} if isinstance(eos_id, int) else {int(e) for e in eos_id})
        was_training = model.training
        model.eval()
        try:
            yield from self._run(prompts, max_new_tokens, temperature, top_k, top_p, eos, seed)
        finally:
            model.train(was_training)
            if was_training:
                self._pack = None      # training moves the weights on: the copy would only hold memory

    def _run(self, prompts, max_new_tokens, temperature, top_k, top_p, eos, seed):
        model = self.model
        device = model.device
        B, lens = len(prompts), [len(p) for p in prompts]
        Tp = max(lens)
        idx = torch.zeros(B, Tp, dtype=torch.long)
        valid = torch.zeros(B, Tp, dtype=torch.bool)
        for r, p in enumerate(prompts):                 # left padding
            idx[r, Tp - len(p):] = torch.tensor(p)
            valid[r, Tp - len(p):] = True
        idx, valid = idx.to(device), valid.to(device)
        capacity = Tp + max_new_tokens
        caches = [KVCache(capacity) for _ in model.layers]
        gen = torch.Generator(device=device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(seed))
        cos_all, sin_all = model.rope(capacity, device)  # outside inference mode: the table is kept
        pack = self.decode_pack()
        packs = pack.layers if pack is not None else [None] * len(model.layers)
        head = (lambda x: x @ pack.head) if pack is not None else model.lm_head
        n_params = model.num_params()
        padded = min(lens) < Tp
        with step_mode(self.step_threads(B * Tp, n_params)):
            key_bias = None
            if padded:
                positions = (valid.long().cumsum(1) - 1).clamp(min=0)    # (B, Tp)
                eye = torch.eye(Tp, dtype=torch.bool, device=device)
                causal = torch.ones(Tp, Tp, dtype=torch.bool, device=device).tril()
                # pad queries see themselves only, so no row of the mask is empty
                mask = causal & (valid[:, None, :] | eye)                # (B, Tp, Tp)
                spec = AttnSpec("mask", mask=mask[:, None])
                key_bias = torch.zeros(B, capacity, dtype=model.tok_embeddings.weight.dtype, device=device)
                key_bias[:, :Tp].masked_fill_(~valid, float("-inf"))    # new tokens: all valid
                next_pos = positions[:, -1:] + 1                         # (B, 1)
            else:
                positions, spec = None, AttnSpec("causal")
            h = model.trunk(idx, positions, spec, caches)                # (B, Tp, d_model)
            tok = sample_next(head(h[:, -1]).float(), temperature, top_k, top_p, gen)
            toks = tok.tolist()
        threads = self.step_threads(B, n_params)
        done = [False] * B
        for step in range(max_new_tokens):
            emitted = []
            for r, t in enumerate(toks):
                if done[r]:
                    continue
                if t in eos:
                    done[r] = True
                else:
                    emitted.append((r, t))
            if emitted:
                yield emitted
            if all(done) or step == max_new_tokens - 1:
                break
            with step_mode(threads):
                if padded:
                    cos, sin = cos_all[next_pos], sin_all[next_pos]     # (B, 1, hd)
                    next_pos = next_pos + 1
                else:
                    cos, sin = cos_all[Tp + step:Tp + step + 1], sin_all[Tp + step:Tp + step + 1]
                h = model.tok_embeddings(tok[:, None])                   # (B, 1, d_model)
                for layer, cache, packed in zip(model.layers, caches, packs):
                    h = layer.decode(h, cos, sin, cache, key_bias, packed)
                logits = head(model.norm(h[:, 0])).float()               # (B, V): last position only
                tok = sample_next(logits, temperature, top_k, top_p, gen)
                toks = tok.tolist()

    def decode_pack(self) -> Optional[DecodePack]:
        """The weights of generation steps, transposed, on CPU in fp32; None elsewhere.

        ``nn.Linear`` on one or a few rows computes each output as a dot product over the
        input features, which BLAS runs far below memory bandwidth on CPU; ``x @ Wt`` with a
        contiguous (in, out) copy streams over the outputs with full vector FMAs, and the
        query/key/value and gate/up projections each become one product. Measured on one
        core here (perf/generate_throughput.py, 7.7M model, 32k vocabulary): the head's
        product 1.8 -> 0.7 ms, a whole token 2.9 -> 1.6 ms. The copy is made on the first
        call and kept while the weights stay the same (same storage, no in-place update
        since: an optimizer step or ``load_state_dict`` invalidates it), so interactive
        prompts pay it once; a call made on a model in training mode drops it on return.
        Cost: a second copy of the weights while the engine holds it, so models above
        ``DECODE_PACK_MAX_BYTES`` of weights are not packed. Sums run in another order, so
        logits can differ from the Linear's in the last bits. Not on CUDA (its GEMV has no
        such gap) nor for bf16/fp16 weights (slower transposed on CPU)."""
        model = self.model
        w = model.lm_head.weight
        params = list(model.parameters())
        if not decode_pack_applies(w.device.type, w.dtype, sum(p.numel() * p.element_size() for p in params)):
            self._pack = None                                                # e.g. moved to CUDA since
            return None
        key = tuple((p.data_ptr(), p._version) for p in params)
        if self._pack is not None and self._pack.key == key:
            return self._pack
        self._pack = None                                                    # free the old copy first
        t = lambda *ws: torch.cat([x.detach() for x in ws]).t().contiguous()  # noqa: E731
        layers = [PackedLayer(t(b.attn.wq.weight, b.attn.wk.weight, b.attn.wv.weight), t(b.attn.wo.weight),
                              t(b.mlp.w_gate.weight, b.mlp.w_up.weight), t(b.mlp.w_down.weight))
                  for b in model.layers]
        self._pack = DecodePack(key, layers, t(w))
        return self._pack

    def step_threads(self, n_tokens: int, n_params: int) -> Optional[int]:
        """Intra-op threads for one generation step over ``n_tokens`` tokens: on CPU, 1 when
        the step is small (at most 2^28 multiply-adds, roughly 25 ms on one core: a 32-token
        prompt or 8 decode rows of a 7M model, one decode row of a 250M one), else unchanged
        (None). On an idle second core such a step saves a few ms at best (batch-1 decoding is
        bound by reading the weights, not by arithmetic), while every op's parallel region
        waits a scheduler time slice whenever a worker thread is descheduled on a busy machine
        (measured on 2 shared cores: 2 threads 5-8x slower than 1 per decode step, 5-50x per
        32-token prefill). ``threads`` given to the engine overrides the rule."""
        if self.threads is not None:
            return self.threads
        if self.model.device.type != "cpu":
            return None
        return 1 if n_tokens * n_params <= 1 << 28 else None


def generate(model, prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
    """``Engine(model).generate(...)`` for a one-off call (the trainer's samples): the decode
    weights, if any, are freed on return."""
    return Engine(model).generate(prompts, max_new_tokens, **kw)


# --------------------------------------------------------------------------- text
class TextDecoder:
    """Incremental detokenization: ``push(id)`` returns the text that became final with that
    token ("" while a character is still incomplete: the decoded tail ends in U+FFFD, or the
    new text would change what was already shown), ``finish()`` the rest. Joined, the pieces
    equal ``tok.decode(ids, skip_special_tokens=True)``, except that a decode which rewrites
    earlier text is finished with a newline and the full text."""

    def __init__(self, tok):
        self.tok = tok
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        now = self.tok.decode(self.ids, skip_special_tokens=True)
        if now.endswith("\ufffd") or len(now) <= len(self.shown) or not now.startswith(self.shown):
            return ""
        piece, self.shown = now[len(self.shown):], now
        return piece

    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def finish(self) -> str:
        final = self.text()
        if final == self.shown:
            return ""
        piece = final[len(self.shown):] if final.startswith(self.shown) else "\n" + final
        self.shown = final
        return piece


def estimated_weight_bytes(checkpoint_bytes: float, device_type: str) -> float:
    """Memory a checkpoint's model takes to generate: its fp32 weights (about a third of a
    training checkpoint, which also holds AdamW's two moments), twice that where the engine
    keeps a transposed copy (``decode_pack_applies``)."""
    weights = checkpoint_bytes / 3
    if decode_pack_applies(device_type, torch.float32, weights):
        weights *= 2
    return weights


__all__ = ["Engine", "generate", "TextDecoder", "KVCache", "DecodePack", "PackedLayer",
           "decode_pack_applies", "DECODE_PACK_MAX_BYTES", "sample_next", "top_k_filter",
           "top_p_filter", "step_mode", "estimated_weight_bytes"]
