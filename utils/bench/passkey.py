"""Passkey retrieval: can the model repeat a number hidden in a long stretch of filler text?

The prompt is the landmark-attention format (Mohtashami & Jaggi, 2023), lines joined by "\\n":

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize
    them. I will quiz you about the important information there.
    <filler before the needle>
    The pass key is 71432. Remember it. 71432 is the pass key.
    <filler after the needle>
    What is the pass key? The pass key is

The filler is the five sentences "The grass is green. The sky is blue. The sun is yellow.
Here we go. There and back again." repeated, one sentence at a time, as many as fit; an
empty filler part is left out with its line. A cell of the grid is a context length L, in
tokens of the model's own tokenizer, and a needle depth d (0% = right after the
instructions, 100% = right before the question): the needle goes after round(n * d / 100)
of the n filler sentences, and n is the largest count for which the framed prompt (BOS
included where the model's contexts start with it) plus the answer budget (digits + 4 new
tokens) is at most L tokens. The key of sample i of cell (L, d) is a random number of
``digits`` digits (no leading zero) drawn from ``random.Random("passkey:seed:L:d:i")``, so
every model, run and machine gets the same keys. Greedy generation; the answer is the first
integer in the generated text (``first_integer``): right when it equals the key.

Lengths beyond a model's context (a standard model's ``max_seq_len``; Infini-attention
models have no limit) are not run and are reported as ``beyond_context``, never truncated;
lengths too short to hold the instructions, needle and question are ``too_short``.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Optional

from utils.bench import scoring as S

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
               "memorize them. I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
QUESTION = "What is the pass key? The pass key is"
DEPTHS = tuple(range(0, 101, 10))


def needle(key: int | str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def filler(start: int, stop: int) -> str:
    """Filler sentences ``start`` .. ``stop - 1`` of the endless cycle, joined by spaces."""
    return " ".join(FILLER[i % len(FILLER)] for i in range(start, stop))


def prompt_text(key: int | str, n_filler: int, depth: float) -> str:
    """The prompt with ``n_filler`` filler sentences and the needle at ``depth`` percent."""
    before = round(n_filler * depth / 100)
    parts = [INSTRUCTION, filler(0, before), needle(key), filler(before, n_filler), QUESTION]
    return "\n".join(p for p in parts if p)


def key_for(seed: int, length: int, depth: float, i: int, digits: int = 5) -> int:
    rng = random.Random(f"passkey:{seed}:{length}:{depth}:{i}")
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def first_integer(text: str) -> Optional[str]:
    """The first run of ASCII digits in ``text`` (the model's answer), or None."""
    m = re.search(r"[0-9]+", text)
    return m.group(0) if m else None


def fit(count: Callable[[str], int], key: int, depth: float, budget: int) -> Optional[tuple[str, int, int]]:
    """(prompt, filler sentences, prompt tokens) with the most filler whose ``count(prompt)``
    is at most ``budget`` tokens; None when even no filler does not fit."""
    def size(n):
        return count(prompt_text(key, n, depth))
    if size(0) > budget:
        return None
    lo, hi = 0, 1
    while size(hi) <= budget:                   # grow until too long
        lo, hi = hi, hi * 2
    while hi - lo > 1:                          # the last count that fits, in (lo, hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= budget else (lo, mid)
    text = prompt_text(key, lo, depth)
    return text, lo, count(text)


@dataclass(frozen=True)
class PasskeyPlan:
    """What to run: the grid, samples per cell, key digits, seed."""
    lengths: tuple
    depths: tuple = DEPTHS
    samples: int = 3
    digits: int = 5
    seed: int = 1234

    @property
    def new_tokens(self) -> int:
        """Tokens generated per prompt: the key's digits and room for a space, a piece
        tokenizers put before a number, and what follows it."""
        return self.digits + 4

    @property
    def size(self) -> int:
        """Samples in the whole grid."""
        return len(self.lengths) * len(self.depths) * self.samples

    def describe(self) -> str:
        return (f"{len(self.lengths)} lengths x {len(self.depths)} depths x {self.samples} samples, "
                f"{self.digits}-digit keys")


def run(ad, plan: PasskeyPlan, records: list, progress=None) -> dict:
    """The grid on one adapter (utils/bench/adapters.py: ``encode``, ``_framed``,
    ``generate_greedy``, ``tok``, ``max_length``, ``long_context``). Returns the task result:
    overall accuracy over the samples run, and the grid (rows: depths, columns: lengths;
    None where a length was not run, with its status)."""

    def count(text: str) -> int:
        return len(ad._framed(ad.encode([text])[0]))

    context = None if getattr(ad, "long_context", False) else ad.max_length
    acc = [[None] * len(plan.lengths) for _ in plan.depths]
    status, hits_all = {}, []
    cells = [(c, L, r, d) for c, L in enumerate(plan.lengths) for r, d in enumerate(plan.depths)]
    for c, L, r, d in cells:
        if r == 0:                                   # a new length: can it run at all?
            keys = [key_for(plan.seed, L, dd, i, plan.digits) for dd in plan.depths
                    for i in range(plan.samples)]
            status[str(L)] = ("beyond_context" if context is not None and L > context
                              else "too_short" if any(count(prompt_text(k, 0, 0)) + plan.new_tokens > L
                                                      for k in keys)
                              else "ok")
        if status[str(L)] != "ok":
            if progress is not None:
                progress.update(plan.samples)
            continue
        hits = []
        for i in range(plan.samples):
            key = key_for(plan.seed, L, d, i, plan.digits)
            text, n_filler, n_tokens = fit(count, key, d, L - plan.new_tokens)
            new = ad.generate_greedy(ad._framed(ad.encode([text])[0]), plan.new_tokens)
            answer = ad.tok.decode(new, skip_special_tokens=True)
            ok = first_integer(answer) == str(key)
            hits.append(float(ok))
            records.append({"task": "passkey", "length": L, "depth": d, "sample": i, "key": key,
                            "prompt_tokens": n_tokens, "filler_sentences": n_filler,
                            "generated": answer, "correct": ok})
            if progress is not None:
                progress.update(1)
        acc[r][c] = S.mean(hits)
        hits_all += hits
    return {"metrics": {"acc": {"value": S.mean(hits_all), "stderr": S.mean_stderr(hits_all)}},
            "grid": {"lengths": list(plan.lengths), "depths": list(plan.depths), "acc": acc,
                     "status": status},
            "samples_per_cell": plan.samples, "digits": plan.digits, "new_tokens": plan.new_tokens,
            "context": context, "samples_scored": len(hits_all)}

