"""`prepare` (dataset_prep.py + utils/data/packing.py): cleaned articles -> token shards.

Inputs are real text: the 300 news documents of the offline sample (NEWS), written as
cleaned-article files (one escaped article per line, as the cleaner writes them) with
paragraph breaks inserted between sentences. The tokenizer is the Llama-style SentencePiece
sample (SPM_MODEL), saved once as a fast tokenizer the way `main.py tokenize` would, so each
stage run does not convert it again. Small shard_tokens make many shards.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest

from tests.conftest import NEWS, ROOT, SPM_MODEL, default_signals, offline_env, run_stage
from utils.data.textio import escape_article, unescape_article

SHARD_TOKENS = 3000


@pytest.fixture(scope="session")
def saved_tokenizer(samples, tmp_path_factory) -> Path:
    """The SPM sample converted once and saved as tokenizer.json (what `tokenize` does)."""
    from utils.data.tok import load_tokenizer_from
    d = tmp_path_factory.mktemp("tok") / "mistral-v1"
    load_tokenizer_from(str(SPM_MODEL)).save_pretrained(str(d))
    return d


@pytest.fixture(scope="session")
def tok(saved_tokenizer):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(saved_tokenizer))


def news_articles() -> list[str]:
    """Real news documents, with the first sentences turned into paragraphs."""
    docs = [ln.strip() for ln in NEWS.read_text(encoding="utf-8").splitlines() if ln.strip()]
    out = [d.replace(". ", ".\n", 2) if i % 3 else d for i, d in enumerate(docs)]
    out[5] = out[5] + "\nA path like C:\\new\\table and a literal \\n stay as written."
    return out


@pytest.fixture(scope="module")
def prep_env(tmp_path_factory, saved_tokenizer):
    """Module-wide: cleaned files, a config (workers 2) and the reference shard set built once."""
    from tests.conftest import write_config
    root = tmp_path_factory.mktemp("prep")
    arts = news_articles()
    d = root / "cleaned"
    d.mkdir()
    for i, part in enumerate([arts[:100], arts[100:220], arts[220:]]):
        (d / f"cleaned_part{i}.txt").write_text("".join(escape_article(a) + "\n" for a in part),
                                                encoding="utf-8")

    def config(name="config.json", **dataset):
        ds = {"shard_tokens": SHARD_TOKENS, "window": 64, "workers": 2, **dataset}
        return write_config(root, {"tokenizer": {"name": str(SPM_MODEL), "save_dir": str(saved_tokenizer)},
                                   "paths": {"cleaned_dir": str(d)}, "dataset": ds}, name)

    cfg = config()
    ref = root / "reference"
    p = run_stage("prepare", "--config", cfg, "--output-dir", ref, "--workers", "2")
    assert p.returncode == 0, p.stderr
    return {"root": root, "articles": arts, "config": config, "cfg": cfg, "ref": ref, "stdout": p.stdout}


def shard_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("tokens_*.npy"))}


def documents(arr: np.ndarray, bos: int, eos: int) -> list[np.ndarray]:
    """Split a shard into its documents, checking each is BOS ... EOS."""
    starts = np.flatnonzero(arr == bos)
    assert len(arr) and starts[0] == 0
    docs = np.split(arr, starts[1:])
    for doc in docs:
        assert doc[0] == bos and doc[-1] == eos and len(doc) >= 2
        assert not np.isin(doc[1:-1], [bos, eos]).any()
    return docs


def check_set(d: Path, tok, articles: list[str]) -> dict:
    """Everything the shard contract promises, checked against the shard contents."""
    from utils.data.shards import FORMAT_NAME, FORMAT_VERSION, load_shards, read_metadata, validate_metadata
    from utils.data.tok import describe
    meta = read_metadata(d)
    validate_metadata(meta, d, tokenizer_info=describe(tok, "x"))
    assert meta["format"] == FORMAT_NAME and meta["format_version"] == FORMAT_VERSION
    assert meta["complete"] is True and meta["dtype"] == "uint16"
    assert meta["window"] == 64 and meta["stride"] == 32
    arrays = load_shards(d, meta)
    assert [a.dtype for a in arrays] == [np.dtype(np.uint16)] * len(arrays)
    n_docs = 0
    decoded_all = []
    for i, (a, s) in enumerate(zip(arrays, meta["shards"])):
        docs = documents(np.asarray(a), tok.bos_token_id, tok.eos_token_id)
        assert s["tokens"] == len(a) and s["documents"] == len(docs)
        # closed once it reaches shard_tokens; without its last document it had not
        if i < len(arrays) - 1:
            assert len(a) >= meta["shard_tokens"] > len(a) - len(docs[-1])
        n_docs += len(docs)
        decoded_all += [tok.decode(doc[1:-1].tolist()) for doc in docs]
    t = meta["totals"]
    assert t["tokens"] == sum(len(a) for a in arrays) and t["documents"] == n_docs
    assert t["shards"] == len(arrays) == len(meta["shards"])
    assert t["characters"] == sum(len(x) for x in articles[:n_docs])
    assert meta["stats"]["documents_kept"] == n_docs
    assert meta["stats"]["content_tokens"] == t["tokens"] - 2 * n_docs
    # The documents come back in order, paragraph breaks restored.
    assert decoded_all == articles[:n_docs]
    assert (d / "resolved_config.json").exists() and not (d / ".progress.json").exists()
    return meta


# --------------------------------------------------------------------------- unit (in-process)
def test_cleaned_article_escaping_round_trips():
    """utils.data.textio: paragraph breaks and backslashes survive the one-line-per-article format."""
    texts = ["plain", "a\nb", "a\\nb", "back\\slash\n\\n", "trailing\\", "\\x\n\\\\", ""]
    texts += news_articles()[:20]
    for t in texts:
        line = escape_article(t)
        assert "\n" not in line
        assert unescape_article(line) == t, t
    # Backslashes that are not escapes (hand-written files) are kept as they are.
    assert unescape_article("C:\\temp\\x") == "C:\\temp\\x"
    assert unescape_article("a\\qb\\") == "a\\qb\\"


def test_encode_frame_ids_match_encode_batch(tok):
    from utils.data.packing import encode_frame
    arts = news_articles()[:30]
    backend = tok.backend_tokenizer
    ref = [e.ids for e in backend.encode_batch(arts, add_special_tokens=False)]
    framed, kept, lengths = encode_frame(backend, arts, np.dtype(np.uint16), 1, 2, min_tokens=150)
    assert lengths.tolist() == [len(r) for r in ref]
    expect = [t for r in ref if len(r) >= 150 for t in (1, *r, 2)]
    assert framed.tolist() == expect and kept.tolist() == [len(r) >= 150 for r in ref]


# --------------------------------------------------------------------------- end to end
def test_prepare_end_to_end_and_workers_determinism(prep_env, tmp_path, tok):
    cfg, ref = prep_env["cfg"], prep_env["ref"]
    assert "characters per token" in prep_env["stdout"] and "tokens/s" in prep_env["stdout"]
    meta = check_set(ref, tok, prep_env["articles"])
    assert meta["totals"]["documents"] == 300 and meta["totals"]["shards"] > 5
    assert meta["source"]["kind"] == "wikipedia" and meta["source"]["test"] is False
    assert len(meta["source"]["inputs"]) == 3
    # Same set, one worker and another batch size: byte-identical shards.
    out1 = tmp_path / "w1"
    p = run_stage("prepare", "--config", cfg, "--output-dir", out1, "--workers", "1", "--batch", "7")
    assert p.returncode == 0, p.stderr
    assert shard_bytes(out1) == shard_bytes(ref)
    # A second run finds it complete.
    p = run_stage("prepare", "--config", cfg, "--output-dir", out1, "--workers", "1")
    assert p.returncode == 0 and "up to date" in p.stdout


def test_shard_writer_is_the_engines_format(prep_env, tmp_path):
    """utils.data.shards.write_shard_set (what the loader and train tests write their sets with)
    fed the engine's own documents writes the engine's bytes and shard records."""
    from utils.data.shards import write_shard_set
    ref = prep_env["ref"]
    meta = json.loads((ref / "metadata.json").read_text())
    tok_info = meta["tokenizer"]
    docs = [doc for p in sorted(ref.glob("tokens_*.npy"))
            for doc in documents(np.load(p, allow_pickle=False), tok_info["bos_id"], tok_info["eos_id"])]
    out = tmp_path / "written"
    mine = write_shard_set(out, docs, tok_info, shard_tokens=meta["shard_tokens"],
                           source=meta["source"], window=meta["window"], stride=meta["stride"])
    assert shard_bytes(out) == shard_bytes(ref)
    assert mine["shards"] == meta["shards"] and all("max_token_id" in s for s in mine["shards"])
    for key in ("format", "format_version", "complete", "dtype", "tokenizer", "source", "window",
                "stride", "shard_tokens"):
        assert mine[key] == meta[key], key
    assert {k: meta["totals"][k] for k in mine["totals"]} == mine["totals"]
    assert json.loads((out / "metadata.json").read_text()) == mine
    # It writes nothing the reader would refuse, and never over an existing set.
    with pytest.raises(ValueError, match="already holds"):
        write_shard_set(out, docs, tok_info, shard_tokens=3000, source={})
    bad = [docs[0], docs[1][:-1]]
    with pytest.raises(ValueError, match="document 1 is not framed"):
        write_shard_set(tmp_path / "b1", bad, tok_info, shard_tokens=3000, source={})
    big = np.array([tok_info["bos_id"], tok_info["vocab_size"], tok_info["eos_id"]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_shard_set(tmp_path / "b2", [big], tok_info, shard_tokens=3000, source={})


def test_test_mode_limit_and_default_dir(prep_env, tok):
    cfg = prep_env["config"]("test_config.json", test_max_documents=40)
    p = run_stage("prepare", "--config", cfg, "--test")
    assert p.returncode == 0, p.stderr
    d = prep_env["root"] / "data" / "tokenized_datasets" / "wikipedia_test"
    meta = check_set(d, tok, prep_env["articles"])
    assert meta["totals"]["documents"] == 40 and meta["stats"]["documents_read"] == 40
    assert meta["source"]["test"] is True


# --------------------------------------------------------------------------- interrupts
# Interrupts come from the outside, at moments no hook chooses: `prepare` runs on enough text
# to work for a second or more (the news articles BIG_COPIES times, ~160 shards), a signal
# goes to its process group (router, stage and tokenizer workers, as a terminal's Ctrl-C or
# an OOM kill would) a while after its first output appears, and the same command then
# resumes. The delays are fractions of the work time of an uninterrupted reference run
# measured at the start of the module, with seeded jitter: they land mid-tokenize, mid-pack
# and mid-write. The promise checked is the same for every moment: shards recorded as done
# are the reference's shards, and the resumed set is byte-identical to the reference.
BIG_COPIES, BIG_SHARD_TOKENS = 24, 12_000
SET_FILES = ("tokens_", ".tokens_", ".progress.json")


def _start(cfg, out) -> subprocess.Popen:
    """`main.py prepare` in its own process group, default signal handling (also when the
    tests run as a background job, where SIGINT starts ignored)."""
    return subprocess.Popen([sys.executable, str(ROOT / "main.py"), "prepare", "--config", str(cfg),
                             "--output-dir", str(out), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=offline_env(),
                            preexec_fn=default_signals, start_new_session=True)


def _names(out: Path) -> list[str]:
    try:
        return [e.name for e in os.scandir(out)]
    except FileNotFoundError:
        return []


def _wait_for(proc, out: Path, ready, timeout: float = 180, interval: float = 0.002) -> Optional[float]:
    """Poll ``out`` until ``ready(names)``; the monotonic time then, or None if the run ended."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if ready(_names(out)):
            return time.monotonic()
        if proc.poll() is not None:
            return None
        time.sleep(interval)
    raise AssertionError(f"prepare wrote nothing to {out} in {timeout} s")


def _signal_when(proc, out: Path, ready, sig: int) -> list[str]:
    """Send ``sig`` to the run's process group at a moment when ``ready(names)`` holds: seen
    by polling, then checked again with the group frozen (SIGSTOP), so the moment cannot
    pass before the signal lands; if it has passed, the run goes on to the next one. Returns
    the folder's names at that moment."""
    while True:
        assert _wait_for(proc, out, ready) is not None, "the run ended before the moment to signal"
        sent = False
        try:
            os.killpg(proc.pid, signal.SIGSTOP)
            time.sleep(0.01)   # every process of the group is stopped by now
            names = _names(out)
            if ready(names):   # judged once, while frozen: after SIGCONT the run reacts to it
                os.killpg(proc.pid, sig)
                sent = True
        except ProcessLookupError:   # the run ended meanwhile: _wait_for says so
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)   # a pending SIGINT is taken now
        if sent:
            return names


def _started(names) -> bool:
    return any(n.startswith(SET_FILES) for n in names)


@pytest.fixture(scope="module")
def big_env(prep_env):
    """The large input, its config, and the uninterrupted reference run, timed from outside:
    ``work`` is the time from its first output file to its exit."""
    from tests.conftest import write_config
    root = prep_env["root"] / "big"
    cleaned = root / "cleaned"
    cleaned.mkdir(parents=True)
    arts = [f"{a} ({k})" for k in range(BIG_COPIES) for a in prep_env["articles"]]
    for i in range(3):
        part = arts[i * len(arts) // 3:(i + 1) * len(arts) // 3]
        (cleaned / f"cleaned_part{i}.txt").write_text("".join(escape_article(a) + "\n" for a in part),
                                                      encoding="utf-8")
    base = json.loads(prep_env["cfg"].read_text())
    cfg = write_config(root, {"tokenizer": base["tokenizer"], "paths": {"cleaned_dir": str(cleaned)},
                              "dataset": {"shard_tokens": BIG_SHARD_TOKENS, "window": 64, "workers": 2}})
    ref = root / "reference"
    proc = _start(cfg, ref)
    first = _wait_for(proc, ref, _started)
    _, err = proc.communicate(timeout=300)
    end = time.monotonic()
    assert proc.returncode == 0 and first is not None, err
    meta = json.loads((ref / "metadata.json").read_text())
    assert meta["totals"]["shards"] > 100 and meta["stats"]["documents_read"] == len(arts)
    return {"cfg": cfg, "ref": ref, "work": end - first, "documents": len(arts), "root": root}


def _interrupt(cfg, out: Path, sig: int, after: Callable[[subprocess.Popen, int], Optional[float]],
               attempts: int = 4) -> tuple[subprocess.Popen, str, int]:
    """Start prepare, send ``sig`` to its process group at the moment ``after(proc, attempt)`` returns
    (monotonic time; None = the run ended first), and wait. A run that completed before the
    signal (a machine faster than the measured run) is started again, and signalled sooner.
    Returns the process, its stderr and the attempt that was interrupted."""
    for attempt in range(attempts):
        shutil.rmtree(out, ignore_errors=True)
        proc = _start(cfg, out)
        at = after(proc, attempt)
        if at is not None:
            time.sleep(max(0.0, at - time.monotonic()))
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        _, err = proc.communicate(timeout=180)
        if not (out / "metadata.json").exists():
            return proc, err, attempt
    raise AssertionError(f"prepare completed before the signal in {attempts} attempts")


def _check_resume(cfg, ref: Path, out: Path, documents: int) -> None:
    """What an interrupted run left is consistent, and the same command finishes it to the
    reference's bytes."""
    progress = (json.loads((out / ".progress.json").read_text())
                if (out / ".progress.json").exists() else None)
    done = progress["shards"] if progress else []
    ref_meta = json.loads((ref / "metadata.json").read_text())
    assert len(done) < len(ref_meta["shards"])
    for s, r in zip(done, ref_meta["shards"]):   # what is recorded as done is final
        assert s == r and (out / s["file"]).read_bytes() == (ref / s["file"]).read_bytes()
    p = run_stage("prepare", "--config", cfg, "--output-dir", out)
    assert p.returncode == 0, p.stderr
    assert ("resuming" in p.stdout) == (progress is not None), p.stdout
    assert shard_bytes(out) == shard_bytes(ref)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["shards"] == ref_meta["shards"] and meta["totals"] == ref_meta["totals"]
    assert meta["stats"]["documents_read"] == documents
    assert meta["stats"]["runs"] == (2 if progress else 1)
    assert sorted(_names(out)) == sorted([s["file"] for s in meta["shards"]]
                                         + ["metadata.json", "resolved_config.json"])


_MOMENTS = [("ctrl-c", 0.10, True), ("kill-9", 0.35, True), ("ctrl-c", 0.35, False),
            ("kill-9", 0.60, False), ("ctrl-c", 0.60, True), ("kill-9", 0.85, True),
            ("ctrl-c", 0.85, True), ("kill-9", 0.10, True)]   # (signal, fraction, slow)


@pytest.mark.parametrize("how,fraction", [
    pytest.param(how, f, id=f"{how}-{round(f * 100)}pct", marks=[pytest.mark.slow] if slow else [])
    for how, f, slow in _MOMENTS])
def test_interrupted_prep_resumes_byte_identical(big_env, tmp_path, how, fraction):
    """Ctrl-C or kill -9 to the whole process group at a fraction of the measured work time
    (seeded jitter), then the same command: same bytes as the uninterrupted run."""
    sig = signal.SIGINT if how == "ctrl-c" else signal.SIGKILL
    cfg, ref, out = big_env["cfg"], big_env["ref"], tmp_path / "out"
    jitter = random.Random(f"{how}-{fraction}").uniform(-0.05, 0.05)
    delay = big_env["work"] * (fraction + jitter)

    def after(proc, attempt):
        first = _wait_for(proc, out, _started)
        return None if first is None else first + delay / 2 ** attempt

    proc, err, _ = _interrupt(cfg, out, sig, after)
    if sig == signal.SIGINT:
        assert proc.returncode == 130, err
        assert "completed work is kept" in err and "Traceback" not in err
        assert not [n for n in _names(out) if ".tmp-" in n]   # Ctrl-C cleans its temp files
    else:
        assert proc.returncode == -signal.SIGKILL, err
    if sig == signal.SIGINT and not fraction < 0.2 and (out / ".progress.json").exists():
        # Other settings on an unfinished set: refused with a pointer to --force.
        p = run_stage("prepare", "--config", cfg, "--output-dir", out, "--shard-tokens", "5000")
        assert p.returncode == 1 and "--force" in p.stderr and "shard_tokens" in p.stderr
    _check_resume(cfg, ref, out, big_env["documents"])


@pytest.mark.parametrize("writing", [
    pytest.param(r"^\.tokens_\d+\.npy\.tmp-", id="shard", marks=pytest.mark.slow),
    pytest.param(r"^\.\.progress\.json\.tmp-", id="progress-record")])
def test_kill_9_mid_write_resumes_byte_identical(big_env, tmp_path, writing):
    """kill -9 while a file is being written, seen from outside: a shard (its temp file is
    left), or the progress record after a shard (that shard is on disk but not recorded, and
    the record's temp file is left). The group is frozen (SIGSTOP) when the temp file is
    seen and killed only if it is still there, so the kill lands mid-write every time."""
    cfg, ref, out = big_env["cfg"], big_env["ref"], tmp_path / "out"
    n_ref = len(json.loads((ref / "metadata.json").read_text())["shards"])
    target = random.Random(f"mid-write-{writing}").randrange(n_ref // 4, 3 * n_ref // 4)
    temp = re.compile(writing)

    def shards_on_disk(names) -> int:
        return sum(1 for n in names if n.startswith("tokens_"))

    proc = _start(cfg, out)
    names = _signal_when(proc, out, lambda names: shards_on_disk(names) >= target
                         and any(temp.match(n) for n in names), signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    assert not (out / "metadata.json").exists()
    recorded = len(json.loads((out / ".progress.json").read_text())["shards"])
    if "progress" in writing:
        assert shards_on_disk(names) == recorded + 1   # the last shard is not recorded yet
    _check_resume(cfg, ref, out, big_env["documents"])


def test_complete_set_with_other_settings_needs_force(prep_env, tmp_path):
    cfg, out = prep_env["cfg"], tmp_path / "o"
    shutil.copytree(prep_env["ref"], out)
    # Windows are cut at read time: another window needs no rebuild.
    p = run_stage("prepare", "--config", cfg, "--output-dir", out, "--window", "128")
    assert p.returncode == 0 and "up to date" in p.stdout, p.stderr
    # Another shard size changes the bytes: refused, naming the setting, unless --force.
    p = run_stage("prepare", "--config", cfg, "--output-dir", out, "--shard-tokens", "2500")
    assert p.returncode == 1 and "shard_tokens" in p.stderr and "--force" in p.stderr
    p = run_stage("prepare", "--config", cfg, "--output-dir", out, "--shard-tokens", "2500", "--force")
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "metadata.json").read_text())["shard_tokens"] == 2500


def test_missing_input_is_exit_1(tmp_config, tmp_path):
    empty = tmp_path / "nothing"
    empty.mkdir()
    p = run_stage("prepare", "--config", tmp_config({"paths": {"cleaned_dir": str(empty)}}))
    assert p.returncode == 1
    assert str(empty) in p.stderr and "python main.py clean" in p.stderr
    assert "Traceback" not in p.stderr


# --------------------------------------------------------------------------- --force side folder
def _rebuild_names(out: Path) -> Optional[list[str]]:
    """The names in ``out/.rebuild`` (None when there is no such folder)."""
    try:
        return [e.name for e in os.scandir(out / ".rebuild")]
    except (FileNotFoundError, NotADirectoryError):
        return None


@pytest.mark.parametrize("moment", ["before-first-shard", "after-shards"])
def test_interrupted_force_rebuild_keeps_only_resumable_work(big_env, prep_env, tmp_path, moment):
    """Ctrl-C to a `prepare --force` that builds a new set beside a complete old one: the old
    set is byte-identical either way. Before the first shard is recorded the side folder
    (.rebuild/) holds nothing to resume and is removed; once shards are recorded it is kept,
    and the same --force command resumes it to the uninterrupted run's bytes."""
    cfg, ref, out = big_env["cfg"], big_env["ref"], tmp_path / "out"
    shutil.copytree(prep_env["ref"], out)          # a complete set with other settings
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    cmd = ["prepare", "--config", cfg, "--output-dir", out, "--no-progress", "--force"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), *map(str, cmd)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=offline_env(),
                            preexec_fn=default_signals, start_new_session=True)

    def ready(_names) -> bool:
        staged = _rebuild_names(out)
        if staged is None:
            return False
        if moment == "before-first-shard":
            return not any(n.startswith(SET_FILES) for n in staged)
        try:                            # written atomically; it can record no shard yet
            return bool(json.loads((out / ".rebuild" / ".progress.json").read_text()).get("shards"))
        except (FileNotFoundError, json.JSONDecodeError):
            return False

    _signal_when(proc, out, ready, signal.SIGINT)
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    if moment == "before-first-shard":
        assert _rebuild_names(out) is None
        return
    recorded = json.loads((out / ".rebuild" / ".progress.json").read_text())["shards"]
    assert recorded and "the same command resumes it" in stdout
    p = run_stage(*cmd)
    assert p.returncode == 0, p.stderr
    assert "resuming" in p.stdout and _rebuild_names(out) is None
    assert shard_bytes(out) == shard_bytes(ref)
