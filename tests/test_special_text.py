"""Special-token strings inside documents stay text in token shards, on every encoding path.

A document that says "the tag </s> in prose and then <s> opens it again" must give exactly one
BOS and one EOS in the shards: the framing's. Driven through the CLI (`main.py prepare` and
`main.py fineweb`) with one worker (in-process encoding) and two (worker processes, whose
tokenizer is rebuilt from its JSON and lost the plain-text setting before the fix), for the
SentencePiece `.model` tokenizer of the offline config and a byte-level BPE saved as the
`tokenize --train` stage saves it. The shards' documents decode back to the literal text.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import NEWS, SPM_MODEL, run_stage, write_config
from utils.data.textio import escape_article

ARTICLES = [
    "Apples grow on trees in many parts of the world, and people have eaten them for "
    "thousands of years.",
    "The tag </s> in prose and then <s> opens it again; <unk> and <pad> are words here too, "
    "as in a tutorial about tokenizers.",
]


@pytest.fixture(scope="module")
def tokenizers_by_kind(samples, tmp_path_factory) -> dict[str, str]:
    """tokenizer.name for each kind: the .model file, and a saved byte-level BPE folder."""
    import tokenizer as stage
    docs = [ln.strip() for ln in NEWS.read_text(encoding="utf-8").splitlines() if ln.strip()]
    bpe_dir = tmp_path_factory.mktemp("bpe") / "bpe"
    stage.save_tokenizer(stage.train_bpe(docs, vocab_size=600, min_frequency=2), bpe_dir, "test")
    return {"spm": str(SPM_MODEL), "bpe": str(bpe_dir)}


def _documents(out: Path) -> tuple[list[np.ndarray], int, int]:
    import json
    meta = json.loads((out / "metadata.json").read_text())
    tok = meta["tokenizer"]
    ids = np.concatenate([np.load(out / s["file"], allow_pickle=False) for s in meta["shards"]])
    return ids, tok["bos_id"], tok["eos_id"]


def _check(out: Path, name: str) -> None:
    from utils.data.tok import load_tokenizer_from
    ids, bos, eos = _documents(out)
    assert int((ids == bos).sum()) == len(ARTICLES), ids.tolist()
    assert int((ids == eos).sum()) == len(ARTICLES), ids.tolist()
    starts = np.flatnonzero(ids == bos)
    ends = np.flatnonzero(ids == eos)
    tok = load_tokenizer_from(name)
    texts = [tok.decode(ids[s + 1:e].tolist()) for s, e in zip(starts, ends)]
    assert sorted(texts) == sorted(ARTICLES)


@pytest.mark.parametrize("workers", [1, 2], ids=["in-process", "worker-processes"])
@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_prepare_keeps_special_strings_as_text(tmp_path, tokenizers_by_kind, kind, workers):
    cleaned = tmp_path / "cleaned"
    cleaned.mkdir()
    (cleaned / "cleaned_part0.txt").write_text("".join(escape_article(a) + "\n" for a in ARTICLES),
                                              encoding="utf-8")
    name = tokenizers_by_kind[kind]
    cfg = write_config(tmp_path, {"tokenizer": {"name": name, "save_dir": str(tmp_path / "tok")},
                                  "paths": {"cleaned_dir": str(cleaned)},
                                  "dataset": {"window": 16, "shard_tokens": 1000}})
    out = tmp_path / "shards"
    p = run_stage("prepare", "--config", cfg, "--output-dir", out, "--workers", str(workers))
    assert p.returncode == 0, p.stdout + p.stderr
    _check(out, name)


@pytest.mark.parametrize("workers", [1, 2], ids=["in-process", "worker-processes"])
@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_fineweb_keeps_special_strings_as_text(tmp_path, tokenizers_by_kind, kind, workers):
    d = tmp_path / "fineweb" / "sample" / "10BT"
    d.mkdir(parents=True)
    rows = [{"text": t, "id": f"<urn:uuid:{i}>", "dump": "CC-MAIN-2024-10",
             "url": f"https://news.example/{i}", "date": "2024-02-20T00:00:00Z",
             "file_path": "s3://commoncrawl/local/0.warc.gz", "language": "en",
             "language_score": 0.95, "token_count": len(t.split())}
            for i, t in enumerate(ARTICLES)]
    pq.write_table(pa.Table.from_pylist(rows), d / "000_00000.parquet")
    name = tokenizers_by_kind[kind]
    cfg = write_config(tmp_path, {"tokenizer": {"name": name, "save_dir": str(tmp_path / "tok")},
                                  "fineweb": {"data_dir": str(tmp_path / "fineweb"), "min_tokens": 1},
                                  "dataset": {"window": 16, "shard_tokens": 1000}})
    out = tmp_path / "shards"
    p = run_stage("fineweb", "--config", cfg, "--output-dir", out, "--workers", str(workers))
    assert p.returncode == 0, p.stdout + p.stderr
    _check(out, name)


def test_every_document_encoder_is_encode_plain():
    """One function encodes document text: the prep engine, the on-the-fly loader and the
    framing all go through utils.data.tok.encode_plain (nothing else calls a batch encoder)."""
    import ast
    from tests.conftest import ROOT
    offenders = []
    for path in [*ROOT.glob("*.py"), *ROOT.glob("utils/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("encode_batch", "encode_batch_fast"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders and all(o.startswith("utils/data/tok.py:") for o in offenders), offenders


def _fake_download(error: Exception):
    def download(repo, filename):
        assert (repo, filename) == ("org/model", "tokenizer.model")
        raise error
    return download


def _remote_404():
    import httpx2
    from huggingface_hub.errors import RemoteEntryNotFoundError
    request = httpx2.Request("GET", "https://hub.invalid/org/model/resolve/main/tokenizer.model")
    return RemoteEntryNotFoundError("404 Client Error: Entry Not Found",
                                    response=httpx2.Response(404, request=request))


@pytest.mark.parametrize("error,notices", [("not-cached-offline", 1), ("no-such-file", 0)])
def test_hub_spm_lookup_falls_back_on_the_expected_errors(monkeypatch, capsys, error, notices):
    """tokenizer.model missing from the repo: None, silently (tokenizer.json is the tokenizer);
    not cached while offline: None, with one notice naming the fallback."""
    from huggingface_hub.errors import LocalEntryNotFoundError
    from utils.data import tok
    from utils.data.tok import _hub_spm_file
    exc = LocalEntryNotFoundError("not in the cache") if error == "not-cached-offline" else _remote_404()
    monkeypatch.setattr(tok, "hf_hub_download", _fake_download(exc))       # as the module imported it
    assert _hub_spm_file("org/model") is None
    err = capsys.readouterr().err
    assert err.count("notice:") == notices, err
    assert ("'org/model'" in err and "tokenizer.json" in err) == bool(notices), err


def test_hub_spm_lookup_lets_unexpected_errors_through(monkeypatch):
    from utils.data import tok
    from utils.data.tok import _hub_spm_file
    monkeypatch.setattr(tok, "hf_hub_download", _fake_download(PermissionError("cache folder not readable")))
    with pytest.raises(PermissionError, match="cache folder not readable"):
        _hub_spm_file("org/model")
