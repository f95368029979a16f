"""Pure scoring functions, with lm-evaluation-harness's definitions (no model, no torch).

- Multiple choice (HellaSwag, ARC): ``acc`` = argmax of the continuation log-likelihoods is
  the gold choice; ``acc_norm`` = argmax of log-likelihood / len(choice in characters). Ties go
  to the first choice (``np.argmax``), as in lm-eval.
- LAMBADA: ``acc`` = the whole target is the greedy continuation; perplexity =
  exp(-mean over items of the target's log-likelihood) (lm-eval's ``perplexity`` aggregation).
- Text perplexity = exp(total NLL / total predicted tokens); bits per byte = total NLL /
  (ln 2 * total UTF-8 bytes), which does not depend on the tokenizer.
- Standard errors: a mean's is the sample standard deviation / sqrt(n) (lm-eval's
  ``mean_stderr``); a perplexity's comes from the delta method (lm-eval bootstraps; the delta
  method gives the same first-order value deterministically and at no cost). With fewer than
  two items a standard error is ``None``, never NaN.
- Rolling windows for long texts follow lm-eval's ``get_rolling_token_windows`` with
  context_len=1: every token is predicted exactly once, the first from a prefix token.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

LN2 = math.log(2.0)


def argmax_first(values: Sequence[float]) -> int:
    """Index of the largest value; the first one on ties (np.argmax semantics)."""
    return int(np.argmax(np.asarray(values, dtype=np.float64)))


def multiple_choice(lls: Sequence[float], choices: Sequence[str], gold: int) -> dict:
    """Per-item acc / acc_norm from the choices' continuation log-likelihoods."""
    if len(lls) != len(choices) or not choices:
        raise ValueError("one log-likelihood per choice is required")
    lens = np.array([float(len(c)) for c in choices])
    if (lens <= 0).any():
        raise ValueError("empty choice: character-length normalization needs non-empty choices")
    lls_arr = np.asarray(lls, dtype=np.float64)
    pred = argmax_first(lls_arr)
    pred_norm = argmax_first(lls_arr / lens)
    return {"pred": pred, "pred_norm": pred_norm, "acc": float(pred == gold),
            "acc_norm": float(pred_norm == gold)}


def mean(values: Sequence[float]) -> Optional[float]:
    return float(np.mean(values)) if len(values) else None


def mean_stderr(values: Sequence[float]) -> Optional[float]:
    """Sample standard deviation / sqrt(n); None below two values."""
    n = len(values)
    if n < 2:
        return None
    return float(np.std(np.asarray(values, dtype=np.float64), ddof=1) / math.sqrt(n))


def lambada_perplexity(lls: Sequence[float]) -> Optional[float]:
    """lm-eval's perplexity aggregation: exp(-mean(loglikelihood))."""
    if not len(lls):
        return None
    return float(math.exp(-float(np.mean(lls))))


def lambada_perplexity_stderr(lls: Sequence[float]) -> Optional[float]:
    """Delta method: d exp(m)/dm * stderr(m)."""
    ppl, se = lambada_perplexity(lls), mean_stderr([-x for x in lls])
    return None if ppl is None or se is None else float(ppl * se)


def ratio_stderr(num: Sequence[float], den: Sequence[float]) -> Optional[float]:
    """Standard error of sum(num)/sum(den) over items (delta method for a ratio estimator)."""
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    n = len(a)
    if n < 2 or b.sum() <= 0:
        return None
    r = a.sum() / b.sum()
    resid = a - r * b
    return float(math.sqrt((resid ** 2).sum() / (n * (n - 1))) / b.mean())


def perplexity(total_nll: float, n_tokens: int) -> Optional[float]:
    if n_tokens <= 0:
        return None
    return float(math.exp(total_nll / n_tokens))


def bits_per_byte(total_nll: float, n_bytes: int) -> Optional[float]:
    if n_bytes <= 0:
        return None
    return float(total_nll / n_bytes / LN2)


def text_metrics(nlls: Sequence[float], tokens: Sequence[int], nbytes: Sequence[int]) -> dict:
    """Corpus perplexity and bits per byte over passages, with delta-method standard errors."""
    total_nll, total_tok, total_bytes = float(np.sum(nlls)), int(np.sum(tokens)), int(np.sum(nbytes))
    ppl = perplexity(total_nll, total_tok)
    se_tok = ratio_stderr(nlls, tokens)
    se_byte = ratio_stderr(nlls, nbytes)
    return {
        "perplexity": ppl,
        "perplexity_stderr": None if ppl is None or se_tok is None else ppl * se_tok,
        "bits_per_byte": bits_per_byte(total_nll, total_bytes),
        "bits_per_byte_stderr": None if se_byte is None else se_byte / LN2,
        "tokens": total_tok, "bytes": total_bytes,
    }


def topk_accuracy(hits: Sequence[int], n: int) -> Optional[float]:
    return float(np.sum(hits) / n) if n > 0 else None


def rolling_windows(tokens: Sequence[int], prefix_id: int, max_len: int) -> list[tuple[list[int], int]]:
    """Windows ``(ids, n_pred)`` covering ``tokens``: feed ``ids[:-1]``, score the last
    ``n_pred`` targets of ``ids[1:]``. Each window's input is at most ``max_len`` tokens; every
    token is predicted once; the first window starts from ``prefix_id`` (lm-eval's rolling
    log-likelihood with context_len=1 and disjoint windows)."""
    if max_len < 1:
        raise ValueError("max_len must be >= 1")
    toks = list(tokens)
    out: list[tuple[list[int], int]] = []
    if not toks:
        return out
    first = min(max_len, len(toks))
    out.append(([prefix_id] + toks[:first], first))
    predicted = first
    while predicted < len(toks):
        n_pred = min(len(toks) - predicted, max_len)
        end = predicted + n_pred
        start = max(0, end - max_len - 1)
        out.append((toks[start:end], n_pred))
        predicted = end
    return out
