"""CORE-style aggregate (DCLM's CORE, as nanochat ranks base models) over the tasks we have.

DCLM's CORE is the mean over 22 in-context-learning tasks of each task's accuracy centered on
its random baseline: ``(acc - b) / (1 - b)`` (0 = chance, 1 = perfect). :data:`CORE_TASKS`
lists the 22 with DCLM's shot counts and random baselines, copied from:

- shots: mlfoundations/dclm ``eval/mmlu_and_lowvar.yaml`` (commit 361714bdd60b, 2025-09-08;
  the CORE tasks are its ``icl_tasks`` after ``mmlu_fewshot``);
- baselines: DCLM's original table, ``eval/eval_meta_data.csv`` as of its first commit
  c7ed275feacc (2024-06-17), kept as ``eval/eval_meta_data_v1.csv`` at 361714bdd60b, and
  identical for these 22 rows to the ``eval_meta_data.csv`` of nanochat's eval bundle (as
  committed in Milpo1/nanochat-pl ``eval_bundle/eval_meta_data.csv``, commit 0acdfa053442).
  nanochat's leaderboard bar, GPT-2 XL's CORE 0.256525 (karpathy/nanochat README.md and
  dev/LEADERBOARD.md, commit 92d63d4e8bb4), is computed with nanochat's bundle. DCLM
  revised three of them in Sept 2025 ("CORE v2", its ``eval_meta_data.csv`` at
  361714bdd60b): commonsense_qa 20 -> 40.3 (the majority answer of
  the gauntlet's 4-option lettered copy, whose gold is "C" 40.3% of the time),
  agi_eval_lsat_ar 20 -> 25, bigbench_language_identification 9.1 -> 25. We keep v1: it is
  nanochat's, and our commonsense_qa is lm-eval's five-option form, whose chance is 0.20.

Eleven tasks have data here (offline samples or their hub datasets): those are scored with
this project's lm-evaluation-harness rules at CORE's shot counts; the other eleven
(Jeopardy, BIG-bench, AGIEval LSAT-AR, Winograd, SQuAD, CoQA) are named as missing. The mean
over a subset is NOT comparable with a published CORE unless all 22 are present, and even
then our prompts are lm-eval's, not DCLM's ICL formats (docs/benchmark.md lists the
differences per task), and a choice is picked by lm-eval's acc / acc_norm, not by the mean
per-token loss DCLM's evaluator uses: the per-task values can differ by a few points.

Standard error of the mean of centered accuracies over n tasks: sqrt(sum_i se_i^2) / n with
se_i = stderr(acc_i) / (1 - b_i) (tasks treated as independent). Pure functions; no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class CoreTask:
    name: str                 # DCLM's task name
    shots: int                # DCLM num_fewshot (eval/mmlu_and_lowvar.yaml)
    baseline: float           # random baseline, 0-1 (DCLM eval_meta_data.csv v1, nanochat's)
    task: Optional[str]       # our task, None when we have no data for it
    metric: str = "acc"       # our metric standing for DCLM's accuracy

    @property
    def key(self) -> Optional[str]:
        """Our result key: the task, with ``:shots`` when not 0-shot (benchmark.py task keys)."""
        if self.task is None:
            return None
        return self.task if self.shots == 0 else f"{self.task}:{self.shots}"


CORE_TASKS: tuple[CoreTask, ...] = (
    CoreTask("hellaswag_zeroshot", 0, 0.25, "hellaswag", "acc_norm"),
    CoreTask("jeopardy", 10, 0.0, None),
    CoreTask("bigbench_qa_wikidata", 10, 0.0, None),
    CoreTask("arc_easy", 10, 0.25, "arc_easy", "acc_norm"),
    CoreTask("arc_challenge", 10, 0.25, "arc_challenge", "acc_norm"),
    CoreTask("copa", 0, 0.5, "copa"),
    CoreTask("commonsense_qa", 10, 0.20, "commonsense_qa"),
    CoreTask("piqa", 10, 0.5, "piqa", "acc_norm"),
    CoreTask("openbook_qa", 0, 0.25, "openbookqa", "acc_norm"),
    CoreTask("lambada_openai", 0, 0.0, "lambada"),
    CoreTask("hellaswag", 10, 0.25, "hellaswag", "acc_norm"),
    CoreTask("winograd", 0, 0.5, None),
    CoreTask("winogrande", 0, 0.5, "winogrande"),
    CoreTask("bigbench_dyck_languages", 10, 0.0, None),
    CoreTask("agi_eval_lsat_ar", 3, 0.20, None),
    CoreTask("bigbench_cs_algorithms", 10, 0.0, None),
    CoreTask("bigbench_operators", 10, 0.0, None),
    CoreTask("bigbench_repeat_copy_logic", 10, 0.0, None),
    CoreTask("squad", 10, 0.0, None),
    CoreTask("coqa", 0, 0.0, None),
    CoreTask("boolq", 10, 0.62, "boolq"),
    CoreTask("bigbench_language_identification", 10, 0.091, None),
)
GPT2_CORE = 0.2565          # nanochat's leaderboard bar: GPT-2 XL (1.6B), 0.256525


def included() -> list[CoreTask]:
    return [t for t in CORE_TASKS if t.task is not None]


def missing() -> list[CoreTask]:
    return [t for t in CORE_TASKS if t.task is None]


def entries() -> list[tuple[str, int]]:
    """(our task, shots) of every included CORE task, in CORE's order."""
    return [(t.task, t.shots) for t in included()]  # type: ignore[misc]


def centered(acc: float, baseline: float) -> float:
    return (acc - baseline) / (1.0 - baseline)


def core_score(results: dict) -> Optional[dict]:
    """The CORE-style aggregate of one model's results (``results[key]["metrics"][metric]``):
    value, stderr, and per task its accuracy, baseline and centered accuracy. None when no
    CORE task was scored."""
    rows, errs = [], []
    for t in included():
        m = results.get(t.key, {}).get("metrics", {}).get(t.metric)
        if not m or m.get("value") is None:
            continue
        c = centered(m["value"], t.baseline)
        se = None if m.get("stderr") is None else m["stderr"] / (1.0 - t.baseline)
        rows.append({"core_task": t.name, "key": t.key, "metric": t.metric, "shots": t.shots,
                     "accuracy": m["value"], "random_baseline": t.baseline, "centered": c,
                     "centered_stderr": se})
        errs.append(se)
    if not rows:
        return None
    n = len(rows)
    value = sum(r["centered"] for r in rows) / n
    stderr = (math.sqrt(sum(e * e for e in errs)) / n) if all(e is not None for e in errs) else None
    return {"value": value, "stderr": stderr, "tasks": rows, "included": n, "of": len(CORE_TASKS)}


def coverage_note(n_scored: int) -> str:
    """What the aggregate covers, said with every CORE-style score."""
    miss = ", ".join(t.name for t in missing())
    return (f"CORE-style: centered mean over {n_scored} of DCLM's {len(CORE_TASKS)} CORE tasks "
            f"(missing here: {miss}); not comparable with a full CORE score (GPT-2 XL: "
            f"{GPT2_CORE}) unless all {len(CORE_TASKS)} are included; prompts and choice rule "
            "are lm-eval's (docs/benchmark.md)")
