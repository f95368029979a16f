"""Instruction (SFT) data: records -> chat-formatted token ids with a loss mask, on disk, and
back as resumable training batches (library; nothing runs on import).

Contract (docs/DESIGN.md sections 3 and 7; docs/sft_inference.md):

- A *record* is LIMA's schema: ``{"conversations": [user, assistant, user, assistant, ...],
  "source": ...}``. :func:`read_jsonl_records` reads a local JSONL file into records and
  reports every malformed line as ``file:line: reason`` (:class:`Skips`); unambiguous
  repairs (UTF-8 BOM, CRLF line ends, ShareGPT-style ``{"from"/"role", "value"/"content"}``
  turns, a JSON array saved as ``.jsonl``, lone surrogates from ``"\\ud800"`` escapes read as
  U+FFFD) are applied and counted as notes. A record in the conversational shape transformers
  and TRL use (``{"messages": [...], "tools": [...]}``, tool use: utils/data/tools.py) is read as
  ``{"messages", "tools", "source"}``; :func:`encode_exchanges` frames it (exchanges that open
  with a user turn or with tool results; the loss on the assistant's calls and answers only).
- The chat template is data (:func:`default_template` from the ``sft`` config section),
  stored in ``metadata.json`` and in SFT checkpoints. Each exchange is ONE text,
  ``BOS + "User: {q}\\nAssistant: {answer}" + EOS``, encoded in one piece; a conversation is
  its exchanges back to back. A prompt (:func:`prompt_text`) ends at the assistant prefix
  without its trailing whitespace (``"...\\nAssistant:"``); that whitespace (the *lead*,
  :func:`answer_lead`) is the start of the answer, which the model generates and the reply
  text drops again (:func:`answer_decoding`). :func:`encode_conversations` (training) and
  :func:`encode_prompt` (infer, serve, SFT's sample) frame the same texts the same way, and
  training keeps only exchanges whose ids begin with exactly the prompt's own ids, so
  inference prompts are exactly what training saw (that check encodes each prompt a second
  time, which costs tokenizer time over template v1). One-text exchanges are what a Hugging
  Face / llama.cpp chat template renders and tokenizes (utils/hf/chat.py), so exports give
  these ids token for token. Text is encoded with ``utils.data.tok.encode_plain``
  semantics: a literal ``<s>`` / ``</s>`` typed in a turn is ordinary text, never a control id.
- Template ``user-assistant-v1`` (SFT data format 1; checkpoints trained before format 2)
  encoded the prompt (ending with the assistant prefix's space) and the answer as two
  pieces; checkpoints that carry it still encode exactly that way in infer and serve.
  Format-1 data is refused by :func:`load_examples` (rebuild it with ``sft prepare``).
- The loss mask is 1 exactly on the assistant answer tokens (the lead included) and each
  exchange's closing EOS (0 on BOS, the user turn and the role markers).
- On disk (``data/post-training/``): ``tokenized_examples.npy`` (all examples' ids
  concatenated, uint16/uint32), ``loss_mask.npy`` (uint8, same length), ``offsets.npy``
  (int64, n+1 boundaries), ``metadata.json`` (written last, atomically; ``complete: true``,
  counts, lengths, tokenizer description and fingerprint, template, data fingerprint)
  and ``example_conversations.json``. :func:`load_examples` validates and reads them.
- :class:`SFTLoader`: padded batches ``{"x", "y", "loss_mask"}`` (``y == -100`` on
  padding), shuffled per epoch from a seed, with a resumable position
  (``state_dict`` / ``load_state_dict``, ``epoch``), as utils/training/trainer.py expects.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

from utils.cli import PipelineError
from utils.config import json_error_text
from utils.data import hub, tools
from utils.errors import error_line
from utils.data.textio import replace_surrogates
from utils.data.tok import encode_plain  # the one plain-text encoder (also used as sft.encode_plain)

FORMAT_NAME = "sft-examples"
FORMAT_VERSION = 2                 # 1: template user-assistant-v1 (refused: rebuild)
TOKENS_FILE = "tokenized_examples.npy"
MASK_FILE = "loss_mask.npy"
OFFSETS_FILE = "offsets.npy"
METADATA_FILE = "metadata.json"
EXAMPLES_FILE = "example_conversations.json"
IGNORE_INDEX = -100
MAX_TURN_CHARS_PER_TOKEN = 40      # a turn longer than max_length * this many characters is refused unread
SKIP_EXAMPLES_KEPT = 50            # file:line reasons kept in metadata (all are counted)


# --------------------------------------------------------------------------- template
TEMPLATE_V1 = "user-assistant-v1"     # prompt and answer encoded apart (old checkpoints)
TEMPLATE_V2 = "user-assistant-v2"     # each exchange one text (format 2)
TEMPLATE_JINJA = "jinja"              # a public model's own Jinja template (utils/data/chat.py)


def default_template(sft_cfg=None) -> dict:
    """The chat template as data (stored in metadata and checkpoints)."""
    user = getattr(sft_cfg, "user_prefix", "User: ")
    assistant = getattr(sft_cfg, "assistant_prefix", "Assistant: ")
    return {"name": TEMPLATE_V2, "user_prefix": user, "assistant_prefix": assistant,
            "separator": "\n", "bos": True, "eos": True,
            "exchange": "<s>{user_prefix}{question}{separator}{assistant_prefix}{answer}</s>",
            "encoding": "each exchange is one text; a prompt ends at the assistant prefix "
                        "without its trailing whitespace",
            "loss": "assistant answer tokens and each closing EOS"}


def template_version(template: dict) -> str:
    """The template's name, if this version knows it (PipelineError otherwise)."""
    name = template.get("name") if isinstance(template, dict) else None
    if name not in (TEMPLATE_V1, TEMPLATE_V2, TEMPLATE_JINJA):
        raise PipelineError(f"chat template {name!r} is not one this version of the pipeline "
                            f"knows ({TEMPLATE_V1}, {TEMPLATE_V2}, {TEMPLATE_JINJA}); update the pipeline "
                            "(git pull).")
    return name


def prompt_text(template: dict, question: str) -> str:
    """The text of a prompt: the user turn and the assistant prefix (v2: without its trailing
    whitespace, which starts the answer)."""
    assistant = template["assistant_prefix"]
    if template_version(template) == TEMPLATE_V2:
        assistant = assistant.rstrip()
    return f"{template['user_prefix']}{question}{template['separator']}{assistant}"


def answer_lead(template: dict) -> str:
    """What an answer's text starts with after the prompt (v2: the assistant prefix's trailing
    whitespace; v1: nothing, the prompt ends with it)."""
    if template_version(template) == TEMPLATE_V1:
        return ""
    prefix = template["assistant_prefix"]
    return prefix[len(prefix.rstrip()):]


def exchange_text(template: dict, question: str, answer: str) -> str:
    """The one text of a finished v2 exchange (BOS and EOS go around its ids)."""
    return prompt_text(template, question) + answer_lead(template) + answer


def answer_decoding(template: dict) -> tuple[bool, str]:
    """How generated answer ids become reply text: ``(continues, lead)``. v2: decoded as a
    continuation of the prompt's last token (a SentencePiece word-start piece keeps its space)
    with the lead dropped, so the reply is the answer as the conversation stores it; v1: the
    ids decoded on their own, as before."""
    if template_version(template) == TEMPLATE_V1:
        return False, ""
    return True, answer_lead(template)


def encode_conversation(tok, template: dict, turns: Sequence[str], bos_id: int, eos_id: int
                        ) -> Optional[tuple[list[int], list[int]]]:
    """``(ids, mask)`` of a conversation (even number of turns: user, assistant, ...), or None
    (see :func:`encode_conversations`). An odd final turn (a pending user question) is encoded
    as a prompt with no answer."""
    return encode_conversations(tok, template, [turns], bos_id, eos_id)[0]


def encode_conversations(tok, template: dict, conversations: Sequence[Sequence[str]], bos_id: int,
                         eos_id: int) -> list[Optional[tuple[list[int], list[int]]]]:
    """``(ids, mask)`` of each conversation, with every text of them all in one tokenizer call
    (the fast tokenizer encodes a batch on all cores; the ids are the same as one conversation
    at a time). v2: None for a conversation with an exchange whose ids do not begin with
    exactly its prompt's ids (the answer's first characters merge into the prompt's last
    token, e.g. an assistant prefix without a trailing space): a model trained on it would
    never be prompted the way it was trained."""
    if template_version(template) == TEMPLATE_V1:
        return _encode_v1(tok, template, conversations, bos_id, eos_id)
    return encode_exchanges(tok, template, [[(turns[i], turns[i + 1] if i + 1 < len(turns) else None, False)
                                             for i in range(0, len(turns), 2)] for turns in conversations],
                            bos_id, eos_id)


def opening_prompt(template: dict, opening: str, tool: bool) -> str:
    """The prompt text of a v2 exchange: a user turn (``tool`` false) or the results of tool calls
    (``tool`` true: their ``Tool: ...`` lines as utils/data/tools.py writes them), then the
    assistant prefix without its trailing whitespace."""
    if not tool:
        return prompt_text(template, opening)
    return f"{opening}{template['separator']}{template['assistant_prefix'].rstrip()}"


def encode_exchanges(tok, template: dict, conversations: Sequence[Sequence[tuple]], bos_id: int,
                     eos_id: int) -> list[Optional[tuple[list[int], list[int]]]]:
    """v2: ``(ids, mask)`` of conversations given as exchanges ``(opening, answer or None, tool)``
    (:func:`opening_prompt`; tool use: utils/data/tools.py), every text in one tokenizer call;
    None for a conversation whose exchange ids do not begin with exactly its prompt's ids (see
    :func:`encode_conversations`). The mask is 1 on each answer (its lead included) and its EOS."""
    texts: list[str] = []
    plans = []
    for exchanges in conversations:
        plan = []                  # per exchange: (index of its full text or None, of its prompt)
        for opening, answer, tool in exchanges:
            prompt = opening_prompt(template, opening, tool)
            if answer is not None:
                plan.append((len(texts), len(texts) + 1))
                texts += [prompt + answer_lead(template) + answer, prompt]
            else:
                plan.append((None, len(texts)))
                texts.append(prompt)
        plans.append(plan)
    enc = encode_plain(tok, texts)
    out: list[Optional[tuple[list[int], list[int]]]] = []
    for plan in plans:
        ids: list[int] = []
        mask: list[int] = []
        exact = True
        for full, prompt in plan:
            p = enc[prompt]
            e = p if full is None else enc[full] + [eos_id]
            if e[:len(p)] != p:
                exact = False
                break
            ids += [bos_id] + e
            mask += [0] * (1 + len(p)) + [1] * (len(e) - len(p))
        out.append((ids, mask) if exact else None)
    return out


def _encode_v1(tok, template: dict, conversations: Sequence[Sequence[str]], bos_id: int,
               eos_id: int) -> list[tuple[list[int], list[int]]]:
    """Template v1: the prompt and the answer of each exchange encoded as two pieces."""
    texts: list[str] = []
    shapes = []
    for turns in conversations:
        prompts = [prompt_text(template, turns[i]) for i in range(0, len(turns), 2)]
        answers = [turns[i] for i in range(1, len(turns), 2)]
        shapes.append((len(texts), len(prompts), len(answers)))
        texts += prompts + answers
    enc = encode_plain(tok, texts)
    out = []
    for start, n_p, n_a in shapes:
        p_ids, a_ids = enc[start:start + n_p], enc[start + n_p:start + n_p + n_a]
        ids: list[int] = []
        mask: list[int] = []
        for i, p in enumerate(p_ids):
            ids += [bos_id] + p
            mask += [0] * (1 + len(p))
            if i < len(a_ids):
                ids += a_ids[i] + [eos_id]
                mask += [1] * (len(a_ids[i]) + 1)
        out.append((ids, mask))
    return out


def encode_prompt(tok, template: dict, history: Sequence[tuple[str, str]], question: str,
                  bos_id: int, eos_id: int) -> list[int]:
    """Ids of a chat prompt: past (user, assistant) exchanges, then the new question up to
    the assistant marker, exactly as training framed them (the ids a trained conversation
    begins with)."""
    if template_version(template) == TEMPLATE_V1:
        turns = [t for pair in history for t in pair] + [question]
        return _encode_v1(tok, template, [turns], bos_id, eos_id)[0][0]
    enc = encode_plain(tok, [exchange_text(template, q, a) for q, a in history]
                       + [prompt_text(template, question)])
    ids: list[int] = []
    for e in enc[:-1]:
        ids += [bos_id] + e + [eos_id]
    return ids + [bos_id] + enc[-1]



def encode_exchange_prompt(tok, template: dict, exchanges: Sequence[tuple], bos_id: int, eos_id: int) -> list[int]:
    """v2: the ids of a chat prompt given as exchanges ``(opening, answer, tool)`` whose last has
    no answer (tool use, utils/data/tools.py): what :func:`encode_exchanges` frames."""
    template_version(template)
    texts = [opening_prompt(template, o, t) + ("" if a is None else answer_lead(template) + a)
             for o, a, t in exchanges]
    ids: list[int] = []
    for (_, a, _), e in zip(exchanges, encode_plain(tok, texts)):
        ids += [bos_id] + e + ([] if a is None else [eos_id])
    return ids

# --------------------------------------------------------------------------- reading records
@dataclass
class Skips:
    """Malformed or dropped records: counts by reason, the first few as ``file:line: reason``,
    and notes about unambiguous repairs."""
    counts: dict = field(default_factory=dict)
    where: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)

    def skip(self, reason: str, location: str, detail: str = "") -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.where) < SKIP_EXAMPLES_KEPT:
            self.where.append(f"{location}: {reason}" + (f" ({detail})" if detail else ""))

    def note(self, what: str, n: int = 1) -> None:
        self.notes[what] = self.notes.get(what, 0) + n

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        return {"skipped": dict(sorted(self.counts.items())), "skipped_total": self.total,
                "skipped_examples": list(self.where), "converted": dict(sorted(self.notes.items()))}


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "bot": "assistant", "model": "assistant"}


def normalize_record(obj: Any, loc: str, skips: Skips, max_turn_chars: int) -> Optional[dict]:
    """A LIMA-schema record from one parsed JSON value, or None (skipped, with reason)."""
    if not isinstance(obj, dict):
        skips.skip("not_an_object", loc, f"a JSON {type(obj).__name__}")
        return None
    if "conversations" not in obj and "messages" in obj:
        return _messages_record(obj, loc, skips, max_turn_chars)
    if "conversations" not in obj:
        skips.skip("no_conversations_key", loc, "keys: " + ", ".join(sorted(map(str, obj))[:6]))
        return None
    conv = obj["conversations"]
    if not isinstance(conv, list):
        skips.skip("conversations_not_a_list", loc, f"a {type(conv).__name__}")
        return None
    if conv and all(isinstance(t, dict) for t in conv):
        turns = []
        for i, t in enumerate(conv):
            role = t.get("from", t.get("role"))
            text = t.get("value", t.get("content"))
            want = "user" if i % 2 == 0 else "assistant"
            if _SHAREGPT_ROLES.get(str(role).lower()) != want or not isinstance(text, str):
                skips.skip("sharegpt_turns_ambiguous", loc,
                           f"turn {i + 1} has role {role!r}; expected {want} turns alternating, "
                           "user first")
                return None
            turns.append(text)
        skips.note("sharegpt_dict_turns_to_strings")
        conv = turns
    if not all(isinstance(t, str) for t in conv):
        bad = next(t for t in conv if not isinstance(t, str))
        skips.skip("turn_not_a_string", loc, f"a {type(bad).__name__} turn")
        return None
    if not conv:
        skips.skip("empty_conversation", loc)
        return None
    if len(conv) % 2:
        skips.skip("odd_turn_count", loc, f"{len(conv)} turns; need user/assistant pairs")
        return None
    for i, t in enumerate(conv):
        if not t.strip():
            skips.skip("empty_turn", loc, f"turn {i + 1} is empty or whitespace")
            return None
        if len(t) > max_turn_chars:
            skips.skip("turn_too_long", loc, f"turn {i + 1} has {len(t):,} characters")
            return None
    texts = [*conv, obj.get("source", "unknown")]
    for i, t in enumerate(texts):
        if isinstance(t, str):
            texts[i], n = replace_surrogates(t)     # a JSON "\ud800" escape: text is data
            if n:
                skips.note("lone_surrogates_replaced", n)
    return {"conversations": texts[:-1], "source": texts[-1]}



def _messages_record(obj: dict, loc: str, skips: Skips, max_turn_chars: int) -> Optional[dict]:
    """A record in the conversational shape transformers and TRL use (``messages``, and
    ``tools`` for tool use: utils/data/tools.py), normalized to ``{"messages", "tools",
    "source"}``; it must end with an assistant turn (what is trained on)."""
    try:
        messages = tools.read_messages(obj["messages"], "messages")
        functions = tools.read_tools(obj.get("tools") or [], "tools")
    except tools.ToolFormatError as e:
        skips.skip("bad_messages", loc, str(e))
        return None
    if messages[-1]["role"] != "assistant":
        skips.skip("last_turn_not_assistant", loc, f"the last message is a {messages[-1]['role']!r} turn")
        return None
    known = {f["name"] for f in functions}
    for i, m in enumerate(messages):
        for c in m.get("tool_calls", ()):
            if c["function"]["name"] not in known:
                skips.skip("call_of_unlisted_tool", loc, f"messages[{i}] calls {c['function']['name']!r}, "
                           "which 'tools' does not list")
                return None
        if m.get("content") is not None:
            if len(m["content"]) > max_turn_chars:
                skips.skip("turn_too_long", loc, f"message {i + 1} has {len(m['content']):,} characters")
                return None
            m["content"], n = replace_surrogates(m["content"])
            if n:
                skips.note("lone_surrogates_replaced", n)
    if functions:
        skips.note("tool_use_conversations")
    source = obj.get("source", "unknown")
    return {"messages": messages, "tools": functions, "source": source if isinstance(source, str) else "unknown"}

def read_jsonl_records(path: Path, max_turn_chars: int, skips: Skips) -> list[dict]:
    """Records of a local JSONL file (see module docstring for the repairs and skips)."""
    path = Path(path)
    raw = read_source_bytes(path, skips, f"SFT source {path} does not exist (or is not a file). Pass a "
                            "JSON Lines file with one {\"conversations\": [user, assistant, ...]} "
                            "object per line, or --dataset samples for the offline QA data.")
    name = path.name
    stripped = raw.lstrip()
    if stripped.startswith(b"["):
        try:
            arr = json.loads(stripped.decode("utf-8"))
        except (ValueError, RecursionError):       # not UTF-8 / JSON: read as JSON Lines below
            arr = None
        if isinstance(arr, list):
            skips.note("json_array_read_as_records")
            out = []
            for i, obj in enumerate(arr):
                rec = normalize_record(obj, f"{name}:[{i}]", skips, max_turn_chars)
                if rec is not None:
                    out.append(rec)
            return out
    out = []
    for loc, obj in jsonl_objects(raw, name, skips, note_crlf=True):
        rec = normalize_record(obj, loc, skips, max_turn_chars)
        if rec is not None:
            out.append(rec)
    return out


def read_source_bytes(path: Path, skips: Skips, missing: str) -> bytes:
    """The bytes of a local source file (SFT records, preference pairs), a UTF-8 BOM removed
    (noted ``utf8_bom_removed``); a missing file is an error saying ``missing``."""
    if not path.is_file():
        raise PipelineError(missing)
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
        skips.note("utf8_bom_removed")
    return raw


def jsonl_objects(raw: bytes, name: str, skips: Skips, note_crlf: bool = False) -> Iterator[tuple[str, Any]]:
    """(``name:line``, object) of each JSON line of ``raw``; blank lines passed over, a line
    that is not UTF-8 or not JSON skipped (``invalid_utf8``, ``invalid_json``), CRLF ends
    removed (counted as ``crlf_line_ends`` with ``note_crlf``)."""
    crlf = 0
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        if line.endswith(b"\r"):
            line = line[:-1]
            crlf += 1
        if not line.strip():
            continue
        loc = f"{name}:{lineno}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            skips.skip("invalid_utf8", loc, f"byte {e.start}")
            continue
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as e:   # syntax, too deep, an integer of 4,300+ digits
            skips.skip("invalid_json", loc, json_error_text(e))
            continue
        yield loc, obj
    if crlf and note_crlf:
        skips.note("crlf_line_ends", crlf)


def lima_records(name: str, split: str = "train") -> list[dict]:
    """LIMA (the default source when online), or any dataset of its schema: a hub name or its
    local copy (a ``save_to_disk`` folder or a folder of data files), through ``datasets``."""
    ds = hub.load_table(name, split, lambda e: (
        f"cannot load the SFT dataset '{name}' ({error_line(e)}). Offline, use `--dataset samples` "
        "(real SciQ and ARC question/answer pairs converted into LIMA's schema, labelled as a "
        "substitute), `--dataset FILE.jsonl` with one {\"conversations\": [...]} per line, or a local "
        "dataset folder (sft.dataset in config.json)."))
    if "conversations" not in ds.column_names:
        raise PipelineError(f"the SFT dataset '{name}' has no 'conversations' column (its columns: "
                            f"{', '.join(ds.column_names)}); LIMA's schema is one list of turns per row.")
    return [{"conversations": list(r["conversations"]), "source": r.get("source", "lima")} for r in ds]


def qa_substitute_records(samples_dir: Path) -> list[dict]:
    """SciQ (answer written with its support text) and ARC-Easy/Challenge (the correct choice
    written out) from the offline samples, as LIMA-schema records."""
    import datasets         # 0.9 s: as in lima_records
    out: list[dict] = []
    sources = {"sciq": samples_dir / "sciq" / "validation",
               "arc_easy": samples_dir / "arc_easy" / "validation",
               "arc_challenge": samples_dir / "arc_challenge" / "validation"}
    missing = [str(p) for p in sources.values() if not p.is_dir()]
    if missing:
        raise PipelineError(f"offline QA samples missing: {', '.join(missing)}. Fetch them with "
                            "`python main.py samples`.")
    for name, p in sources.items():
        ds = datasets.load_from_disk(str(p))
        for r in ds:
            q = (r.get("question") or "").strip()
            if name == "sciq":
                ans = (r.get("correct_answer") or "").strip()
                if not q or not ans:
                    continue
                support = (r.get("support") or "").strip()
                a = f"The answer is {ans}."
                if support:
                    a = f"{a} {support}"
            else:
                ch = r.get("choices") or {}
                labels, texts = list(ch.get("label") or []), list(ch.get("text") or [])
                key = r.get("answerKey")
                if not q or key not in labels:
                    continue
                a = f"The answer is {texts[labels.index(key)].strip()}."
            out.append({"conversations": [q, a], "source": name})
    return out


# --------------------------------------------------------------------------- tokenized examples
def data_fingerprint(tokens: np.ndarray, mask: np.ndarray, offsets: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in (tokens, mask, offsets):
        h.update(str(a.dtype).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def positions_needed(tokens: int) -> int:
    """Positions a model needs to train on a sequence of ``tokens`` tokens: it reads all but the
    last (x = ids[:-1], y = ids[1:], :func:`collate`). The one length rule of SFT and DPO data
    against a model's ``max_seq_len``."""
    return max(int(tokens) - 1, 0)


def dataset_path(spec: str, resolve) -> Path:
    """A local dataset ``spec`` (``sft.dataset``, ``dpo.dataset``; not a hub name) as a path: ``~``
    expanded; a relative one against the project's root (``resolve``: ``Config.resolve``)
    when it exists there, else against the current folder, where the user typed it. The one
    rule of ``sft prepare`` and ``dpo prepare``."""
    p = Path(os.path.expanduser(spec))
    if p.is_absolute():
        return p
    under_root = Path(resolve(spec))
    return under_root if under_root.exists() else p.resolve()


def length_stats(lengths: Sequence[int]) -> dict:
    if not len(lengths):
        return {"count": 0}
    a = np.asarray(lengths)
    return {"count": int(a.size), "min": int(a.min()), "max": int(a.max()),
            "mean": round(float(a.mean()), 2), "median": float(np.median(a)),
            "p95": float(np.percentile(a, 95)), "total_tokens": int(a.sum())}


@dataclass
class Examples:
    tokens: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    meta: dict

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.mask[a:b]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def read_metadata(directory: Path, rebuild: str = "python main.py sft prepare") -> dict:
    """The ``metadata.json`` of a complete SFT example set; PipelineError naming the file
    otherwise (the arrays are not read: :func:`load_examples` checks them)."""
    d = Path(directory)
    meta_path = d / METADATA_FILE
    if not meta_path.is_file():
        raise PipelineError(f"no prepared SFT data in {d} ({METADATA_FILE} missing). Build it "
                            f"with `{rebuild}`.")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:    # unreadable, not UTF-8, not JSON
        raise PipelineError(f"{meta_path} is not valid JSON ({e}); rebuild with `{rebuild}`.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME or not meta.get("complete"):
        raise PipelineError(f"{meta_path} does not describe a complete SFT example set (format "
                            f"{FORMAT_NAME}); rebuild with `{rebuild}`.")
    version = meta.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version > FORMAT_VERSION:
        raise PipelineError(f"{meta_path}: format version {version!r} is not one this program "
                            "reads (newer, or damaged); update the pipeline or rebuild with "
                            f"`{rebuild}`.")
    return meta


def load_examples(directory: Path, rebuild: str = "python main.py sft prepare") -> Examples:
    """The prepared SFT examples, validated; PipelineError naming the file otherwise. Data of
    an older format (readable by :func:`read_metadata`) is refused for training."""
    d = Path(directory)
    meta = read_metadata(d, rebuild)
    version = meta["format_version"]
    if version < FORMAT_VERSION:
        old = meta.get("template")
        raise PipelineError(
            f"{d / METADATA_FILE}: SFT data format {version} (chat template "
            f"'{old.get('name') if isinstance(old, dict) else old}': each prompt and answer encoded apart, "
            "which no exported chat template reproduces token for token) is no longer trained "
            f"on. Rebuild it with `{rebuild}` (with the --config and --dataset you used); "
            "checkpoints already trained on it keep working in infer, serve and export.")
    arrays = []
    for name in (TOKENS_FILE, MASK_FILE, OFFSETS_FILE):
        p = d / name
        try:
            arrays.append(np.load(p, allow_pickle=False))
        except FileNotFoundError:
            raise PipelineError(f"{p} is missing; rebuild with `{rebuild}`.") from None
        except (ValueError, OSError, EOFError) as e:
            raise PipelineError(f"{p} cannot be read ({e}); rebuild with `{rebuild}`.") from None
    tokens, mask, offsets = arrays
    ok = (tokens.ndim == mask.ndim == offsets.ndim == 1 and len(tokens) == len(mask)
          and len(offsets) >= 1 and int(offsets[0]) == 0 and int(offsets[-1]) == len(tokens)
          and bool((np.diff(offsets) > 0).all()))
    if not ok or data_fingerprint(tokens, mask, offsets) != meta.get("data_fingerprint"):
        raise PipelineError(f"the SFT arrays in {d} do not match {METADATA_FILE} (damaged or "
                            f"mixed files); rebuild with `{rebuild}`.")
    return Examples(tokens, mask, offsets, meta)


def split_indices(n: int, val_split: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed (seeded) train/validation split of ``n`` examples; at least one of each when
    ``n >= 2`` and ``val_split > 0``."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val = int(round(n * val_split)) if val_split > 0 else 0
    if val_split > 0 and n >= 2:
        n_val = min(max(1, n_val), n - 1)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def collate(examples: Examples, idx: Sequence[int], pad_id: int) -> dict:
    """Padded next-token batch: x = ids[:-1], y = ids[1:] (-100 on padding), loss_mask = mask[1:]."""
    import torch            # 1.5 s: `sft prepare` imports this module and does not load torch
    pairs = [examples.example(int(i)) for i in idx]
    T = max(len(t) for t, _ in pairs) - 1
    B = len(pairs)
    x = np.full((B, T), pad_id, dtype=np.int64)
    y = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    m = np.zeros((B, T), dtype=np.float32)
    for r, (t, k) in enumerate(pairs):
        n = len(t) - 1
        x[r, :n] = t[:-1]
        y[r, :n] = t[1:]
        m[r, :n] = k[1:]
    return {"x": torch.from_numpy(x), "y": torch.from_numpy(y), "loss_mask": torch.from_numpy(m)}


class SFTLoader:
    """Training batches over a subset of examples, reshuffled each epoch from ``seed``.
    Position: ``{"epoch", "index" (examples of this epoch consumed), "batch_size", "seed",
    "num_examples"}``; each ``for`` pass yields the rest of the current epoch."""

    def __init__(self, examples: Examples, indices: Sequence[int], batch_size: int, seed: int,
                 pad_id: int, shuffle: bool = True):
        self.examples, self.indices = examples, np.asarray(indices, dtype=np.int64)
        self.batch_size, self.seed, self.pad_id, self.shuffle = int(batch_size), int(seed), pad_id, shuffle
        self.epoch, self.index = 0, 0

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self.indices
        return self.indices[np.random.default_rng([self.seed, epoch]).permutation(len(self.indices))]

    def __iter__(self) -> Iterator[dict]:
        order = self.order(self.epoch)
        while self.index < len(order):
            idx = order[self.index:self.index + self.batch_size]
            self.index += len(idx)
            yield self.collate_batch(idx)
        self.epoch += 1
        self.index = 0

    def collate_batch(self, idx) -> dict:
        """The batch of examples ``idx`` (a subclass batches other rows: DPO's pairs)."""
        return collate(self.examples, idx, self.pad_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "batch_size": self.batch_size,
                "seed": self.seed, "num_examples": int(len(self.indices))}

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("num_examples", len(self.indices))) != len(self.indices):
            raise PipelineError(f"the checkpoint's SFT data position is over "
                                f"{state.get('num_examples')} training examples but the prepared "
                                f"data has {len(self.indices)}; resume with the same SFT data.")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class SFTValData:
    """Validation batches in a fixed order (re-iterable)."""

    def __init__(self, examples: Examples, indices: Sequence[int], batch_size: int, pad_id: int):
        self.examples, self.indices = examples, np.asarray(indices, dtype=np.int64)
        self.batch_size, self.pad_id = int(batch_size), pad_id

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def __iter__(self) -> Iterator[dict]:
        for s in range(0, len(self.indices), self.batch_size):
            yield self.collate_batch(self.indices[s:s + self.batch_size])

    def collate_batch(self, idx) -> dict:
        """The batch of examples ``idx`` (a subclass batches other rows: DPO's pairs)."""
        return collate(self.examples, idx, self.pad_id)


def decode_for_people(tok, ids: Iterable[int]) -> str:
    return tok.decode(list(map(int, ids)), skip_special_tokens=False)
