"""Preference data for DPO: records -> chat-formatted (prompt + chosen, prompt + rejected) token
ids with completion-only masks, on disk, and back as resumable batches of pairs (library;
nothing runs on import).

Contract (docs/dpo.md):

- A *record* is TRL's preference shape, one JSON object per line: ``{"prompt", "chosen",
  "rejected"}``, either plain text (prompt a string, chosen/rejected strings) or
  conversational (prompt a list of ``{"role", "content"}`` messages, user and assistant
  alternating and ending with a user turn; chosen/rejected a one-message assistant list or a
  string). TRL's implicit-prompt form (no ``prompt``; chosen and rejected whole conversations
  sharing every message but the last) is read too. A malformed record is skipped and reported
  as ``file:line: reason`` (utils.data.sft.Skips, as SFT data is); no usable pair is an error.
- Rendering: each side is the conversation (prompt turns + that answer) framed by the chat
  template exactly as SFT frames it (utils.data.chat.encode_conversations: the tokenizer's own
  template or ours, recorded in the metadata). The loss mask is 1 on the LAST assistant turn
  only (its tokens and end-of-turn token): earlier assistant turns belong to the prompt.
- On disk (``data/preference/``, paths.preference_dir): ``tokenized_examples.npy``,
  ``loss_mask.npy`` and ``offsets.npy`` as SFT data has them (utils/data/sft.py), with pair i's
  chosen sequence as example 2i and its rejected one as 2i + 1; ``split.npy`` (uint8 per pair,
  1 = held out, drawn once from training.seed and dpo.val_split, so every run and the study
  hold out the same pairs); ``metadata.json`` (written last, atomically; format, counts,
  lengths, tokenizer, template, data fingerprint) and ``example_pairs.json``.
- The offline substitute (:func:`sample_pairs`): real SciQ and ARC-Easy/Challenge questions as
  prompts, the correct answer as chosen and one of the item's own wrong options (chosen by a
  seeded draw per item) as rejected, both written "The answer is X." as the SFT substitute
  writes its answers. Labelled as a substitute in the metadata.
- :class:`PairLoader`: batches ``{"x", "y", "loss_mask", "pair"}`` of 2n rows (n chosen, then
  their n rejected, padded together), shuffled per epoch from a seed, with SFT's resumable
  position (utils.data.sft.SFTLoader).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from utils.cli import PipelineError
from utils.data import chat, hub, sft
from utils.errors import error_line
from utils.data.textio import replace_surrogates
from utils.data.tok import require_bos_eos

FORMAT_NAME = "preference-pairs"
FORMAT_VERSION = 1
SPLIT_FILE = "split.npy"
EXAMPLES_FILE = "example_pairs.json"
REBUILD = "python main.py dpo prepare"
SAMPLE_LABEL = ("SUBSTITUTE for a human preference set: real SciQ and ARC-Easy/Challenge questions, "
                "the correct answer as chosen and one of the item's own wrong options as rejected "
                "(\"The answer is X.\"); no preference dataset is reachable offline")


# --------------------------------------------------------------------------- records
def _message_turns(msgs: Any, loc: str, skips: sft.Skips, what: str, last_role: str) -> Optional[list]:
    """The contents of alternating user/assistant messages starting with user and ending with
    ``last_role``, or None (skipped with a reason)."""
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        skips.skip(f"{what}_not_messages", loc, f"{what} must be a string or a list of "
                   "{\"role\", \"content\"} messages")
        return None
    turns = []
    for i, m in enumerate(msgs):
        want = "user" if i % 2 == 0 else "assistant"
        if m.get("role") != want or not isinstance(m.get("content"), str):
            skips.skip(f"{what}_roles", loc, f"message {i + 1} has role {m.get('role')!r}; expected "
                       f"{want} (user and assistant alternating, user first; no system message)")
            return None
        turns.append(m["content"])
    if msgs[-1]["role"] != last_role:
        skips.skip(f"{what}_roles", loc, f"its last message must be the {last_role}'s")
        return None
    return turns


def _answer(value: Any, loc: str, skips: sft.Skips, what: str) -> Optional[str]:
    """A chosen/rejected answer: a string, or a list of one assistant message."""
    if isinstance(value, str):
        return value
    if (isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)
            and value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str)):
        return value[0]["content"]
    skips.skip(f"{what}_not_an_answer", loc, f"{what} must be a string or [{{\"role\": \"assistant\", "
               "\"content\": ...}]")
    return None


def _implicit_prompt(obj: dict, loc: str, skips: sft.Skips) -> Optional[tuple]:
    """TRL's implicit-prompt form: (prompt turns, chosen, rejected) from two whole conversations."""
    c = _message_turns(obj.get("chosen"), loc, skips, "chosen", "assistant")
    r = _message_turns(obj.get("rejected"), loc, skips, "rejected", "assistant") if c is not None else None
    if c is None or r is None:
        return None
    if c[:-1] != r[:-1]:
        skips.skip("prompts_differ", loc, "without a prompt key, chosen and rejected must share "
                   "every message but the last")
        return None
    return c[:-1], c[-1], r[-1]


def normalize_pair(obj: Any, loc: str, skips: sft.Skips, max_chars: int) -> Optional[dict]:
    """A pair ``{"turns", "chosen", "rejected", "source"}`` from one parsed JSON value, or None."""
    if not isinstance(obj, dict):
        skips.skip("not_an_object", loc, f"a JSON {type(obj).__name__}")
        return None
    missing = [k for k in ("chosen", "rejected") if k not in obj]
    if missing:
        skips.skip("missing_key", loc, f"no {' or '.join(missing)}; keys: "
                   + ", ".join(sorted(map(str, obj))[:6]))
        return None
    if "prompt" not in obj:
        got = _implicit_prompt(obj, loc, skips)
    else:
        p = obj["prompt"]
        turns = [p] if isinstance(p, str) else _message_turns(p, loc, skips, "prompt", "user")
        chosen = _answer(obj["chosen"], loc, skips, "chosen") if turns is not None else None
        rejected = _answer(obj["rejected"], loc, skips, "rejected") if chosen is not None else None
        got = (turns, chosen, rejected) if rejected is not None else None
    if got is None:
        return None
    turns, chosen, rejected = got
    for name, t in [*((f"prompt turn {i + 1}", t) for i, t in enumerate(turns)),
                    ("chosen", chosen), ("rejected", rejected)]:
        if not t.strip():
            skips.skip("empty_text", loc, f"{name} is empty or whitespace")
            return None
        if len(t) > max_chars:
            skips.skip("text_too_long", loc, f"{name} has {len(t):,} characters")
            return None
    if chosen == rejected:
        skips.skip("chosen_equals_rejected", loc, "the two answers are the same text")
        return None
    texts = [replace_surrogates(t)[0] for t in (*turns, chosen, rejected)]
    return {"turns": texts[:-2], "chosen": texts[-2], "rejected": texts[-1],
            "source": str(obj.get("source", "unknown"))}


def read_jsonl_pairs(path: Path, max_chars: int, skips: sft.Skips) -> list[dict]:
    """Pairs of a local JSON Lines file; each bad line is skipped as ``file:line: reason``."""
    path = Path(path)
    raw = sft.read_source_bytes(path, skips, f"preference source {path} does not exist (or is not a file). "
                                "Pass a JSON Lines file with one {\"prompt\", \"chosen\", \"rejected\"} "
                                "object per line, or --dataset samples for the offline substitute.")
    out = []
    for loc, obj in sft.jsonl_objects(raw, path.name, skips):
        rec = normalize_pair(obj, loc, skips, max_chars)
        if rec is not None:
            out.append(rec)
    return out


def hub_pairs(name: str, max_chars: int, skips: sft.Skips, split: str = "train") -> list[dict]:
    """A preference dataset in TRL's shape: a hub name or its local copy (a ``save_to_disk``
    folder or a folder of data files), through ``datasets`` (hub.load_table)."""
    ds = hub.load_table(name, split, lambda e: (
        f"cannot load the preference dataset '{name}' ({error_line(e)}). Offline, use `--dataset samples`, "
        "`--dataset FILE.jsonl`, or a local dataset folder (dpo.dataset in config.json)."))
    out = [normalize_pair(dict(r), f"{name}[{i}]", skips, max_chars) for i, r in enumerate(ds)]
    return [r for r in out if r is not None]


def _sample_rows(samples_dir: Path):
    """(source, row index, question, correct, wrong options) of the offline SciQ and ARC sets."""
    import datasets         # 0.9 s: as in hub_pairs
    for name in ("sciq", "arc_easy", "arc_challenge"):
        p = samples_dir / name / "validation"
        if not p.is_dir():
            raise PipelineError(f"offline QA sample missing: {p}. Fetch it with `python main.py samples`.")
        for i, r in enumerate(datasets.load_from_disk(str(p))):
            q = (r.get("question") or "").strip()
            if name == "sciq":
                right = (r.get("correct_answer") or "").strip()
                wrong = [(r.get(f"distractor{k}") or "").strip() for k in (1, 2, 3)]
            else:
                ch = r.get("choices") or {}
                labels, texts = list(ch.get("label") or []), [t.strip() for t in ch.get("text") or []]
                if r.get("answerKey") not in labels:
                    continue
                right = texts[labels.index(r["answerKey"])]
                wrong = [t for k, t in zip(labels, texts) if k != r["answerKey"]]
            wrong = [w for w in wrong if w and w != right]
            if q and right and wrong:
                yield name, i, q, right, wrong


def sample_pairs(samples_dir: Path, seed: int) -> list[dict]:
    """The offline substitute (module docstring): one pair per SciQ / ARC item, the rejected
    option drawn from the item's wrong ones by ``seed`` and the item's place."""
    out = []
    for k, (name, i, q, right, wrong) in enumerate(_sample_rows(Path(samples_dir))):
        bad = wrong[int(np.random.default_rng([seed, k]).integers(len(wrong)))]
        out.append({"turns": [q], "chosen": f"The answer is {right}.", "rejected": f"The answer is {bad}.",
                    "source": name, "row": i})
    return out


# --------------------------------------------------------------------------- rendering
def choose_template(tok, name: str, setting: str, sft_cfg) -> tuple[dict, Optional[int], Optional[int]]:
    """The chat template pairs are rendered with, chosen as ``sft prepare`` chooses it
    (``setting``: sft.template; the tokenizer's own when it has one, else ours), and the BOS
    and EOS ids our template frames exchanges with."""
    own = chat.template_source(tok)
    if setting == "tokenizer" and own is None:
        raise PipelineError(f"sft.template is 'tokenizer' but tokenizer '{name}' has no chat template "
                            "of its own; set it to 'auto' or 'user-assistant'.")
    if own is not None and setting != "user-assistant":
        return chat.jinja_record(tok, own, name), tok.bos_token_id, tok.eos_token_id
    bos, eos = require_bos_eos(tok, name)
    return sft.default_template(sft_cfg), bos, eos


def last_turn_only(mask: Sequence[int]) -> list[int]:
    """The mask with only its last run of ones kept: the final assistant turn."""
    m = list(mask)
    end = max((i for i, v in enumerate(m) if v), default=-1)
    start = end
    while start > 0 and m[start - 1]:
        start -= 1
    return [1 if start <= i <= end and end >= 0 else 0 for i in range(len(m))]


@dataclass
class Encoded:
    ids: list                     # 2 per kept pair: chosen, rejected
    masks: list
    kept: list                    # the pairs kept
    too_long: int = 0


def encode_pairs(tok, template: dict, pairs: list, bos, eos, max_len: int, skips: sft.Skips,
                 batch_size: int = 100) -> Encoded:
    """Token ids and completion masks of both sides of each pair; a pair whose side cannot be
    framed exactly, or is longer than ``max_len``, is dropped and counted."""
    enc = Encoded([], [], [])
    for s in range(0, len(pairs), batch_size):
        batch = pairs[s:s + batch_size]
        convs = [c for p in batch for c in (p["turns"] + [p["chosen"]], p["turns"] + [p["rejected"]])]
        got = chat.encode_conversations(tok, template, convs, bos, eos)
        for j, p in enumerate(batch):
            a, b = got[2 * j], got[2 * j + 1]
            if a is None or b is None:
                skips.skip("template_does_not_frame", f"pair {s + j + 1}", "the template does not "
                           "render the answer after exactly the prompt's tokens")
                continue
            if max(len(a[0]), len(b[0])) > max_len:
                enc.too_long += 1
                continue
            for ids, mask in (a, b):
                enc.ids.append(ids)
                enc.masks.append(last_turn_only(mask))
            enc.kept.append(p)
    return enc


def split_of(n: int, val_split: float, seed: int) -> np.ndarray:
    """uint8 per pair, 1 = held out (utils.data.sft.split_indices' seeded draw)."""
    split = np.zeros(n, dtype=np.uint8)
    split[sft.split_indices(n, val_split, seed)[1]] = 1
    return split


# --------------------------------------------------------------------------- on disk
@dataclass
class Pairs:
    examples: sft.Examples        # example 2i: pair i's chosen, 2i + 1: its rejected
    split: np.ndarray             # uint8 per pair, 1 = held out
    meta: dict

    def __len__(self) -> int:
        return len(self.split)

    @property
    def train_indices(self) -> np.ndarray:
        return np.flatnonzero(self.split == 0)

    @property
    def heldout_indices(self) -> np.ndarray:
        return np.flatnonzero(self.split == 1)


def read_metadata(directory: Path) -> dict:
    """The metadata of a complete preference set; PipelineError naming the file otherwise."""
    p = Path(directory) / sft.METADATA_FILE
    if not p.is_file():
        raise PipelineError(f"no prepared preference data in {directory} ({sft.METADATA_FILE} "
                            f"missing). Build it with `{REBUILD}`.")
    try:
        meta = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise PipelineError(f"{p} is not valid JSON ({e}); rebuild with `{REBUILD}`.") from None
    if (not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME or not meta.get("complete")
            or meta.get("format_version") != FORMAT_VERSION):
        raise PipelineError(f"{p} does not describe a complete preference set (format {FORMAT_NAME} "
                            f"version {FORMAT_VERSION}); rebuild with `{REBUILD}`.")
    return meta


def load_pairs(directory: Path) -> Pairs:
    """The prepared pairs, validated (arrays against the metadata's fingerprint)."""
    d = Path(directory)
    meta = read_metadata(d)
    arrays = []
    for name in (sft.TOKENS_FILE, sft.MASK_FILE, sft.OFFSETS_FILE, SPLIT_FILE):
        try:
            arrays.append(np.load(d / name, allow_pickle=False))
        except FileNotFoundError:
            raise PipelineError(f"{d / name} is missing; rebuild with `{REBUILD}`.") from None
        except (ValueError, OSError, EOFError) as e:
            raise PipelineError(f"{d / name} cannot be read ({e}); rebuild with `{REBUILD}`.") from None
    tokens, mask, offsets, split = arrays
    ok = (tokens.ndim == mask.ndim == offsets.ndim == split.ndim == 1 and len(tokens) == len(mask)
          and len(offsets) == 2 * len(split) + 1 and int(offsets[0]) == 0
          and int(offsets[-1]) == len(tokens) and bool((np.diff(offsets) > 0).all()))
    if not ok or fingerprint(tokens, mask, offsets, split) != meta.get("data_fingerprint"):
        raise PipelineError(f"the preference arrays in {d} do not match {sft.METADATA_FILE} (damaged "
                            f"or mixed files); rebuild with `{REBUILD}`.")
    return Pairs(sft.Examples(tokens, mask, offsets, meta), split, meta)


def fingerprint(tokens, mask, offsets, split) -> str:
    """sha256 of the four arrays (SFT's data fingerprint with the split folded in)."""
    return sft.data_fingerprint(np.concatenate([tokens.astype(np.int64), split.astype(np.int64)]),
                                mask, offsets)


# --------------------------------------------------------------------------- batches
def collate_pairs(examples: sft.Examples, pair_idx: Sequence[int], pad_id: int) -> dict:
    """2n rows (the chosen sequences, then the rejected ones) padded together, and ``pair``."""
    import torch            # 1.5 s: `dpo prepare` imports this module and does not load torch
    idx = [2 * int(i) for i in pair_idx] + [2 * int(i) + 1 for i in pair_idx]
    batch = sft.collate(examples, idx, pad_id)
    batch["pair"] = torch.as_tensor(np.asarray(pair_idx, dtype=np.int64))
    return batch


class PairLoader(sft.SFTLoader):
    """Training batches of pairs (``indices`` are pair indices), SFT's shuffling and position."""

    def collate_batch(self, idx) -> dict:
        return collate_pairs(self.examples, idx, self.pad_id)


class PairValData(sft.SFTValData):
    """Batches of pairs in a fixed order (re-iterable): validation, and the reference pass."""

    def collate_batch(self, idx) -> dict:
        return collate_pairs(self.examples, idx, self.pad_id)
