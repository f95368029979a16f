"""Benchmark data: read each task's rows from the hub or a local path, validate, select.

Sources (config ``benchmark.*_source``; ``None`` = the default named per task below):

- a folder written by ``datasets.save_to_disk`` (the offline samples are such folders),
- a ``.jsonl`` / ``.jsonl.gz`` / ``.json`` / ``.parquet`` file,
- a Hugging Face hub name (``datasets.load_dataset``; needs network or the local HF cache).

Rows that cannot be scored (missing or empty fields, wrong number of endings, labels that
are not numbers or out of range, lines that are not JSON) are skipped and counted by reason;
they never cost the good rows. Text is data: a lone surrogate in a row's strings (a JSON
``"\\ud800"`` escape) becomes U+FFFD (utils.data.textio.replace_surrogates), and the rows so
repaired are counted (``TaskData.repaired``). A source that cannot be read at all (missing, empty, truncated
or damaged file) or has no valid row is refused with a :class:`PipelineError` naming the file.

Item selection is fixed: with a limit N below the number of valid items, the N items are a
seeded random sample (numpy ``default_rng(seed)``), kept in dataset order, so the same seed
and limit give the same items for every model and every run.
"""
from __future__ import annotations

import bz2
import gzip
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from utils.bench import tasks as T
from utils.cli import PipelineError
from utils.config import load_config
from utils.data import mediawiki
from utils.data.samples import SampleFile, fetch_samples
from utils.data.textio import replace_surrogates

# Hub defaults (what lm-evaluation-harness reads) and the offline sample folders.
HUB = {
    "hellaswag": ("Rowan/hellaswag", None, "validation"),
    "lambada": ("EleutherAI/lambada_openai", "default", "test"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
    "wikitext": ("Salesforce/wikitext", "wikitext-103-raw-v1", "test"),
    # the lm-eval task YAMLs' dataset_path / dataset_name and the split they report
    "piqa": ("baber/piqa", None, "validation"),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation"),
    "boolq": ("aps/super_glue", "boolq", "validation"),
    "copa": ("aps/super_glue", "copa", "validation"),
    "openbookqa": ("allenai/openbookqa", "main", "test"),
    "commonsense_qa": ("tau/commonsense_qa", None, "validation"),
    "social_iqa": ("lighteval/siqa", None, "validation"),
    "mmlu": ("cais/mmlu", "all", "test"),
    "mmlu_cloze": ("cais/mmlu", "all", "test"),
    "arithmetic": ("allenai/basic_arithmetic", None, "validation"),
    "triviaqa": ("mandarjoshi/trivia_qa", "rc.nocontext", "validation"),
    "nq_open": ("google-research-datasets/nq_open", None, "validation"),
}
SAMPLES = {
    "hellaswag": "hellaswag/validation",
    "lambada": "lambada/requests.jsonl.gz",
    "arc_easy": "arc_easy/validation",
    "arc_challenge": "arc_challenge/validation",
    "piqa": "piqa/validation", "winogrande": "winogrande/validation",
    "boolq": "boolq/validation", "copa": "copa/validation",
    "openbookqa": "openbookqa/validation", "commonsense_qa": "commonsense_qa/validation",
    "social_iqa": "social_iqa/validation", "mmlu": "mmlu", "mmlu_cloze": "mmlu",
    "arithmetic": "arithmetic/validation", "triviaqa": "triviaqa/validation",
    "nq_open": "nq_open/validation",
}
BUILDERS: dict[str, Callable[[Any, int], Any]] = {
    "hellaswag": T.hellaswag_item, "lambada": T.lambada_item,
    "arc_easy": T.arc_item, "arc_challenge": T.arc_item,
    "piqa": T.piqa_item, "winogrande": T.winogrande_item, "boolq": T.boolq_item,
    "copa": T.copa_item, "openbookqa": T.openbookqa_item, "commonsense_qa": T.commonsense_qa_item,
    "social_iqa": T.social_iqa_item, "mmlu": T.mmlu_item, "mmlu_cloze": T.mmlu_cloze_item,
    "arithmetic": T.arithmetic_item, "triviaqa": T.triviaqa_item, "nq_open": T.nq_open_item,
}
# Substitutes the offline samples make, said next to the results (lm-eval's own data differs)
SAMPLE_NOTES = {
    "arc_easy": "validation split (offline sample); lm-eval reports ARC on the test split",
    "arc_challenge": "validation split (offline sample); lm-eval reports ARC on the test split",
    "openbookqa": "validation split (offline sample); lm-eval reports OpenBookQA on the test split",
    "boolq": "google/boolq validation (offline sample): lm-eval reads SuperGLUE's copy, whose "
             "passages start with the article title",
    "triviaqa": "rc.wikipedia.nocontext validation (offline sample, 7,993 questions); lm-eval "
                "reads rc.nocontext (17,944)",
    "arithmetic": "AI2's basic arithmetic (offline sample), scored by lm-eval's arithmetic rule "
                  "(acc = the answer is the greedy continuation)",
}
# Few-shot examples: from this split of the same source (MMLU: its dev split, the first k, as
# lm-eval's first_n sampler), else from the evaluated split itself, the item excluded.
FEWSHOT_SPLIT = {"mmlu": "dev", "mmlu_cloze": "dev"}
FEWSHOT_DELIMITER = {"nq_open": "\n"}
MMLU_TASKS = ("mmlu", "mmlu_cloze")
MIN_PASSAGE_CHARS = 200
def hub_offline() -> bool:
    """Offline mode as the hub libraries see it (read at each call, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"

# Held-out Wikipedia for offline perplexity: gensim's second real enwiki sample dump (5 articles
# with tables). The pipeline trains on the other sample dump (data/samples/enwiki); articles
# whose title also appears in the training dump are dropped, so no passage was trained on.
HELDOUT_DEST = "enwiki_heldout/enwiki-table-markup.xml.bz2"
HELDOUT_TRAIN_DUMP = "enwiki/enwiki-sample-pages-articles.xml.bz2"


def heldout_sample():
    return SampleFile("gensim", "4.4.0", "gensim/test/test_data/enwiki-table-markup.xml.bz2",
                      HELDOUT_DEST,
                      "81415636d4dc79c99147ee52098d9a1b1d977d5727543a81227d85ce5cca9383",
                      "real enwiki XML dump, 5 articles, held out from training (CC BY-SA)")


@dataclass
class TaskData:
    task: str
    items: list
    source: str                     # what was read (path or hub name), for the results
    skipped: Counter = field(default_factory=Counter)
    rows: int = 0                   # rows read (valid + skipped)
    repaired: int = 0               # rows whose text had lone surrogates, replaced by U+FFFD
    note: Optional[str] = None      # honest label for substitutes
    pool: list = field(default_factory=list)   # few-shot examples (load_fewshot_pool)
    pool_rule: Optional[str] = None


# --------------------------------------------------------------------------- raw rows
def _damaged(path: Path, e: BaseException, what: str = "dataset file") -> PipelineError:
    return PipelineError(
        f"cannot read {what} {path}: {type(e).__name__}: {e}. The file is truncated or damaged; "
        "re-fetch it (offline samples: `python main.py samples` restores them by checksum) or "
        "point the benchmark.*_source key at a good copy.")


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if path.suffix == ".bz2":
        return bz2.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def iter_jsonl(path: Path, skipped: Counter) -> Iterator[Any]:
    """JSON objects, one per line; blank lines ignored, bad lines counted as 'invalid_json'."""
    try:
        with _open_text(path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):    # syntax, too deep, a 4,300+ digit integer
                    skipped["invalid_json"] += 1
                    continue
                yield row
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as e:
        raise _damaged(path, e) from e


def valid_text(row: Any, depth: int = 0) -> tuple[Any, int]:
    """``row`` with every string in it (dict values and keys, list items) made valid Unicode
    (lone surrogates -> U+FFFD), and how many characters were replaced."""
    if isinstance(row, str):
        return replace_surrogates(row)
    if depth > 8 or not isinstance(row, (dict, list)):
        return row, 0              # deeper than any task's fields: nothing reads it as text
    total = 0
    if isinstance(row, list):
        out = []
        for v in row:
            v, n = valid_text(v, depth + 1)
            out.append(v)
            total += n
        return out, total
    fixed = {}
    for k, v in row.items():
        k, n = valid_text(k, depth + 1)
        v, m = valid_text(v, depth + 1)
        fixed[k] = v
        total += n + m
    return fixed, total


def read_rows(source: str, split: str, skipped: Counter) -> Iterator[Any]:
    """Rows of a local dataset folder / file, or of a hub dataset ``name[:config]``."""
    path = Path(source)
    if path.exists():
        if path.is_dir():
            yield from _read_saved_dataset(path, split)
            return
        if path.stat().st_size == 0:
            raise PipelineError(f"{path} is empty (0 bytes); nothing to benchmark. Re-fetch it or "
                                "point the benchmark.*_source key at a non-empty file.")
        name = path.name.lower()
        if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.bz2")):
            yield from iter_jsonl(path, skipped)
        elif name.endswith(".json"):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, RecursionError) as e:   # not UTF-8 / JSON, too deep, huge integer
                raise _damaged(path, e) from e
            rows = data.get("data", data.get("rows")) if isinstance(data, dict) else data
            if not isinstance(rows, list):
                raise PipelineError(f"{path}: expected a JSON list of rows (or {{\"data\": [...]}})")
            yield from rows
        elif name.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq    # ~0.1 s (as in dataloader.py): only a .parquet file needs it
                yield from pq.read_table(path).to_pylist()
            except Exception as e:
                raise _damaged(path, e) from e
        else:
            raise PipelineError(f"{path}: unsupported dataset file type (use a datasets.save_to_disk "
                                "folder, .jsonl[.gz], .json or .parquet)")
        return
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise PipelineError(f"dataset path {source} does not exist.")
    yield from _read_hub(source, split)


def _read_saved_dataset(path: Path, split: str) -> Iterator[Any]:
    import datasets         # ~0.5 s: only a saved dataset folder or a hub name needs it
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise PipelineError(f"{path} is not a datasets.save_to_disk folder ({e}).") from e
    except Exception as e:
        raise _damaged(path, e, "dataset folder") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise PipelineError(f"{path} has splits {sorted(ds)}, not '{split}'.")
        ds = ds[split]
    try:
        for batch in ds.iter(batch_size=1000):
            keys = list(batch)
            n = len(batch[keys[0]]) if keys else 0
            for i in range(n):
                yield {k: batch[k][i] for k in keys}
    except Exception as e:
        raise _damaged(path, e, "dataset folder") from e


def _read_hub(source: str, split: str) -> Iterator[Any]:
    name, _, config = source.partition(":")
    if hub_offline():
        raise PipelineError(f"cannot load '{source}' from the Hugging Face hub: offline "
                            "(HF_HUB_OFFLINE=1). Point the benchmark.*_source key at a local copy "
                            "(the offline samples are under data/samples/, `python main.py samples`).")
    import datasets         # as in _read_saved_dataset
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:
        raise PipelineError(f"cannot load '{source}' (split {split}) from the Hugging Face hub: "
                            f"{type(e).__name__}: {e}. Offline, point the benchmark.*_source key at "
                            "a local copy.") from e
    yield from ds


def default_source(task: str, samples_dir: Path) -> tuple[str, str]:
    """(source, split): the offline sample when present, else the hub dataset lm-eval reads."""
    local = samples_dir / SAMPLES[task]
    if local.exists():
        return str(local), ("test" if task in ("lambada", *MMLU_TASKS) else "validation")
    name, config, split = HUB[task]
    return (f"{name}:{config}" if config else name), split


def _subject_folders(path: Path) -> list[Path]:
    """An MMLU folder of subject folders (``SUBJECT/test``, ``SUBJECT/dev`` saved datasets, as
    the offline sample keeps them), sorted by subject; [] for anything else."""
    if not path.is_dir() or (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        return []
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def read_task_rows(task: str, src: str, split: str, skipped: Counter) -> Iterator[Any]:
    """A task's raw rows; an MMLU folder of subject folders is read subject by subject, each
    row given its ``subject`` (the field the hub's "all" config carries)."""
    subjects = _subject_folders(Path(src)) if task in MMLU_TASKS else []
    if not subjects:
        yield from read_rows(src, split, skipped)
        return
    for sub in subjects:
        if not (sub / split).exists():
            continue
        for row in read_rows(str(sub / split), split, skipped):
            if isinstance(row, dict) and not row.get("subject"):
                row = {**row, "subject": sub.name}
            yield row


def load_fewshot_pool(task: str, data: "TaskData", split: str) -> None:
    """``data.pool`` (the solved examples few-shot prompts draw from) and ``data.pool_rule``.
    MMLU: its dev split, per subject, the first k (lm-eval's first_n sampler); when the
    source has no dev split, and for every other task, the evaluated items themselves, the
    item excluded (what lm-eval does when its few-shot split is the test split)."""
    other = FEWSHOT_SPLIT.get(task)
    if other and other != split:
        skipped: Counter = Counter()
        build = BUILDERS[task]
        pool = []
        try:
            for i, row in enumerate(read_task_rows(task, data.source, other, skipped)):
                row, _ = valid_text(row)
                try:
                    pool.append(build(row, i))
                except T.BadRow:
                    continue
        except PipelineError:
            pool = []           # no such split in this source: the same split is the pool
        if pool:
            data.pool, data.pool_rule = pool, f"first k of the {other} split, same subject"
            return
    data.pool, data.pool_rule = data.items, "seeded sample of the same split, the item excluded"


def load_task(task: str, source: Optional[str], samples_dir: Path, root: Path,
              fewshot: int = 0) -> TaskData:
    """Read and validate one task read from a dataset (multiple choice, LAMBADA, arithmetic,
    generation); with ``fewshot`` > 0 also its pool of solved examples."""
    if source is None:
        src, split = default_source(task, samples_dir)
    else:
        p = Path(os.path.expanduser(source))
        p = p if p.is_absolute() else root / p
        src, split = (str(p), HUB[task][2]) if p.exists() else (source, HUB[task][2])
        if p.exists() and task in MMLU_TASKS and _subject_folders(p):
            split = "test"
    data = TaskData(task=task, items=[], source=src)
    build = BUILDERS[task]
    for i, row in enumerate(read_task_rows(task, src, split, data.skipped)):
        row, n = valid_text(row)
        data.repaired += n > 0
        try:
            data.items.append(build(row, i))
        except T.BadRow as e:
            data.skipped[e.reason] += 1
    data.rows = len(data.items) + sum(data.skipped.values())
    if data.rows == 0:
        raise PipelineError(f"{src} holds no rows for task {task}; nothing to benchmark.")
    if not data.items:
        reasons = ", ".join(f"{k}: {v}" for k, v in data.skipped.most_common())
        raise PipelineError(f"{src}: none of its {data.rows} rows is a valid {task} item "
                            f"(skipped: {reasons}). Is it the right file for this task?")
    if src.endswith(SAMPLES.get(task, "\0")):
        data.note = SAMPLE_NOTES.get(task)
    if fewshot > 0:
        load_fewshot_pool(task, data, split)
    return data


# --------------------------------------------------------------------------- perplexity texts
def _paragraphs(text: str) -> list[str]:
    parts = text.split("\n\n") if "\n\n" in text else text.split("\n")
    return [" ".join(p.split("\n")).strip() for p in parts]


def _add_passages(data: TaskData, paragraphs, prefix: str) -> None:
    for j, para in enumerate(paragraphs):
        reason = T.passage_ok(para, MIN_PASSAGE_CHARS)
        if reason:
            data.skipped[reason] += 1
        else:
            data.items.append(T.TextItem(id=f"{prefix}{j}", text=para.strip()))


def _dump_articles(path: Path) -> list[tuple[str, str]]:
    """(title, cleaned text) of a MediaWiki XML dump, cleaned by the clean stage's own code (utils.data.mediawiki)."""
    opts = mediawiki.CleanOptions.from_config(load_config(base_file=None))
    out = []
    try:
        with mediawiki.open_binary(path) as stream:
            for page in mediawiki.iter_xml_pages(stream):
                if page.ns != 0 or page.redirect or mediawiki.is_redirect_text(page.text):
                    continue
                out.append((page.title, mediawiki.wikitext_article_text(page.text, opts)))
    except (EOFError, OSError, zlib.error, mediawiki.InputFormatError) as e:
        raise _damaged(path, e, "Wikipedia dump") from e
    return out


def _dump_titles(path: Path) -> set[str]:
    titles = set()
    with mediawiki.open_binary(path) as stream:
        for page in mediawiki.iter_xml_pages(stream):
            titles.add(page.title.strip().lower())
    return titles


def ensure_heldout(samples_dir: Path, cache_dir: Path) -> Path:
    """The held-out dump under samples_dir, extracted (and verified) from the gensim wheel."""
    target = samples_dir / HELDOUT_DEST
    fetch_samples(samples_dir, cache_dir / "sample_wheels", [heldout_sample()], log=lambda *_: None)
    return target


def load_texts(source: Optional[str], samples_dir: Path, cache_dir: Path, root: Path) -> TaskData:
    """Passages (paragraphs of at least MIN_PASSAGE_CHARS characters) for perplexity."""
    if source is None and not hub_offline():
        try:
            return _wikitext_hub("Salesforce/wikitext:wikitext-103-raw-v1")
        except PipelineError as e:
            print(f"benchmark: WikiText-103 is not reachable ({str(e)[:120]}...); "
                  "using held-out Wikipedia articles instead.", flush=True)
    if source is None:
        path = ensure_heldout(samples_dir, cache_dir)
        data = TaskData(task="perplexity", items=[], source=str(path))
        train_dump = samples_dir / HELDOUT_TRAIN_DUMP
        train_titles = _dump_titles(train_dump) if train_dump.exists() else set()
        kept = []
        for k, (title, text) in enumerate(_dump_articles(path)):
            if title.strip().lower() in train_titles:
                data.skipped["article_in_training_dump"] += 1
                continue
            kept.append(title)
            _add_passages(data, _paragraphs(text), f"{k}:")
        data.note = (f"held-out Wikipedia (offline substitute for WikiText-103): passages of "
                     f"{len(kept)} real articles ({'; '.join(kept)}) from gensim's "
                     "enwiki-table-markup sample dump, disjoint by title from the training dump")
    else:
        p = Path(os.path.expanduser(source))
        p = p if p.is_absolute() else root / p
        if not p.exists():
            if "wikitext" in source.lower() and not source.startswith((".", "/", "~")):
                name = source if "/" in source else f"Salesforce/wikitext:{source}-raw-v1"
                return _wikitext_hub(name)
            raise PipelineError(f"perplexity text {p} does not exist (benchmark.perplexity_source).")
        data = TaskData(task="perplexity", items=[], source=str(p))
        files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
        if not files:
            raise PipelineError(f"{p} holds no .txt files for perplexity.")
        for n, f in enumerate(files):
            if f.name.endswith((".xml", ".xml.bz2")):
                for k, (_, text) in enumerate(_dump_articles(f)):
                    _add_passages(data, _paragraphs(text), f"{n}:{k}:")
                continue
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise _damaged(f, e, "text file") from e
            # cleaned_*.txt files hold one article per line: each line is a passage source.
            _add_passages(data, _paragraphs(text), f"{n}:")
        data.note = "local text"
    data.rows = len(data.items) + sum(data.skipped.values())
    if not data.items:
        raise PipelineError(f"{data.source}: no passage of at least {MIN_PASSAGE_CHARS} characters "
                            "to measure perplexity on (is the file empty?).")
    return data


def _wikitext_hub(name: str) -> TaskData:
    data = TaskData(task="perplexity", items=[], source=name, note="WikiText-103 test (detokenized)")
    skipped: Counter = Counter()
    for i, row in enumerate(read_rows(name, "test", skipped)):
        text = row.get("text", "") if isinstance(row, dict) else ""
        reason = T.passage_ok(text, MIN_PASSAGE_CHARS)
        if reason:
            data.skipped[reason] += 1
        else:
            data.items.append(T.TextItem(id=str(i), text=T.wikitext_detokenize(text.strip())))
    data.rows = len(data.items) + sum(data.skipped.values())
    return data


# --------------------------------------------------------------------------- selection
def select(items: Sequence, limit: Optional[int], seed: int) -> list:
    """A fixed subset: all items when limit is None or >= len(items), else a seeded sample
    kept in dataset order."""
    if limit is None or limit >= len(items):
        return list(items)
    idx = np.sort(np.random.default_rng(seed).permutation(len(items))[:limit])
    return [items[i] for i in idx]


# --------------------------------------------------------------------------- few-shot prompts
def attach_shots(task: str, data: TaskData, items: Sequence, k: int) -> list:
    """The selected items as they are scored: each task's description and ``k`` solved
    examples from ``data.pool`` in front of the context (tasks.with_shots). Same split: item
    i's examples are a sample seeded by its index (tasks.fewshot_indices), itself excluded;
    MMLU's dev split: the first k of the item's subject."""
    delim = FEWSHOT_DELIMITER.get(task, T.FEWSHOT_DELIMITER)
    if k <= 0:
        return [T.with_shots(it, [], delim) for it in items]
    position = {id(it): i for i, it in enumerate(data.items)}
    same_split = data.pool is data.items
    by_subject: dict = {}
    if not same_split:
        for ex in data.pool:
            by_subject.setdefault(str(ex.id).split("/")[0], []).append(ex)
    out = []
    for it in items:
        if same_split:
            shots = [data.pool[j] for j in T.fewshot_indices(position[id(it)], len(data.pool), k, True)]
        else:
            shots = by_subject.get(str(it.id).split("/")[0], [])[:k]
        out.append(T.with_shots(it, shots, delim))
    return out
