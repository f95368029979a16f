"""`prepare` (dataset_prep.py + utils/packing.py): cleaned articles -> token shards.

Inputs are real text: the 300 news documents of the offline sample (NEWS), written as
cleaned-article files (one escaped article per line, as the cleaner writes them) with
paragraph breaks inserted between sentences. The tokenizer is the Llama-style SentencePiece
sample (SPM_MODEL), saved once as a fast tokenizer the way `main.py tokenize` would, so each
stage run does not convert it again. Small shard_tokens make many shards.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import NEWS, ROOT, SPM_MODEL, offline_env, run_main
from utils.textio import escape_article, unescape_article

SHARD_TOKENS = 3000


@pytest.fixture(scope="session")
def saved_tokenizer(samples, tmp_path_factory) -> Path:
    """The SPM sample converted once and saved as tokenizer.json (what `tokenize` does)."""
    from utils.tok import load_tokenizer_from
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
    p = run_main("prepare", "--config", cfg, "--output-dir", ref, "--workers", "2")
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
    from utils.shards import FORMAT_NAME, FORMAT_VERSION, load_shards, read_metadata, validate_metadata
    from utils.tok import describe
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
    """utils.textio: paragraph breaks and backslashes survive the one-line-per-article format."""
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
    from utils.packing import encode_frame
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
    p = run_main("prepare", "--config", cfg, "--output-dir", out1, "--workers", "1", "--batch", "7")
    assert p.returncode == 0, p.stderr
    assert shard_bytes(out1) == shard_bytes(ref)
    # A second run finds it complete.
    p = run_main("prepare", "--config", cfg, "--output-dir", out1, "--workers", "1")
    assert p.returncode == 0 and "up to date" in p.stdout


def test_shard_writer_is_the_engines_format(prep_env, tmp_path):
    """utils.shards.write_shard_set (what the loader and train tests write their sets with)
    fed the engine's own documents writes the engine's bytes and shard records."""
    from utils.shards import write_shard_set
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
    p = run_main("prepare", "--config", cfg, "--test")
    assert p.returncode == 0, p.stderr
    d = prep_env["root"] / "data" / "tokenized_datasets" / "wikipedia_test"
    meta = check_set(d, tok, prep_env["articles"])
    assert meta["totals"]["documents"] == 40 and meta["stats"]["documents_read"] == 40
    assert meta["source"]["test"] is True


def _start(cfg, out, **env):
    return subprocess.Popen([sys.executable, str(ROOT / "main.py"), "prepare", "--config", str(cfg),
                             "--output-dir", str(out), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=offline_env(**env), start_new_session=True)


def _wait_for_shards(out: Path, n: int, proc, timeout: float = 60) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if len(json.loads((out / ".progress.json").read_text())["shards"]) >= n:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("prep did not get going")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_interrupted_prep_resumes_byte_identical(prep_env, tmp_path, sig):
    """Ctrl-C (the whole process group, like a terminal) or kill -9 mid-run, then re-run."""
    cfg, ref, out = prep_env["cfg"], prep_env["ref"], tmp_path / "out"
    # LLM_PREP_TEST_SHARD_DELAY (test hook, utils/packing.py) slows the run down between shards.
    proc = _start(cfg, out, LLM_PREP_TEST_SHARD_DELAY="0.25")
    _wait_for_shards(out, 3, proc)
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130, err
        assert "interrupted" in err
    else:
        assert proc.returncode == -signal.SIGKILL
        # A crash can leave a shard written but not yet recorded, and a temp file.
        progress = json.loads((out / ".progress.json").read_text())
        (out / f"tokens_{len(progress['shards']):05d}.npy").write_bytes(b"half-written")
        (out / ".tokens_00042.npy.tmp-12345").write_bytes(b"junk")
    assert not (out / "metadata.json").exists()
    done = json.loads((out / ".progress.json").read_text())["shards"]
    assert 3 <= len(done) < len(shard_bytes(ref))
    if sig == signal.SIGINT:   # other settings: refused with a pointer to --force
        p = run_main("prepare", "--config", cfg, "--output-dir", out, "--shard-tokens", "5000")
        assert p.returncode == 1 and "--force" in p.stderr and "shard_tokens" in p.stderr
    # The same command resumes and ends with the same bytes.
    p = run_main("prepare", "--config", cfg, "--output-dir", out)
    assert p.returncode == 0, p.stderr
    assert "resuming" in p.stdout
    assert shard_bytes(out) == shard_bytes(ref)
    meta, ref_meta = (json.loads((d / "metadata.json").read_text()) for d in (out, ref))
    assert meta["shards"] == ref_meta["shards"] and meta["totals"] == ref_meta["totals"]
    assert meta["stats"]["documents_read"] == 300 and meta["stats"]["runs"] == 2
    assert not list(out.glob(".*tmp*"))


def test_complete_set_with_other_settings_needs_force(prep_env, tmp_path):
    import shutil
    cfg, out = prep_env["cfg"], tmp_path / "o"
    shutil.copytree(prep_env["ref"], out)
    # Windows are cut at read time: another window needs no rebuild.
    p = run_main("prepare", "--config", cfg, "--output-dir", out, "--window", "128")
    assert p.returncode == 0 and "up to date" in p.stdout, p.stderr
    # Another shard size changes the bytes: refused, naming the setting, unless --force.
    p = run_main("prepare", "--config", cfg, "--output-dir", out, "--shard-tokens", "2500")
    assert p.returncode == 1 and "shard_tokens" in p.stderr and "--force" in p.stderr
    p = run_main("prepare", "--config", cfg, "--output-dir", out, "--shard-tokens", "2500", "--force")
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "metadata.json").read_text())["shard_tokens"] == 2500


def test_missing_input_is_exit_1(tmp_config, tmp_path):
    empty = tmp_path / "nothing"
    empty.mkdir()
    p = run_main("prepare", "--config", tmp_config({"paths": {"cleaned_dir": str(empty)}}))
    assert p.returncode == 1
    assert str(empty) in p.stderr and "python main.py clean" in p.stderr
    assert "Traceback" not in p.stderr
