"""utils/data/shards.py: reading a shard set is validation (issue 9 section 4).

Every set here is written by the real writer: the `prepare` stage's own entry point
(``dataset_prep.main``, i.e. utils.data.packing) on the real news sample documents, so a format
change in the writer or in the reader fails these tests. Malformed sets are that set with
one defect added, one test per class of defect: each must be refused with a clear
ShardSetError (exit code 1 through the CLI) naming the file and the rebuild command, never a
traceback, never numpy's advice to load with allow_pickle, never a deleted file.
"""
from __future__ import annotations

import json
import pickle
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import NEWS, ROOT, SPM_MODEL, offline_env, write_config
from utils.data.shards import (METADATA_FILE, ShardSetError, load_shards, open_shard, read_metadata,
                          read_npy_header, rebuild_command, save_npy_atomic, validate_metadata)

REBUILD = "python main.py prepare --test"


# --------------------------------------------------------------------------- the real writer
def news_documents() -> list[str]:
    """The 300 news documents of the offline sample, de-duplicated (it repeats 7)."""
    lines = [line.strip() for line in NEWS.read_text(encoding="utf-8").splitlines()]
    return list(dict.fromkeys(line for line in lines if line))


def prep_config(root: Path, tokenizer: Path, shard_tokens: int = 20_000, **sections) -> Path:
    """A tmp-rooted config for `prepare --test` over the news documents, written as cleaned
    articles (the prep stage's input format), with the given tokenizer."""
    from utils.data.textio import escape_article
    cleaned = root / "cleaned"
    cleaned.mkdir(parents=True, exist_ok=True)
    (cleaned / "cleaned_news.txt").write_text(
        "".join(escape_article(d) + "\n" for d in news_documents()), encoding="utf-8")
    data = {"tokenizer": {"name": str(tokenizer)}, "paths": {"cleaned_dir": str(cleaned)},
            "dataset": {"shard_tokens": shard_tokens, "workers": 1, "window": 64}}
    for sec, values in sections.items():
        data.setdefault(sec, {}).update(values)
    return write_config(root, data)


def build_real_set(root: Path, out: Path, tokenizer: Path, shard_tokens: int = 20_000,
                   **sections) -> dict:
    """Build a shard set with the prepare stage's own main (in process); returns its metadata."""
    import dataset_prep
    cfg_file = prep_config(root, tokenizer, shard_tokens, **sections)
    code = dataset_prep.main(["--config", str(cfg_file), "--test", "--output-dir", str(out),
                              "--no-progress"])
    assert code in (0, None)
    return json.loads((out / METADATA_FILE).read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def saved_tok(tmp_path_factory, samples) -> Path:
    """The sample Llama-style SentencePiece tokenizer, loaded as the pipeline loads it and saved
    as a tokenizer folder (what `tokenize` leaves under tokenizers/; fast to load in the CLI
    runs below)."""
    from utils.data.tok import load_tokenizer_from
    d = tmp_path_factory.mktemp("tokenizer") / "mistral-v1"
    load_tokenizer_from(str(SPM_MODEL)).save_pretrained(str(d))
    return d


@pytest.fixture(scope="session")
def real_set(tmp_path_factory, saved_tok) -> Path:
    """The news documents as a real shard set (several ~20k-token shards). Do not modify:
    copy it with :func:`copy_set`."""
    root = tmp_path_factory.mktemp("real_set")
    out = root / "wikipedia_test"
    meta = build_real_set(root, out, saved_tok)
    assert len(meta["shards"]) >= 3
    return out


def copy_set(real_set: Path, tmp_path: Path) -> Path:
    d = tmp_path / "set"
    shutil.copytree(real_set, d)
    return d


def snapshot(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def open_set(d: Path, **kw) -> list[np.ndarray]:
    meta = read_metadata(d, REBUILD)
    validate_metadata(meta, d, rebuild=REBUILD)
    return load_shards(d, meta, rebuild=REBUILD, **kw)


def refused(d: Path, *needles: str, field: str | None = None, **kw) -> ShardSetError:
    """Opening ``d`` is refused with a message that names the file and the rebuild command,
    contains every needle and never numpy's pickle advice; nothing in ``d`` changes."""
    before = snapshot(d)
    with pytest.raises(ShardSetError) as e:
        open_set(d, **kw)
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert REBUILD in msg
    assert "allow_pickle" not in msg and "pickle.load" not in msg
    if field is not None:
        assert e.value.field == field
    assert snapshot(d) == before, "a refused set was modified"
    return e.value


def meta_of(d: Path) -> dict:
    return json.loads((d / METADATA_FILE).read_text(encoding="utf-8"))


def put_meta(d: Path, meta: dict) -> None:
    (d / METADATA_FILE).write_text(json.dumps(meta), encoding="utf-8")


# --------------------------------------------------------------------------- the good case
def test_real_set_opens_and_matches_writer(real_set):
    meta = meta_of(real_set)
    arrays = open_set(real_set)
    assert len(arrays) == len(meta["shards"])
    for a, s in zip(arrays, meta["shards"]):
        assert isinstance(a, np.memmap) and a.dtype == np.uint16 and a.ndim == 1
        assert len(a) == s["tokens"]
        ref = np.load(real_set / s["file"], allow_pickle=False)
        assert np.array_equal(np.asarray(a), ref)
        if "max_token_id" in s:
            assert s["max_token_id"] == int(ref.max())


# --------------------------------------------------------------------------- malformed files
def test_truncated_header_refused(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    p = d / "tokens_00001.npy"
    p.write_bytes(p.read_bytes()[:40])
    refused(d, str(p), "truncated or damaged .npy header", field="shards")


def test_truncated_data_refused(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    p = d / "tokens_00000.npy"
    p.write_bytes(p.read_bytes()[:-10])
    refused(d, str(p), "is truncated")


def test_trailing_bytes_refused(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    p = d / "tokens_00000.npy"
    p.write_bytes(p.read_bytes() + b"\0\0\0\0")
    refused(d, str(p), "4 bytes after")


class _Payload:
    """Unpickling this would create a marker file: proof that no pickle is ever loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_object_array_refused_and_never_unpickled(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    marker = tmp_path / "payload_ran"
    p = d / "tokens_00000.npy"
    arr = np.array([_Payload(marker), 1, 2], dtype=object)
    with open(p, "wb") as f:
        np.save(f, arr, allow_pickle=True)
    assert not marker.exists()
    refused(d, str(p), "Python objects")
    assert not marker.exists(), "the loader unpickled a shard"


@pytest.mark.parametrize("content", ["raw_tokens", "pickle", "empty", "text"])
def test_not_an_npy_file_refused(real_set, tmp_path, content):
    d = copy_set(real_set, tmp_path)
    p = d / "tokens_00002.npy"
    data = {"raw_tokens": np.arange(1, 5000, dtype=np.uint16).tobytes(),
            "pickle": pickle.dumps([1, 2, 3]), "empty": b"",
            "text": b"hello world\n" * 10}[content]
    p.write_bytes(data)
    refused(d, str(p), "is empty (0 bytes)" if content == "empty" else "not a NumPy .npy file")


@pytest.mark.parametrize("shape,order", [((2, 500), "C"), ((2, 500), "F"), ((1, 1000), "C"), ((), "C")])
def test_not_one_dimensional_refused(real_set, tmp_path, shape, order):
    d = copy_set(real_set, tmp_path)
    p = d / "tokens_00000.npy"
    arr = np.arange(int(np.prod(shape)), dtype=np.uint16).reshape(shape)
    arr = np.asfortranarray(arr) if order == "F" else arr
    with open(p, "wb") as f:   # np.save as is (save_npy_atomic would make it C-ordered, >= 1-D)
        np.lib.format.write_array(f, arr, allow_pickle=False)
    assert read_npy_header(p).fortran_order == (order == "F" and len(shape) > 1)
    refused(d, str(p), f"{len(shape)}-D array")


@pytest.mark.parametrize("dtype", ["int64", "int32", "int16", "uint8", "uint64", "float32",
                                   "float64", "bool", ">u2", ">u4", "complex64"])
def test_dtype_outside_contract_refused(real_set, tmp_path, dtype):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    s = meta["shards"][0]
    p = d / s["file"]
    arr = np.load(p, allow_pickle=False)
    with open(p, "wb") as f:   # np.save keeps a non-native byte order as given
        np.lib.format.write_array(f, arr.astype(np.dtype(dtype)), allow_pickle=False)
    refused(d, str(p), "shards hold uint16 or uint32")


def test_structured_dtype_refused(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    p = d / "tokens_00000.npy"
    save_npy_atomic(p, np.zeros(10, dtype=[("a", "<u2"), ("b", "<u2")]))
    refused(d, str(p), "structured dtype")


def test_file_dtype_must_match_metadata(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    p = d / meta["shards"][1]["file"]
    save_npy_atomic(p, np.load(p, allow_pickle=False).astype(np.uint32))
    refused(d, str(p), "holds uint32 but metadata.json says uint16")


def test_length_must_match_metadata(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    p = d / meta["shards"][0]["file"]
    save_npy_atomic(p, np.load(p, allow_pickle=False)[:-3])
    refused(d, str(p), f"holds {meta['shards'][0]['tokens'] - 3:,} tokens")


def test_every_bad_shard_named_at_once(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    a, b = d / "tokens_00000.npy", d / "tokens_00002.npy"
    a.write_bytes(b"")
    b.write_bytes(b.read_bytes()[:50])
    e = refused(d, str(a), str(b))
    assert "2 bad shard file(s)" in str(e)


def test_listed_shard_missing_refused(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    (d / "tokens_00001.npy").unlink()
    refused(d, "tokens_00001.npy", "missing", field="shards")


# --------------------------------------------------------------------------- token ids
def _set_ids(p: Path, fn) -> None:
    arr = np.load(p, allow_pickle=False).copy()
    fn(arr)
    save_npy_atomic(p, arr)


def test_recorded_max_token_id_beyond_vocab_refused(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    vocab = meta["tokenizer"]["vocab_size"]
    meta["shards"][1]["max_token_id"] = vocab
    put_meta(d, meta)
    refused(d, "tokens_00001.npy", f"holds token id {vocab} (max_token_id in metadata.json)",
            f"{vocab:,} ids")


def test_recorded_max_token_id_means_no_scan(real_set, tmp_path, capsys):
    """With max_token_id recorded, a shard's ids are not read: an id beyond the vocabulary
    hidden in the data (but not in the record) passes here; the record was checked at prep."""
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    for s in meta["shards"]:
        s["max_token_id"] = int(np.load(d / s["file"], allow_pickle=False).max())
    put_meta(d, meta)
    _set_ids(d / "tokens_00000.npy", lambda a: a.__setitem__(5, 40000))
    assert len(open_set(d)) == len(meta["shards"])
    assert "scan" not in capsys.readouterr().err
    # ... and the batches that reach it stop training naming the shard (an IndexError in the
    # model's embedding before), at ~10 us a batch
    from dataloader import ShardWindowDataset, split_windows
    train_idx, _, _ = split_windows([s["tokens"] for s in meta["shards"]], window=64, stride=32,
                                    val_split=0.0, seed=0, block_windows=64)
    ds = ShardWindowDataset([d / s["file"] for s in meta["shards"]], train_idx, None,
                            meta["tokenizer"]["vocab_size"])
    assert ds.index.locate(0) == (0, 0)                       # window 0 holds position 5
    for fetch in (lambda: ds.__getitems__([3, 0]), lambda: ds[0]):
        with pytest.raises(ShardSetError, match=r"tokens_00000\.npy: holds token id 40,000, outside"):
            fetch()
    ds.__getitems__([1, 2])                                  # windows without it are served


def test_ids_beyond_vocab_found_by_scan_when_not_recorded(real_set, tmp_path, capsys):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    for s in meta["shards"]:
        s.pop("max_token_id", None)
    put_meta(d, meta)
    vocab = meta["tokenizer"]["vocab_size"]
    _set_ids(d / "tokens_00002.npy", lambda a: a.__setitem__(len(a) // 2, vocab + 7))
    refused(d, "tokens_00002.npy", f"holds token id {vocab + 7} (found by a scan)")


def test_scan_when_not_recorded_is_reported(real_set, tmp_path, capsys):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    for s in meta["shards"]:
        s.pop("max_token_id", None)
    put_meta(d, meta)
    assert len(open_set(d)) == len(meta["shards"])
    err = capsys.readouterr().err
    total = sum(s["tokens"] for s in meta["shards"])
    assert f"records no max_token_id for {len(meta['shards'])} shard(s)" in err
    assert f"scan of {total:,} tokens" in err


def test_uint16_cannot_hold_a_large_vocabulary(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    meta["tokenizer"]["vocab_size"] = 70_000
    put_meta(d, meta)
    with pytest.raises(ShardSetError, match="uint16 cannot hold") as e:
        validate_metadata(meta, d, rebuild=REBUILD)
    assert e.value.field == "dtype"


# --------------------------------------------------------------------------- unlisted files
def test_unlisted_shard_file_warned(real_set, tmp_path, capsys):
    d = copy_set(real_set, tmp_path)
    n = len(meta_of(d)["shards"])
    shutil.copyfile(d / "tokens_00000.npy", d / f"tokens_{n + 3:05d}.npy")
    (d / "stray.npy").write_bytes(b"x")
    assert len(open_set(d)) == n
    err = capsys.readouterr().err
    assert "warning:" in err and f"tokens_{n + 3:05d}.npy" in err and "stray.npy" in err
    assert "2 .npy file(s) that metadata.json does not list" in err


def test_no_warning_for_a_clean_set(real_set, capsys):
    open_set(real_set)
    assert "warning" not in capsys.readouterr().err


# --------------------------------------------------------------------------- metadata
def test_metadata_wrong_types_all_named_at_once(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    meta["dtype"] = "int64"
    meta["tokenizer"]["vocab_size"] = "32000"
    meta["tokenizer"]["bos_id"] = 1.5
    meta["tokenizer"]["fingerprint"] = None
    meta["shards"][0]["tokens"] = -5
    meta["shards"][1]["file"] = "../../outside.npy"
    meta["shards"][2]["documents"] = True
    meta["totals"] = []
    put_meta(d, meta)
    e = refused(d, "dtype", "tokenizer.vocab_size", "tokenizer.bos_id", "tokenizer.fingerprint",
                "shards[0].tokens", "shards[1].file", "shards[2].documents", "totals",
                "8 field(s)", str(d / METADATA_FILE), field="metadata")
    assert e.auto_rebuild is False


def test_header_and_body_fields_of_the_wrong_type_all_named_at_once(real_set, saved_tok, tmp_path):
    """format_version, complete and body fields wrong together: one refusal names them all,
    in the library and through a CLI that opens the set (before: only format_version)."""
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    meta["format_version"] = "1"
    meta["complete"] = "yes"
    meta["dtype"] = 5
    meta["window"] = "512"
    meta["shards"][0]["tokens"] = "many"
    del meta["tokenizer"]["fingerprint"]
    put_meta(d, meta)
    needles = ['format_version is "1"', 'complete is "yes"', "dtype is 5", 'window is "512"',
               'shards[0].tokens is "many"', "tokenizer.fingerprint is null", "6 field(s)"]
    e = refused(d, *needles, str(d / METADATA_FILE), field="metadata")
    assert e.auto_rebuild is False
    proc = subprocess.run([sys.executable, str(ROOT / "dataloader.py"), "--test", "--config",
                           str(prep_config(tmp_path, saved_tok)), "--shards", str(d), "--window",
                           "32", "--batch-size", "4"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=offline_env())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)


def test_a_lone_header_problem_keeps_its_own_message(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    meta["complete"] = False
    put_meta(d, meta)
    e = refused(d, "complete is false, not true (an interrupted prep)", field="complete")
    assert e.auto_rebuild is True


@pytest.mark.parametrize("change,needle", [
    (lambda m: m.update(shards=[]), "shards is [], expected a non-empty list"),
    (lambda m: m.update(shards={"file": "tokens_00000.npy"}), "shards is {"),
    (lambda m: m["shards"].append(dict(m["shards"][0])), "is listed twice"),
    (lambda m: m["shards"][0].update(max_token_id="12"), "shards[0].max_token_id"),
    (lambda m: m["shards"][0].update(file="metadata.json"), "shards[0].file"),
    (lambda m: m.update(tokenizer="mistral"), "tokenizer is \"mistral\""),
    (lambda m: m["totals"].update(tokens=1), "totals.tokens is 1 but the shards list"),
])
def test_metadata_shape_problems_named(real_set, tmp_path, change, needle):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    change(meta)
    put_meta(d, meta)
    refused(d, needle, field="metadata")


@pytest.mark.parametrize("value,field", [(True, "format_version"), (2, "format_version"),
                                         ("1", "format_version")])
def test_format_version_must_be_the_integer_one(real_set, tmp_path, value, field):
    d = copy_set(real_set, tmp_path)
    meta = meta_of(d)
    meta["format_version"] = value
    put_meta(d, meta)
    refused(d, "format_version", field=field)


@pytest.mark.parametrize("raw,needle", [
    (b"", "is empty"),
    (b"   \n", "is empty"),
    (b'{"format": ', "is not valid JSON"),
    (b"\xff\xfe{\x00}", "is not UTF-8"),
    (b"[1, 2, 3]", "holds a JSON list"),
    (b'{"format": "a", "format": "b"}', "duplicated key"),
    (b'{"format": NaN}', "NaN is not valid JSON"),
    (b"[" * 100_000, "is not valid JSON"),
])
def test_unreadable_metadata_is_reported_never_deleted(real_set, tmp_path, raw, needle):
    d = copy_set(real_set, tmp_path)
    (d / METADATA_FILE).write_bytes(raw)
    e = refused(d, needle, str(d / METADATA_FILE), "Nothing was changed or deleted",
                field="metadata.json")
    assert e.auto_rebuild is False


def test_metadata_that_cannot_be_opened(real_set, tmp_path):
    d = copy_set(real_set, tmp_path)
    (d / METADATA_FILE).unlink()
    (d / METADATA_FILE).mkdir()   # a folder in its place: unreadable even as root
    e = refused(d, "cannot be read", field="metadata.json")
    assert e.auto_rebuild is False


# --------------------------------------------------------------------------- open_shard itself
def test_open_shard_maps_without_reading(tmp_path):
    """The header is parsed from the first bytes; the tokens are mapped, not read: a 1 GB
    sparse shard opens and its pages are not resident afterwards."""
    p = tmp_path / "tokens_00000.npy"
    mm = np.lib.format.open_memmap(p, mode="w+", dtype=np.uint16, shape=(500_000_000,))
    del mm
    arr = open_shard(p, "uint16", 500_000_000)
    assert isinstance(arr, np.memmap) and len(arr) == 500_000_000
    assert mapped_rss_kb([p]) < 256


def mapped_rss_kb(paths) -> int:
    """Resident kB of this process's memory mappings of ``paths`` (/proc/self/smaps): the pages
    of those files that have actually been touched through a memory map."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("needs Linux /proc/self/smaps to count touched pages")
    names = {str(Path(p).resolve()) for p in paths}
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                current = len(parts) >= 6 and parts[5] in names
            elif current and parts and parts[0] == "Rss:":
                total += int(parts[1])
    return total


# --------------------------------------------------------------------------- rebuild command
def test_rebuild_command_is_pasteable():
    assert rebuild_command("wikipedia", True) == "python main.py prepare --test"
    assert rebuild_command("fineweb", False) == "python main.py fineweb"
    cmd = rebuild_command("wikipedia", True, config_file="/tmp/my cfg.json", output_dir="/d/x y")
    assert shlex.split(cmd) == ["python", "main.py", "prepare", "--test", "--config",
                                "/tmp/my cfg.json", "--output-dir", "/d/x y"]


def test_cli_refusal_names_file_and_pasted_command_rebuilds(real_set, saved_tok, tmp_path):
    """Through the CLI a damaged set is exit 1 with one paragraph (no traceback, no pickle
    advice); the command it prints, pasted, rebuilds that set with the same config and
    tokenizer, and the loader then accepts it."""
    d = copy_set(real_set, tmp_path)
    bad = d / "tokens_00001.npy"
    bad.write_bytes(np.arange(1, 3000, dtype=np.uint16).tobytes())   # raw dump renamed .npy
    cfg_file = prep_config(tmp_path, saved_tok)
    run = lambda *a: subprocess.run([sys.executable, str(ROOT / "dataloader.py"), "--test",
                                     "--config", str(cfg_file), "--shards", str(d), "--window",
                                     "32", "--batch-size", "4", *a], capture_output=True,
                                    text=True, timeout=300, cwd=ROOT, env=offline_env())
    proc = run()
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "allow_pickle" not in proc.stderr
    assert str(bad) in proc.stderr and "not a NumPy .npy file" in proc.stderr
    line = next(l for l in proc.stderr.splitlines() if "rebuild it with: " in l)
    cmd = shlex.split(line.split("rebuild it with: ", 1)[1].rstrip("."))
    assert cmd[:4] == ["python", "main.py", "prepare", "--test"] and cmd[-1] == "--force"
    assert cmd[cmd.index("--config") + 1] == str(cfg_file)
    assert cmd[cmd.index("--output-dir") + 1] == str(d)
    rebuilt = subprocess.run([sys.executable, *cmd[1:]], capture_output=True, text=True,
                             timeout=300, cwd=ROOT, env=offline_env())
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    shards = lambda s: {k: v for k, v in s.items() if k.endswith(".npy")}
    assert shards(snapshot(d)) == shards(snapshot(real_set))   # the same set, byte for byte
    ok = run("--show", "1")
    assert ok.returncode == 0, ok.stderr
    assert "first training batch: x (4, 32)" in ok.stdout
