"""Prompt-lookup speculative decoding (library; no side effects): a greedy sequence drafts its
next tokens from its own text and checks them in one forward pass, as transformers'
``prompt_lookup_num_tokens`` and llama.cpp's lookup decoding do. Text that copies its prompt
(an edit, a summary quoting its source, code refactoring, retrieval answers) then takes
several tokens per pass over the weights, where plain decoding takes one.

    index = NgramIndex()                         one per sequence (``Sequence.lookup``)
    index.draft(ids, k) -> [ids]                 up to k tokens that followed the last n-gram
    step(batcher, seq) -> [Event, ...] or None   one speculative decode step of a lone sequence

Contract:

- **Draft.** The longest suffix of the sequence's tokens (prompt + generated) of ``MAX_NGRAM``
  down to ``MIN_NGRAM`` tokens that occurred before is looked up at its first occurrence (as
  transformers does: in text that copies its prompt that is the prompt's, and it has the
  most tokens after it; the most recent one would draft a single token in a run of one
  token), and the up-to-k tokens that followed it are the draft. The index is a dict per
  n-gram length, extended by the tokens new since the last step, so a step's lookup is O(new
  tokens), whatever the prompt's length. No match: no draft, and the step is a plain one.
  A draft wholly rejected pauses drafting for 1, 2, 4 .. 16 steps while drafts keep failing
  (``NgramIndex.verified``): free text matches short n-grams often and copies them rarely.
- **Verify.** The last token and the k drafted ones go through the model in one forward over
  the sequence's cache slot (positions pos..pos+k written, each attending causally: the model's
  one-token ``decode`` step with the queries of one sequence folded together,
  ``model.Attention.decode``). Each position's logits go through the batcher's own sampling
  (``Batcher._sample``: stop ids, stop strings, lengths, logprobs, whatever else it applies) in
  order; a drafted token is accepted while the token chosen at its position equals it, so the
  tokens are exactly those greedy decoding chooses (to the float rounding of a k+1-row product
  against a one-row product, as for batching: tests/test_speculative.py checks them equal). The
  first position that disagrees gives its own (correct) token, so each pass yields between 1
  and k+1 tokens; cache positions past the last accepted one are left to be overwritten (no
  step reads past a row's position).
- **When.** Only greedy rows speculate (temperature 0): a sampled row's token is a draw from
  its own generator, which a draft cannot predict without rejection sampling, so sampled rows
  decode one token per step as always (the option is accepted and has no effect). Only a
  batch of one row speculates, as vLLM turns speculation off from a batch size
  (``speculative_disable_by_batch_size``): several rows already share each pass over the
  weights, and a row's verification alone would read them once more per row. Not for
  Infini-attention models (a draft could cross a segment's end, where the memory updates).
- **Cost.** A pass of k+1 tokens must read the weights about once to save time: an fp32
  model's verify passes multiply by oneDNN-packed copies of its block matrices
  (:func:`verify_layers`: another copy of the block weights while the engine holds them),
  int8's by its row-by-row kernel (a pass then costs several steps, so it gains less). A
  missed draft costs one such pass in place of a step, and a draft wholly rejected pauses
  drafting (above). Off by default; measured gains and losses: docs/performance.md, Decode at
  batch 1.
"""
from __future__ import annotations

from typing import Optional

import torch

from utils.generation import threads as thread_policy
from utils.generation.cpu import RowsProduct, onednn_linear_available
from utils.generation.pack import INT8, PackedLayer
from utils.generation.step import KVView, causal_bias, cells, decode_pass

MAX_NGRAM = 3     # longest suffix looked up (transformers' default is 2, vLLM's prompt_lookup_max 4..5)
MIN_NGRAM = 1
MAX_PAUSE = 16    # steps at most without drafting after drafts that failed (NgramIndex.verified)


class NgramIndex:
    """Where each n-gram (``MIN_NGRAM`` .. ``MAX_NGRAM`` tokens) of a token list first ended,
    kept up to date incrementally (the list only grows)."""

    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM):
        self.sizes = range(max_n, min_n - 1, -1)
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self.indexed = 0              # n-grams ending at 1..indexed are in the index
        self.misses = 0               # drafts in a row of which nothing was accepted
        self.pause = 0                # steps left without a draft (see ``verified``)

    def verified(self, accepted: int) -> None:
        """After a verify pass that accepted ``accepted`` drafted tokens: a draft wholly
        rejected pauses drafting for 1, 2, 4 .. ``MAX_PAUSE`` steps (doubling while they keep
        failing), so text that does not copy its prompt pays for few useless passes."""
        self.misses = 0 if accepted else self.misses + 1
        self.pause = min(1 << (self.misses - 1), MAX_PAUSE) if self.misses else 0

    def draft(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the first occurrence of the longest
        suffix of ``ids`` found (see the module docstring); [] when none is."""
        last = len(ids) - 1                       # n-grams ending at the last token are the suffix itself
        for e in range(self.indexed + 1, last + 1):
            for n in self.sizes:
                if e >= n:
                    self.ends[n].setdefault(tuple(ids[e - n:e]), e)
        self.indexed = max(self.indexed, last)
        for n in self.sizes:
            if len(ids) > n:
                e = self.ends[n].get(tuple(ids[-n:]))
                if e is not None:
                    return ids[e:e + k]
        return []


def draft_for(batcher, seq) -> list[int]:
    """The draft of ``seq`` for this step ([] when it does not speculate, see the module
    docstring), cut to what its length limit and its cache slot leave room for."""
    k = batcher.engine.prompt_lookup if seq.params.prompt_lookup is None else seq.params.prompt_lookup
    if k <= 0 or not seq.params.greedy or batcher.segment or len(batcher.running) != 1 or not seq.tokens:
        return []
    room = min(seq.params.max_new_tokens - len(seq.tokens) - 1, batcher.capacity - seq.pos - 1)
    if room <= 0:
        return []
    if seq.lookup is None:
        seq.lookup = NgramIndex()
    if seq.lookup.pause:
        seq.lookup.pause -= 1
        return []
    return seq.lookup.draft(seq.prompt + seq.tokens, min(k, room))


def verify_logits(batcher, seq, ids: list[int]) -> torch.Tensor:
    """(T, V) fp32 logits of ``ids`` (the last token, then the draft) at positions seq.pos ..
    seq.pos + T - 1 of ``seq``'s slot, written into its cache: one forward pass
    (utils/generation/step.py ``decode_pass``, each token attending its slot causally)."""
    model, T, p0 = batcher.model, len(ids), seq.pos
    device, dtype = model.device, batcher.engine.dtype
    length = p0 + T
    cos_all, sin_all = model.rope(length, device)                           # outside inference mode: kept
    pack, head, n_weights = batcher.weights()
    packs = verify_layers(batcher.engine, pack)
    threads, chooser = batcher.engine.decode_threads(T, n_weights, "verify")
    with thread_policy.step_mode(threads):
        pos = torch.arange(p0, length, device=device)
        slots = torch.full((T,), seq.slot, dtype=torch.long, device=device)
        view = KVView(slice(seq.slot, seq.slot + 1), length,
                      cells(slots, pos, model.args.n_kv_heads, batcher.cache_len), pos)
        logits = decode_pass(model, packs, head, batcher.kv_flat, batcher.kv_shape, view,
                             torch.tensor(ids, device=device), cos_all, sin_all,
                             causal_bias(pos, length, dtype))              # (T, V)
        if chooser is not None:
            chooser.done()
        return logits


def _rows_mm(x: torch.Tensor, w: RowsProduct) -> torch.Tensor:
    return w(x)


def verify_layers(engine, pack) -> list:
    """The block weights of verify passes: for an fp32 decode pack (utils/generation/pack.py),
    oneDNN-packed copies of each block matrix (utils/generation/cpu.py ``RowsProduct``), made at
    the engine's first verify pass and kept with the pack: MKL's product of a few rows by the
    pack's transposed matrix costs 2.5x a row's (9 rows of SmolLM2's gate|up), the packed
    copy's about one row's, so a pass of k+1 tokens reads the weights about once. The cost:
    another copy of the block weights while the engine holds them. Otherwise the pack's own
    layers (int8: its row-by-row kernel; no pack: the model's Linear layers)."""
    kept = engine.verify_weights
    if kept is not None and kept[0] is pack:
        return kept[1]
    if pack is None:
        layers = [None] * len(engine.model.layers)
    elif pack.key == INT8 or not onednn_linear_available():
        layers = pack.layers
    else:
        cat = lambda *ms: torch.cat([m.weight for m in ms])  # noqa: E731
        layers = [PackedLayer(RowsProduct(cat(b.attn.wq, b.attn.wk, b.attn.wv)), RowsProduct(b.attn.wo.weight),
                              RowsProduct(cat(b.mlp.w_gate, b.mlp.w_up)), RowsProduct(b.mlp.w_down.weight), _rows_mm)
                  for b in engine.model.layers]
    engine.verify_weights = (pack, layers)
    return layers


def step(batcher, seq) -> Optional[list]:
    """One speculative decode step of ``seq``, the batch's only row: its events (one per
    accepted token and the first corrected one), or None when it has no draft this step (the
    caller makes a plain step)."""
    draft = draft_for(batcher, seq)
    if not draft:
        return None
    p0 = seq.pos
    logits = verify_logits(batcher, seq, [seq.tokens[-1]] + draft)
    events = []
    for i in range(len(draft) + 1):
        seq.pos = p0 + i + 1
        events += batcher._sample([seq], logits[i:i + 1])
        if seq.done or i == len(draft) or seq.tokens[-1] != draft[i]:
            break
    seq.lookup.verified(i)
    return events
