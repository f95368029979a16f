"""`fineweb` (fineweb_prep.py, same engine as `prepare`): FineWeb parquet -> token shards.

FineWeb itself is not available offline. The parquet files here have FineWeb's schema (text,
id, dump, url, date, file_path, language, language_score, token_count) filled locally: the
text is real (the 300 news documents of the offline sample, plus short real snippets cut
from them to exercise the min-token filter), while the other columns (ids, urls, dumps,
language scores with some below 0.65, whitespace-word token counts) are made up here.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import NEWS, SPM_MODEL, run_stage
from tests.test_prep import documents, saved_tokenizer, shard_bytes, tok  # noqa: F401 (fixtures)

MIN_SCORE, MIN_TOKENS, SHARD_TOKENS = 0.65, 100, 4000


def fineweb_rows() -> list[dict]:
    docs = [ln.strip() for ln in NEWS.read_text(encoding="utf-8").splitlines() if ln.strip()]
    texts = []
    for i, d in enumerate(docs):
        texts.append(d)
        if i % 10 == 0:
            texts.append(" ".join(d.split()[:12]))    # a short real snippet (< 100 tokens)
    rows = []
    for i, t in enumerate(texts):
        rows.append({"text": t, "id": f"<urn:uuid:{i:08d}-local>", "dump": "CC-MAIN-2024-10",
                     "url": f"https://news.example/{i}", "date": "2024-02-20T00:00:00Z",
                     "file_path": f"s3://commoncrawl/local/{i // 100:05d}.warc.gz", "language": "en",
                     "language_score": 0.5 if i % 7 == 3 else 0.9 + (i % 10) / 100,
                     "token_count": len(t.split())})
    return rows


@pytest.fixture
def parquet_dir(tmp_path) -> tuple[Path, list[dict]]:
    rows = fineweb_rows()
    d = tmp_path / "fineweb" / "sample" / "10BT"
    d.mkdir(parents=True)
    half = len(rows) // 2
    for i, part in enumerate((rows[:half], rows[half:])):
        table = pa.Table.from_pylist(part)
        pq.write_table(table, d / f"{i:03d}_00000.parquet", row_group_size=40)
    return tmp_path / "fineweb", rows


@pytest.fixture
def fw_config(tmp_config, parquet_dir, saved_tokenizer):  # noqa: F811
    def make(**fineweb):
        fw = {"data_dir": str(parquet_dir[0]), "workers": 2, "min_language_score": MIN_SCORE,
              "min_tokens": MIN_TOKENS, **fineweb}
        return tmp_config({"tokenizer": {"name": str(SPM_MODEL), "save_dir": str(saved_tokenizer)},
                           "fineweb": fw, "dataset": {"shard_tokens": SHARD_TOKENS, "window": 64}})
    return make


def expected(rows, tok):  # noqa: F811
    n_tok = [len(e.ids) for e in tok.backend_tokenizer.encode_batch([r["text"] for r in rows],
                                                                   add_special_tokens=False)]
    low = [r["language_score"] < MIN_SCORE for r in rows]
    short = [not lo and n < MIN_TOKENS for lo, n in zip(low, n_tok)]
    kept = [r["text"] for r, lo, sh in zip(rows, low, short) if not lo and not sh]
    return sum(low), sum(short), kept


def test_fineweb_filters_metadata_and_workers_determinism(fw_config, parquet_dir, tmp_path, tok):  # noqa: F811
    cfg = fw_config()
    out2, out1 = tmp_path / "w2", tmp_path / "w1"
    p = run_stage("fineweb", "--config", cfg, "--output-dir", out2, "--workers", "2")
    assert p.returncode == 0, p.stderr
    from utils.data.shards import load_shards, read_metadata
    meta = read_metadata(out2, "python main.py fineweb")
    rows = parquet_dir[1]
    n_low, n_short, kept = expected(rows, tok)
    assert n_low > 10 and n_short > 10
    s = meta["stats"]
    assert s["documents_read"] == len(rows) and s["documents_kept"] == len(kept)
    assert s["dropped_by_reason"] == {"language_score": n_low, "min_tokens": n_short}
    assert meta["source"]["kind"] == "fineweb" and len(meta["source"]["inputs"]) == 2
    assert meta["source"]["filters"] == {"min_language_score": MIN_SCORE, "min_tokens": MIN_TOKENS}
    assert meta["truncated"] is False and meta["dtype"] == "uint16"
    arrays = load_shards(out2, meta)
    decoded = [tok.decode(d[1:-1].tolist()) for a in arrays
               for d in documents(np.asarray(a), tok.bos_token_id, tok.eos_token_id)]
    assert decoded == kept
    assert meta["totals"]["tokens"] == sum(len(a) for a in arrays)
    p = run_stage("fineweb", "--config", cfg, "--output-dir", out1, "--workers", "1", "--batch-size", "13")
    assert p.returncode == 0, p.stderr
    assert shard_bytes(out1) == shard_bytes(out2)


def test_max_files_cap_and_test_mode(fw_config, tmp_path):
    cfg = fw_config(test_max_documents=120)
    p = run_stage("fineweb", "--config", cfg, "--test", "--max-files", "2")
    assert p.returncode == 0, p.stderr
    d = tmp_path / "data" / "tokenized_datasets" / "fineweb_test"
    meta = json.loads((d / "metadata.json").read_text())
    assert meta["totals"]["shards"] == 2 == len(list(d.glob("tokens_*.npy")))
    assert meta["truncated"] is True and meta["stats"]["stopped_at_max_files"] is True
    assert meta["stats"]["documents_read"] < 120 and meta["source"]["test"] is True
    assert "max-files" in p.stdout


def test_parquet_stream_resumes_at_any_row(parquet_dir):
    from fineweb_prep import parquet_files, parquet_stream
    files = parquet_files(parquet_dir[0])
    open_stream = parquet_stream(files, "text", MIN_SCORE)
    full = list(open_stream(0))
    assert len(full) == len(parquet_dir[1])
    for start in (1, 39, 40, 41, len(full) // 2, len(full) - 1, len(full)):
        assert list(open_stream(start)) == full[start:]


def test_hub_without_network_points_to_data_dir(tmp_config):
    p = run_stage("fineweb", "--config", tmp_config({"tokenizer": {"name": str(SPM_MODEL)}}))
    assert p.returncode == 1
    assert "--data-dir" in p.stderr and "HuggingFaceFW/fineweb" in p.stderr
    assert "Traceback" not in p.stderr


def test_hub_streaming_path_resumes_from_saved_stream_state(parquet_dir, tmp_config, saved_tokenizer,  # noqa: F811
                                                            tmp_path):
    """The streaming (hub) code path, run offline on a local dataset folder: an interrupted run
    restores the stream from its saved state (not by reading it again) and ends byte-identical."""
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT, default_signals, offline_env
    from tests.test_prep import _signal_when
    from utils.config import load_config

    fw = {"dataset": str(parquet_dir[0]), "config_name": None, "workers": 2,
          "min_language_score": MIN_SCORE, "min_tokens": MIN_TOKENS, "batch_size": 20}
    cfg = tmp_config({"tokenizer": {"name": str(SPM_MODEL), "save_dir": str(saved_tokenizer)},
                      "fineweb": fw, "dataset": {"shard_tokens": SHARD_TOKENS, "window": 64}})

    # Unit: a checkpoint taken mid-stream restores exactly there.
    from fineweb_prep import hub_stream
    open_stream = hub_stream(load_config(cfg))
    full = list(open_stream(0))
    assert len(full) == len(parquet_dir[1])
    it = open_stream(0)
    for _ in range(57):
        next(it)
    state = it.checkpoint()
    assert list(open_stream(60, {"position": 57, "state": state})) == full[60:]

    # End to end through main.py: reference run, then an interrupted run and its resume.
    ref, out = tmp_path / "ref", tmp_path / "out"
    p = run_stage("fineweb", "--config", cfg, "--output-dir", ref)
    assert p.returncode == 0, p.stderr
    assert "huggingface streaming" in p.stdout
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "fineweb", "--config", str(cfg),
                             "--output-dir", str(out), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=offline_env(), preexec_fn=default_signals, start_new_session=True)

    def two_shards_recorded(names) -> bool:
        try:
            return len(json.loads((out / ".progress.json").read_text())["shards"]) >= 2
        except (OSError, ValueError, KeyError):
            return False
    _signal_when(proc, out, two_shards_recorded, signal.SIGINT)   # Ctrl-C from outside, no hook
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    progress = json.loads((out / ".progress.json").read_text())
    assert progress["stream_resume"]["state"] is not None
    assert progress["stream_resume"]["position"] <= progress["consumed"]
    p = run_stage("fineweb", "--config", cfg, "--output-dir", out)
    assert p.returncode == 0, p.stderr
    assert "restoring the saved stream position" in p.stdout
    assert shard_bytes(out) == shard_bytes(ref)
    assert (json.loads((out / "metadata.json").read_text())["stats"]["documents_read"]
            == len(parquet_dir[1]))
