"""RL tasks: prompts with a held-out split and a verifier that scores a reply (library; nothing
runs on import).

    task = load_task(cfg.rl, seed)                 "arithmetic", or a JSONL file of {prompt, answer}
    task.split("train") / task.split("val")        [Item(prompt, answer)], disjoint, deterministic
    task.reward(reply, item) -> float              1.0 when the verifier accepts the reply, else 0.0

A task is a small class: a :class:`Task` subclass gives its items and, if it wants another
verifier than exact or numeric match, overrides :meth:`Task.reward`; registered in
:data:`TASKS` under a name (``@register("name")``), it is chosen with ``rl.task: "name"``.

Verifiers (the ``rl.checker`` key; "auto": the task's own):

- ``exact``: the reply equals the answer after both are normalized (case folded, whitespace
  collapsed, surrounding whitespace, quotes and a final period dropped). A reply that adds any
  words is wrong: for tasks whose model is taught to answer with the answer alone.
- ``numeric``: the last number in the reply equals the answer's number (to 1e-6 relative), so
  "7 + 5 = 12." and "The answer is 12" both count; the last, not the first, because replies
  restate the question's numbers before they answer (GSM8K-style extraction).

Splits are fixed by ``rl.seed`` and the task's own data, never by the run: a resumed run, a
second run and the study see the same held-out prompts, and no held-out prompt is trained on.
The synthetic task ("arithmetic": "What is a + b?") enumerates every pair of operands up to
``rl.max_operand`` once, shuffles them with the seed and cuts the held-out split off the
front, so the two splits cannot share a question.
"""
from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from utils.cli import PipelineError

CHECKERS = ("exact", "numeric")
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
MAX_PROBLEMS_SHOWN = 10


@dataclass(frozen=True)
class Item:
    prompt: str
    answer: str


# --------------------------------------------------------------------------- verifiers
def normalize(text: str) -> str:
    """What exact match compares: case folded, whitespace collapsed, quotes and a final period off."""
    t = " ".join(str(text).split()).casefold().strip().strip("\"'`").strip()
    return t[:-1].rstrip() if t.endswith(".") else t


def exact_match(reply: str, answer: str) -> bool:
    return normalize(reply) == normalize(answer)


def parse_number(text: str) -> Optional[float]:
    """The number a whole string is ("1,234", "-3.5", "12."), or None."""
    t = str(text).strip().rstrip(".")
    if not NUMBER.fullmatch(t):
        return None
    try:
        return float(t.replace(",", ""))
    except ValueError:
        return None


def last_number(reply: str) -> Optional[float]:
    """The last number written in ``reply``, or None."""
    for m in reversed(NUMBER.findall(str(reply))):
        value = parse_number(m)
        if value is not None:
            return value
    return None


def numeric_match(reply: str, answer: str) -> bool:
    want, got = parse_number(answer), last_number(reply)
    if want is None or got is None:
        return False
    return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)


VERIFIERS: dict[str, Callable[[str, str], bool]] = {"exact": exact_match, "numeric": numeric_match}


# --------------------------------------------------------------------------- tasks
class Task:
    """Items in two disjoint splits and a verifier (see the module docstring)."""
    name = "task"
    default_checker = "exact"

    def __init__(self, train: list[Item], val: list[Item], checker: str = "auto", source: str = ""):
        if checker not in ("auto", *CHECKERS):
            raise PipelineError(f"rl.checker: {checker!r} is not one of auto, {', '.join(CHECKERS)}.")
        self.checker = self.default_checker if checker == "auto" else checker
        self.train, self.val, self.source = list(train), list(val), source

    def split(self, which: str) -> list[Item]:
        return {"train": self.train, "val": self.val}[which]

    def reward(self, reply: str, item: Item) -> float:
        return 1.0 if VERIFIERS[self.checker](reply, item.answer) else 0.0

    def describe(self) -> dict:
        """What the run records about its task (rl_config.json, the report)."""
        return {"name": self.name, "source": self.source, "checker": self.checker,
                "train_prompts": len(self.train), "val_prompts": len(self.val),
                "example": {"prompt": self.train[0].prompt, "answer": self.train[0].answer}
                if self.train else None}


TASKS: dict[str, type] = {}


def register(name: str):
    """Class decorator: ``@register("mytask")`` makes ``rl.task: "mytask"`` build that class
    with ``cls.build(rl_cfg, seed)``."""
    def add(cls):
        cls.name = name
        TASKS[name] = cls
        return cls
    return add


@register("arithmetic")
class Arithmetic(Task):
    """'What is a + b?' for every pair 0 <= a <= ``max_operand``, 0 <= b <= ``max_addend``
    (default: max_operand); the answer is the sum."""
    default_checker = "numeric"
    PROMPT = "What is {a} + {b}? Answer with the number only."

    @classmethod
    def build(cls, rl_cfg, seed: int) -> "Arithmetic":
        n = rl_cfg.max_operand
        m = n if getattr(rl_cfg, "max_addend", None) is None else rl_cfg.max_addend
        items = [Item(cls.PROMPT.format(a=a, b=b), str(a + b)) for a in range(n + 1) for b in range(m + 1)]
        random.Random(seed).shuffle(items)
        held = held_out_count(len(items), rl_cfg.val_prompts, "rl.max_operand")
        return cls(items[held:], items[:held], rl_cfg.checker,
                   f"synthetic: a + b for 0 <= a <= {n}, 0 <= b <= {m} ({len(items)} questions), seed {seed}")


def held_out_count(n: int, wanted: int, what: str) -> int:
    """``wanted`` held-out items of ``n``, leaving at least one to train on."""
    if n < 2:
        raise PipelineError(f"the task has {n} item(s): at least 2 are needed (one to train on, one "
                            f"held out); raise {what}.")
    return max(1, min(wanted, n - 1))


class JsonlTask(Task):
    """A user's task: one JSON object ``{"prompt": str, "answer": str or number}`` per line.
    Checker "auto": numeric when every answer is a number, else exact."""
    name = "jsonl"

    @classmethod
    def build(cls, rl_cfg, seed: int, path: Path) -> "JsonlTask":
        items = read_jsonl_items(path)
        numeric = all(parse_number(i.answer) is not None for i in items)
        order = list(range(len(items)))
        random.Random(seed).shuffle(order)
        held = held_out_count(len(items), rl_cfg.val_prompts, f"the lines of {path}")
        task = cls([items[i] for i in order[held:]], [items[i] for i in order[:held]],
                   rl_cfg.checker if rl_cfg.checker != "auto" else ("numeric" if numeric else "exact"),
                   f"{path} ({len(items)} items), seed {seed}")
        return task


def read_jsonl_items(path: Path) -> list[Item]:
    """Every line's item; any malformed line is a PipelineError naming ``file:line`` and why
    (all of them, the first few shown): a task is not trained on part of what the user wrote."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PipelineError(f"rl.task: cannot read {path}: {e}") from None
    items, problems = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        item, why = _item_of(line)
        if why:
            problems.append(f"{path}:{n}: {why}")
        else:
            items.append(item)
    if problems:
        more = f"\n  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more" if len(problems) > MAX_PROBLEMS_SHOWN else ""
        raise PipelineError(f"{len(problems)} malformed line(s) in the RL task file; each line must be a "
                            "JSON object {\"prompt\": text, \"answer\": text or number}:\n  "
                            + "\n  ".join(problems[:MAX_PROBLEMS_SHOWN]) + more)
    if not items:
        raise PipelineError(f"{path}: no items; write one JSON object {{\"prompt\", \"answer\"}} per line.")
    return items


def _item_of(line: str) -> tuple[Optional[Item], Optional[str]]:
    try:
        rec = json.loads(line)
    except ValueError as e:
        return None, f"not JSON ({e})"
    if not isinstance(rec, dict):
        return None, f"a JSON {type(rec).__name__}, not an object"
    prompt, answer = rec.get("prompt"), rec.get("answer")
    if not isinstance(prompt, str) or not prompt.strip():
        return None, "no \"prompt\" text"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        return None, "no \"answer\" (text or number)"
    return Item(prompt, answer if isinstance(answer, str) else json.dumps(answer)), None


def load_task(rl_cfg, seed: int, resolve: Callable[[str], Path]) -> Task:
    """The task ``rl.task`` names: a registered name, else a JSONL file (``resolve``: the
    config's path rule)."""
    spec = rl_cfg.task
    if spec in TASKS:
        return TASKS[spec].build(rl_cfg, seed)
    path = resolve(spec)
    if path.suffix.lower() in (".jsonl", ".json") or path.exists():
        if not path.is_file():
            raise PipelineError(f"rl.task: {path} is not a file; give a JSONL file of "
                                f"{{prompt, answer}} or one of: {', '.join(sorted(TASKS))}.")
        return JsonlTask.build(rl_cfg, seed, path)
    raise PipelineError(f"rl.task: {spec!r} is neither a task ({', '.join(sorted(TASKS))}) nor a "
                        "JSONL file that exists.")
