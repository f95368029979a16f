"""Run the benchmark tasks on one adapter: batched, no gradients, a tqdm bar per task.

Tasks and their metrics (names are the keys of the results file):

=============  ==========================================================================
perplexity     perplexity (tokens), bits_per_byte (tokenizer-independent): rolling windows
next_token     top1 / top5 / top10: share of the perplexity passages' tokens whose true next
               token is among the model's k most likely (same forward passes as perplexity)
lambada        acc (the whole target is the greedy continuation), perplexity (exp of minus
               the mean target log-likelihood)
hellaswag      acc, acc_norm (log-likelihood / ending length in characters)
arc_easy       acc, acc_norm
arc_challenge  acc, acc_norm
completion     bleu (sacrebleu corpus BLEU), rouge1 / rouge2 / rougeL (rouge-score F1, x100):
               greedy continuations of held-out passages against the passages' next words
passkey        acc over the grid's samples, and the accuracy of each (context length, needle
               depth) cell: the key of a synthetic long prompt repeated (utils/bench/passkey.py)
piqa, boolq,   acc (and acc_norm where lm-eval reports it: piqa, openbookqa, social_iqa's
copa, ...      none): multiple choice as HellaSwag; winogrande: partial scoring (one context
               per option, the shared rest of the sentence scored); mmlu (lettered, A-D) and
               mmlu_cloze (the option texts); arithmetic: acc = the answer is the greedy
               continuation; triviaqa, nq_open: exact_match of greedy generations (tasks.py)
=============  ==========================================================================

A task key may carry a shot count, ``hellaswag:10`` (the CORE preset runs HellaSwag 0- and
10-shot): :func:`base_task` strips it.

Every task reports, per metric, its value and standard error, and its item counts: selected,
scored, and skipped by reason (plus what the data loader skipped in the whole file).
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Callable, Optional

from tqdm import tqdm

from utils.bench import passkey as P
from utils.bench import scoring as S
from utils.bench import tasks as T
from utils.bench.adapters import TOPK, Adapter

MC_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "boolq", "copa", "openbookqa",
            "commonsense_qa", "social_iqa", "mmlu", "mmlu_cloze")
GEN_TASKS = ("triviaqa", "nq_open")
EXTRA_TASKS = ("piqa", "winogrande", "boolq", "copa", "openbookqa", "commonsense_qa",
               "social_iqa", "mmlu", "mmlu_cloze", "arithmetic", "triviaqa", "nq_open")
ALL_TASKS = ("perplexity", "next_token", "lambada", "hellaswag", "arc_easy", "arc_challenge",
             "completion", "passkey", *EXTRA_TASKS)
# lm-eval reports acc_norm for these multiple-choice tasks (their YAMLs' metric_list)
ACC_NORM = {"hellaswag", "arc_easy", "arc_challenge", "piqa", "openbookqa", "mmlu_cloze"}
# Metrics per task, and whether higher is better.
METRICS: dict[str, list[tuple[str, bool]]] = {
    "perplexity": [("perplexity", False), ("bits_per_byte", False)],
    "next_token": [("top1", True), ("top5", True), ("top10", True)],
    "lambada": [("acc", True), ("perplexity", False)],
    "hellaswag": [("acc", True), ("acc_norm", True)],
    "arc_easy": [("acc", True), ("acc_norm", True)],
    "arc_challenge": [("acc", True), ("acc_norm", True)],
    "completion": [("bleu", True), ("rouge1", True), ("rouge2", True), ("rougeL", True)],
    "passkey": [("acc", True)],
    **{t: [("acc", True), ("acc_norm", True)] if t in ACC_NORM else [("acc", True)]
       for t in EXTRA_TASKS if t not in GEN_TASKS},
    **{t: [("exact_match", True)] for t in GEN_TASKS},
    "core": [("core", True)],
}


def base_task(key: str) -> str:
    """``hellaswag:10`` -> ``hellaswag`` (a task key with its shot count)."""
    return key.split(":", 1)[0]
COMPLETION_MAX_NEW_TOKENS = 64


def _bar(total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="seq", dynamic_ncols=True, mininterval=0.5,
                file=sys.stderr, leave=False)


def _metric(value, stderr=None) -> dict:
    return {"value": value, "stderr": stderr}


def _counts(selected: int, scored: int, skipped: Counter, data_skipped: Counter) -> dict:
    return {"selected": selected, "scored": scored, "skipped": dict(skipped),
            "skipped_in_data": dict(data_skipped)}


def run_perplexity(ad: Adapter, items: list, batch_size: int, desc: str, records: list):
    """Returns (perplexity task result, next_token task result)."""
    skipped: Counter = Counter()
    seqs, ns, owner, kept = [], [], [], []
    encoded = ad.encode([it.text for it in items])
    for it, ids in zip(items, encoded):
        if not ids:
            skipped["encodes_to_nothing"] += 1
            continue
        k = len(kept)
        kept.append((it, ids))
        for window, n_pred in S.rolling_windows(ids, ad.prefix_token_id, ad.max_length):
            seqs.append(window)
            ns.append(n_pred)
            owner.append(k)
    with _bar(len(seqs), desc) as bar:
        scores = ad.score(seqs, ns, batch_size, bar)
    nll = [0.0] * len(kept)
    hits = [{k: 0 for k in TOPK} for _ in kept]
    for o, sc in zip(owner, scores):
        nll[o] -= sc.ll
        for k in TOPK:
            hits[o][k] += sc.topk[k]
    ntok = [len(ids) for _, ids in kept]
    nbytes = [len(it.text.encode("utf-8")) for it, _ in kept]
    m = S.text_metrics(nll, ntok, nbytes)
    for (it, _), a, t, b, h in zip(kept, nll, ntok, nbytes, hits):
        records.append({"task": "perplexity", "id": it.id, "nll": a, "tokens": t, "bytes": b,
                        **{f"top{k}_hits": h[k] for k in TOPK}})
    ppl = {"metrics": {"perplexity": _metric(m["perplexity"], m["perplexity_stderr"]),
                       "bits_per_byte": _metric(m["bits_per_byte"], m["bits_per_byte_stderr"])},
           "tokens": m["tokens"], "bytes": m["bytes"]}
    total = sum(ntok)
    nxt = {"metrics": {f"top{k}": _metric(S.topk_accuracy([h[k] for h in hits], total),
                                          S.ratio_stderr([h[k] for h in hits], ntok))
                       for k in TOPK},
           "tokens": total}
    return ppl, nxt, skipped, len(kept)


def _pairs_or_skip(ad: Adapter, pairs: list[tuple[str, str]]) -> Optional[list]:
    """Encode (context, continuation) pairs; None when a continuation encodes to no token."""
    out = []
    for ctx, cont in pairs:
        c, t = ad.encode_pair(ctx, cont)
        if not t:
            return None
        out.append((c, t))
    return out


def requests_of(it) -> list[tuple[str, str]]:
    """The (context, continuation) pairs lm-eval scores for one item."""
    if isinstance(it, T.PartialItem):
        return [(ctx, it.continuation) for ctx in it.contexts]
    if isinstance(it, T.MCItem):
        return [(it.context, T.TARGET_DELIMITER + ch) for ch in it.choices]
    if isinstance(it, T.GreedyItem):
        return [(it.context, it.target)]
    return [(it.context, it.target)]          # LAMBADA


def run_loglikelihood_task(task: str, ad: Adapter, items: list, batch_size: int, desc: str,
                           records: list):
    skipped: Counter = Counter()
    seqs, ns, spans, kept = [], [], [], []
    key, task = task, base_task(task)
    for it in items:
        pairs = requests_of(it)
        enc = _pairs_or_skip(ad, pairs)
        if enc is None:
            skipped["continuation_encodes_to_nothing"] += 1
            continue
        spans.append((len(seqs), len(enc)))
        kept.append(it)
        for c, t in enc:
            seqs.append(c + t)
            ns.append(len(t))
    with _bar(len(seqs), desc) as bar:
        scores = ad.score(seqs, ns, batch_size, bar)
    result: dict = {"metrics": {}}
    if task == "lambada":
        lls, acc = [], []
        for it, (start, _) in zip(kept, spans):
            sc = scores[start]
            lls.append(sc.ll)
            acc.append(float(sc.greedy))
            records.append({"task": task, "id": it.id, "ll": sc.ll, "is_greedy": sc.greedy,
                            "target_tokens": sc.n})
        result["metrics"] = {"acc": _metric(S.mean(acc), S.mean_stderr(acc)),
                             "perplexity": _metric(S.lambada_perplexity(lls),
                                                   S.lambada_perplexity_stderr(lls))}
    elif task == "arithmetic":
        acc = []
        for it, (start, _) in zip(kept, spans):
            sc = scores[start]
            acc.append(float(sc.greedy))
            records.append({"task": key, "id": it.id, "ll": sc.ll, "is_greedy": sc.greedy})
        result["metrics"] = {"acc": _metric(S.mean(acc), S.mean_stderr(acc))}
    else:
        acc, acc_norm = [], []
        for it, (start, n) in zip(kept, spans):
            lls = [scores[start + j].ll for j in range(n)]
            # Winogrande: lm-eval's acc_norm would divide by the contexts' lengths; it reports acc only
            r = S.multiple_choice(lls, getattr(it, "choices", None) or it.contexts, it.gold)
            acc.append(r["acc"])
            acc_norm.append(r["acc_norm"])
            records.append({"task": key, "id": it.id, "gold": it.gold, "pred": r["pred"],
                            "pred_norm": r["pred_norm"], "lls": lls})
        result["metrics"] = {"acc": _metric(S.mean(acc), S.mean_stderr(acc))}
        if task in ACC_NORM:
            result["metrics"]["acc_norm"] = _metric(S.mean(acc_norm), S.mean_stderr(acc_norm))
    return result, skipped, len(kept)


def run_generation(task: str, ad: Adapter, items: list, batch_size: int, desc: str, records: list):
    """TriviaQA / NQ-open: greedy text up to lm-eval's stop strings (at most
    ``T.GEN_MAX_TOKENS`` tokens), exact match against any target after the task's
    normalisation (tasks.exact_match; NQ-open also drops English articles)."""
    key, task = task, base_task(task)
    regexes = (T.NQ_ARTICLES,) if task == "nq_open" else ()
    skipped: Counter = Counter()
    em: list[float] = []
    kept = []
    with _bar(len(items), desc) as bar:
        for b in range(0, len(items), batch_size):
            chunk = items[b:b + batch_size]
            prompts = [ad._framed(ids) for ids in ad.encode([it.context for it in chunk])]
            texts = ad.generate_until(prompts, T.GEN_MAX_TOKENS, T.GEN_UNTIL)
            for it, text in zip(chunk, texts):
                answer = T.cut_at_stops(text)
                em.append(T.exact_match(answer, it.targets, regexes))
                kept.append(it)
                records.append({"task": key, "id": it.id, "generated": answer,
                                "targets": it.targets, "exact_match": em[-1]})
            bar.update(len(chunk))
    result = {"metrics": {"exact_match": _metric(S.mean(em), S.mean_stderr(em))},
              "max_new_tokens": T.GEN_MAX_TOKENS, "until": list(T.GEN_UNTIL)}
    return result, skipped, len(kept)


def run_completion(ad: Adapter, items: list, desc: str, records: list):
    # optional for the stage: only this task needs them, and benchmark.py refuses it, naming
    # them, when they are not installed
    import sacrebleu
    from rouge_score import rouge_scorer

    skipped: Counter = Counter()
    hyps, refs, kept = [], [], []
    with _bar(len(items), desc) as bar:
        for it in items:
            prompt = ad._framed(ad.encode([it.prompt])[0])
            new = ad.generate_greedy(prompt, COMPLETION_MAX_NEW_TOKENS)
            text = ad.tok.decode(new, skip_special_tokens=True)
            n_ref = len(it.reference.split())
            hyps.append(T.truncate_words(text, n_ref))
            refs.append(it.reference)
            kept.append(it)
            bar.update(1)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    rouge: dict[str, list] = {k: [] for k in ("rouge1", "rouge2", "rougeL")}
    sent: list[float] = []
    for it, h, r in zip(kept, hyps, refs):
        sc = scorer.score(r, h)
        for k in rouge:
            rouge[k].append(100.0 * sc[k].fmeasure)
        sent.append(sacrebleu.sentence_bleu(h, [r]).score)
        records.append({"task": "completion", "id": it.id, "prompt": it.prompt, "reference": r,
                        "generated": h, "sentence_bleu": sent[-1],
                        **{k: rouge[k][-1] for k in rouge}})
    metric = sacrebleu.metrics.BLEU()
    bleu = metric.corpus_score(hyps, [refs]).score if kept else None
    result = {"metrics": {"bleu": _metric(bleu, S.mean_stderr(sent)),
                          **{k: _metric(S.mean(v), S.mean_stderr(v)) for k, v in rouge.items()}},
              "bleu_signature": str(metric.get_signature()) if kept else None,
              "max_new_tokens": COMPLETION_MAX_NEW_TOKENS}
    return result, skipped, len(kept)


def run_passkey(ad: Adapter, plan: P.PasskeyPlan, desc: str, records: list):
    """The passkey grid (``selected["passkey"]`` is ``[plan]``); skipped: the samples of
    lengths beyond the model's context or too short for the prompt."""
    with _bar(plan.size, desc) as bar:
        res = P.run(ad, plan, records, bar)
    per_length = len(plan.depths) * plan.samples
    skipped = Counter({why: per_length * list(res["grid"]["status"].values()).count(why)
                       for why in ("beyond_context", "too_short")})
    return res, +skipped, res["samples_scored"]


def run_all(ad: Adapter, selected: dict, loaded: dict, batch_size: int,
            log: Callable[[str], None] = print) -> tuple[dict, list]:
    """Run every selected task on one adapter. ``selected[task]`` is the list of items,
    ``loaded[task]`` the TaskData they came from. Returns (results per task, per-item records)."""
    results: dict = {}
    records: list = []
    for task, items in selected.items():
        desc = f"{ad.name[:24]} {task}"
        data = loaded[base_task(task)]
        if task in ("perplexity", "next_token"):
            if "perplexity" in results or "next_token" in results:
                continue       # one pass serves both
            ppl, nxt, skipped, scored = run_perplexity(ad, items, batch_size, desc, records)
            for name, res in (("perplexity", ppl), ("next_token", nxt)):
                if name in selected:
                    res["items"] = _counts(len(items), scored, skipped, data.skipped)
                    res["source"], res["note"] = data.source, data.note
                    results[name] = res
            continue
        if task == "completion":
            res, skipped, scored = run_completion(ad, items, desc, records)
        elif task == "passkey":
            res, skipped, scored = run_passkey(ad, items[0], desc, records)
        elif base_task(task) in GEN_TASKS:
            res, skipped, scored = run_generation(task, ad, items, batch_size, desc, records)
        else:
            res, skipped, scored = run_loglikelihood_task(task, ad, items, batch_size, desc, records)
        planned = items[0].size if task == "passkey" else len(items)
        res["items"] = _counts(planned, scored, skipped, data.skipped)
        res["source"], res["note"] = data.source, data.note
        results[task] = res
        shown = ", ".join(f"{k} {_fmt(v['value'])}" for k, v in res["metrics"].items())
        log(f"  {ad.name}: {task}: {shown}  ({scored} items)")
    for name in ("perplexity", "next_token"):
        if name in results:
            shown = ", ".join(f"{k} {_fmt(v['value'])}" for k, v in results[name]["metrics"].items())
            log(f"  {ad.name}: {name}: {shown}")
    for rec in records:
        rec["model"] = ad.name
    return results, records


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"
