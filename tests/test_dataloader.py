"""dataloader.py: shard windows, leak-free split, resumable DDP sampler, validation, on-the-fly.

Shard sets are written here by the real writer, utils.data.shards.write_shard_set (the pieces the
prep engine writes with; real token ids: the Llama-style SentencePiece sample tokenizer
encoding the real news sample documents as BOS + ids + EOS), so a format change fails these
tests too, yet they do not run a prep stage. Only the auto_prepare test runs one.
"""
from __future__ import annotations

import json
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import dataloader as dl
from tests.conftest import NEWS, SPM_MODEL, write_config
from utils.cli import PipelineError
from utils.config import load_config
from utils.data import shards
from utils.data.shards import ShardSetError, dtype_for_vocab, save_npy_atomic, shard_name

WINDOW = 64


# --------------------------------------------------------------------------- helpers
def write_shard_set(directory: Path, docs: list[np.ndarray], tok_info: dict, *,
                    shard_tokens: int = 20_000) -> dict:
    """The real writer (utils.data.shards.write_shard_set, the pieces the prep engine writes with)
    with this module's window and a test source: documents already BOS + ids + EOS."""
    return shards.write_shard_set(directory, docs, tok_info, shard_tokens=shard_tokens,
                                  source={"kind": "test", "inputs": [str(NEWS)], "test": True},
                                  window=WINDOW, stride=WINDOW // 2)


def framed(tok_info: dict, ids) -> np.ndarray:
    """One document as the shards store it: BOS + ids + EOS."""
    return np.asarray([tok_info["bos_id"], *ids, tok_info["eos_id"]])


def make_cfg(tmp_path: Path, shard_dir: Path, **sections):
    data = {"tokenizer": {"name": str(SPM_MODEL)},
            "dataset": {"window": WINDOW, "wikipedia_test_dir": str(shard_dir)},
            "training": {"batch_size": 8}}
    for sec, values in sections.items():
        data.setdefault(sec, {}).update(values)
    return load_config(write_config(tmp_path, data), test=True)


@pytest.fixture(scope="module")
def tok(samples):
    from utils.data.tok import load_tokenizer_from
    return load_tokenizer_from(str(SPM_MODEL))


@pytest.fixture(scope="module")
def tok_info(tok):
    from utils.data.tok import describe
    return describe(tok, str(SPM_MODEL))


@pytest.fixture(scope="module")
def news_docs(samples) -> list[str]:
    """The news documents, de-duplicated (the sample repeats 7 of them), so that windows with
    equal content are the same window in the disjointness checks below."""
    lines = [line.strip() for line in NEWS.read_text(encoding="utf-8").splitlines()]
    return list(dict.fromkeys(line for line in lines if line))


@pytest.fixture(scope="module")
def news_set(tmp_path_factory, tok, tok_info, news_docs):
    """A shard set of the 300 news documents in several ~20k-token shards."""
    ids = tok(news_docs, add_special_tokens=False)["input_ids"]
    docs = [np.asarray([tok.bos_token_id, *x, tok.eos_token_id]) for x in ids]
    d = tmp_path_factory.mktemp("shards") / "wikipedia_test"
    meta = write_shard_set(d, docs, tok_info)
    assert len(meta["shards"]) >= 3
    return d


def positions(ds: dl.ShardWindowDataset, span: int) -> dict[int, np.ndarray]:
    """shard -> boolean mask of every token position covered by some window of ds."""
    lens = [len(a) for a in ds.arrays]
    cover = {s: np.zeros(n, dtype=bool) for s, n in enumerate(lens)}
    for i in range(len(ds)):
        s, off = ds.position(i)
        assert off + span <= lens[s], "a window crosses a shard boundary"
        cover[s][off:off + span] = True
    return cover


def drain(loader, n=None):
    """Consume up to n batches (all of the epoch when n is None) without fetching one more."""
    out = []
    if n == 0:
        return out
    for x, y in loader:
        out.append((x.clone(), y.clone()))
        if n is not None and len(out) >= n:
            break
    return out


def same(a, b):
    return len(a) == len(b) and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
                                    for p, q in zip(a, b))


# --------------------------------------------------------------------------- batches
def test_batches_shape_shift_and_text(tmp_path, news_set, tok, tok_info, news_docs):
    cfg = make_cfg(tmp_path, news_set)
    train, val, info = dl.build_loaders(cfg, tok)
    x, y = next(iter(train))
    assert x.shape == y.shape == (8, WINDOW) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])                      # y is x shifted by one
    assert info["stride"] == WINDOW // 2 and info["window"] == WINDOW
    assert info["train_windows"] > 0 and info["val_windows"] > 0
    assert info["batches_per_epoch"] == len(train) == (info["train_windows"] // 8)
    vx, vy = next(iter(val))
    assert vx.shape[1] == WINDOW and torch.equal(vx[:, 1:], vy[:, :-1])
    assert "train" in dl.describe_info(info) and "val" in dl.describe_info(info)

    # Decode a window and find the original document text in it.
    ds = train.dataset
    norm = lambda s: re.sub(r"\s+", " ", s).strip()
    corpus = [norm(d) for d in news_docs]
    found = 0
    for i in range(0, len(ds), max(1, len(ds) // 20)):
        w = np.asarray(ds.window(i)).tolist()
        assert len(w) == WINDOW + 1
        pieces, cur = [], []
        for t in w:
            if t in (tok.bos_token_id, tok.eos_token_id):
                pieces.append(cur)
                cur = []
            else:
                cur.append(t)
        pieces.append(cur)
        longest = max(pieces, key=len)
        if len(longest) < 20:
            continue
        text = norm(tok.decode(longest[1:-1]))  # drop edge tokens that may be partial words
        assert any(text in d for d in corpus), text
        found += 1
    assert found >= 5


def test_to_device_cpu():
    x, y = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    a, b = dl.to_device((x, y), "cpu")
    assert torch.equal(a, x) and torch.equal(b, y)
    assert dl.to_device({"x": x}, torch.device("cpu"))["x"].device.type == "cpu"


def test_uint32_shards_carry_ids_beyond_65535(tmp_path, tok_info):
    """A vocabulary over 65,536 ids gets uint32 shards, and ids above 65,535 reach the batches
    unchanged (a uint16 shard would wrap them silently)."""
    big = dict(tok_info, vocab_size=100_000)
    assert dtype_for_vocab(big["vocab_size"]) == np.uint32
    rng = np.random.default_rng(0)
    docs = [framed(big, rng.integers(60_000, 100_000, 300)) for _ in range(20)]
    d = tmp_path / "wide"
    meta = write_shard_set(d, docs, big)
    assert meta["dtype"] == "uint32"
    assert np.load(d / meta["shards"][0]["file"], allow_pickle=False).dtype == np.uint32
    assert max(s["max_token_id"] for s in meta["shards"]) > 65_535
    train, _, _ = dl.build_loaders(make_cfg(tmp_path, d, model={"vocab_size": 100_000}), big)
    x, y = next(iter(train))
    assert int(x.max()) > 65_535 and int(x.max()) < 100_000
    allowed = set(np.concatenate(docs).tolist())
    assert set(x.flatten().tolist()) <= allowed


# --------------------------------------------------------------------------- split
def test_split_no_leakage_and_fraction(tmp_path, news_set, tok_info):
    cfg = make_cfg(tmp_path, news_set, dataset={"split_block_windows": 8})
    train, val, info = dl.build_loaders(cfg, tok_info)
    span = WINDOW + 1
    tr, va = positions(train.dataset, span), positions(val.dataset, span)
    for s in tr:
        assert not (tr[s] & va[s]).any(), f"shard {s}: a validation token appears in training"
    total = info["total_tokens"]
    val_tok = sum(int(m.sum()) for m in va.values())
    assert 0.05 < info["split"]["val_fraction"] < 0.15
    assert 0.04 < val_tok / total < 0.15
    assert info["val_tokens"] + info["train_tokens"] == total


def test_split_arithmetic_at_scale():
    """1e9 tokens: O(blocks) memory (3.5M windows, 61k blocks: a per-window index would need
    28 MB of int64), exact fraction, disjoint token ranges."""
    lengths = [100_000_000 + 7 * i for i in range(10)]
    tracemalloc.start()
    try:
        tr, va, s = dl.split_windows(lengths, window=512, stride=256, val_split=0.1, seed=42)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"split used {peak / 2**20:.1f} MB: not O(blocks)"
    assert abs(s["val_blocks"] / s["blocks"] - 0.1) < 1e-3
    assert abs(s["val_fraction"] - 0.1) < 2e-3
    assert len(tr) > 0.85 * sum(lengths) / 256
    # runs of the two splits never overlap in token ranges (blocks of one shard)
    for shard in range(10):
        iv = []
        for idx in (tr, va):
            m = idx.shards == shard
            ends = idx.starts[m] + (idx.counts[m] - 1) * idx.stride + idx.span
            iv += list(zip(idx.starts[m].tolist(), ends.tolist(), [id(idx)] * int(m.sum())))
        iv.sort()
        for (a0, a1, _), (b0, b1, _) in zip(iv, iv[1:]):
            assert a1 <= b0
    assert tr.locate(len(tr) - 1)[0] == 9


def test_split_deterministic(tmp_path, news_set, tok_info):
    cfg = make_cfg(tmp_path, news_set)
    a = dl.build_loaders(cfg, tok_info)
    b = dl.build_loaders(cfg, tok_info)
    for k in range(2):
        ia, ib = a[k].dataset.index, b[k].dataset.index
        assert np.array_equal(ia.starts, ib.starts) and np.array_equal(ia.shards, ib.shards)
    assert same(drain(a[0], 5), drain(b[0], 5))
    assert same(drain(a[1]), drain(b[1]))
    assert same(drain(a[1]), drain(b[1]))  # the validation order is fixed across evaluations
    c = dl.build_loaders(make_cfg(tmp_path, news_set, dataset={"seed": 7}), tok_info)
    assert not np.array_equal(c[1].dataset.index.starts, a[1].dataset.index.starts)


# --------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampler_resume_exact(tmp_path, news_set, tok_info, num_workers):
    cfg = make_cfg(tmp_path, news_set, training={"num_workers": num_workers})
    full, _, _ = dl.build_loaders(cfg, tok_info)
    n = len(full)
    epoch0, epoch1 = drain(full), drain(full)
    assert len(epoch0) == len(epoch1) == n > 6
    assert not same(epoch0, epoch1)  # a new permutation per epoch
    for stop in ((3, n - 1, n) if num_workers == 0 else (3,)):  # workers: slow to start
        run, _, _ = dl.build_loaders(cfg, tok_info)
        first = drain(run, stop)
        state = json.loads(json.dumps(run.state_dict()))  # survives a checkpoint round trip
        assert state["epoch"] == 0 and state["index"] == stop * 8 and state["seed"] == 42
        resumed, _, _ = dl.build_loaders(cfg, tok_info)
        resumed.load_state_dict(state)
        rest = drain(resumed)
        assert same(first + rest, epoch0)
        assert resumed.epoch == 1
        assert same(drain(resumed), epoch1)  # and the next epoch continues identically
    # across an epoch boundary: stop 2 batches into epoch 1
    run, _, _ = dl.build_loaders(cfg, tok_info)
    drain(run)
    drain(run, 2)
    state = run.state_dict()
    assert state["epoch"] == 1 and state["index"] == 16
    resumed, _, _ = dl.build_loaders(cfg, tok_info)
    resumed.load_state_dict(state)
    assert same(drain(resumed), epoch1[2:])


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 65537])
def test_index_permutation_is_a_shuffled_bijection(n):
    p0 = dl.IndexPermutation(n, seed=42, epoch=0)(np.arange(n))
    assert np.array_equal(np.sort(p0), np.arange(n))
    assert np.array_equal(p0, dl.IndexPermutation(n, seed=42, epoch=0)(np.arange(n)))
    if n >= 1000:
        p1 = dl.IndexPermutation(n, seed=42, epoch=1)(np.arange(n))
        assert not np.array_equal(p0, p1)
        assert abs(np.corrcoef(np.arange(n), p0)[0, 1]) < 0.1       # no order left
        assert abs(np.corrcoef(p0, p1)[0, 1]) < 0.1                 # epochs independent
        assert (np.abs(np.diff(p0)) > n // 100).mean() > 0.9        # neighbours scattered


def test_sampler_state_mismatch_refused():
    s = dl.ResumableSampler(100, seed=1)
    with pytest.raises(PipelineError, match="num_windows"):
        s.load_state_dict({"epoch": 0, "index": 8, "seed": 1, "num_windows": 99, "world_size": 1})


def test_ddp_slices_disjoint_and_covering(tmp_path, news_set, tok_info):
    cfg = make_cfg(tmp_path, news_set)
    n = dl.build_loaders(cfg, tok_info)[2]["train_windows"]
    for epoch in (0, 1):
        seen = []
        for r in range(2):
            s = dl.ResumableSampler(n, seed=42, rank=r, world_size=2)
            s.epoch = epoch
            seen.append(set(list(s)))
            assert len(seen[-1]) == n // 2
        assert not seen[0] & seen[1]
        assert len(seen[0] | seen[1]) == n - n % 2
    # through the loaders: ranks see different windows, same number of batches
    l0, v0, _ = dl.build_loaders(cfg, tok_info, rank=0, world_size=2)
    l1, v1, _ = dl.build_loaders(cfg, tok_info, rank=1, world_size=2)
    assert len(l0) == len(l1)
    rows = lambda batches: {tuple(r.tolist()) for x, _ in batches for r in x}
    assert not rows(drain(l0)) & rows(drain(l1))
    assert not rows(drain(v0)) & rows(drain(v1))


# --------------------------------------------------------------------------- refusal
def test_stale_set_refused_after_tokenizer_change(tmp_path, news_set, tok_info):
    cfg = make_cfg(tmp_path, news_set)
    other = dict(tok_info, fingerprint="0" * 64, name="another-tokenizer")
    with pytest.raises(ShardSetError) as e:
        dl.build_loaders(cfg, other)
    msg = str(e.value)
    assert "tokenizer.fingerprint" in msg and "python main.py prepare --test" in msg
    assert "--force" in msg and e.value.field == "tokenizer.fingerprint"


def test_incomplete_and_missing_sets_refused(tmp_path, tok_info):
    d = tmp_path / "shards"
    write_shard_set(d, [framed(tok_info, range(3, 500))] * 10, tok_info)
    # What an interrupted prep leaves: metadata.json saying complete: false.
    meta = json.loads((d / "metadata.json").read_text())
    (d / "metadata.json").write_text(json.dumps(dict(meta, complete=False)))
    cfg = make_cfg(tmp_path, d)
    with pytest.raises(ShardSetError, match="complete") as e:
        dl.build_loaders(cfg, tok_info)
    assert "python main.py prepare --test" in str(e.value)
    (d / "metadata.json").unlink()
    with pytest.raises(ShardSetError, match="metadata.json"):
        dl.build_loaders(cfg, tok_info)
    with pytest.raises(ShardSetError, match="does not exist"):
        dl.build_loaders(make_cfg(tmp_path, tmp_path / "nowhere"), tok_info)
    fw = make_cfg(tmp_path, d, dataset={"source": "fineweb", "fineweb_test_dir": str(d)})
    with pytest.raises(ShardSetError, match="python main.py fineweb --test"):
        dl.build_loaders(fw, tok_info)


def test_corrupt_shard_refused(tmp_path, tok_info):
    d = tmp_path / "shards"
    write_shard_set(d, [framed(tok_info, range(3, 500))] * 10, tok_info)
    save_npy_atomic(d / "tokens_00000.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(ShardSetError, match="tokens_00000.npy holds 10 tokens but metadata.json "
                                            "lists 4,990") as e:
        dl.build_loaders(make_cfg(tmp_path, d), tok_info)
    assert "--force" in str(e.value)


def test_vocab_too_big_refused(tmp_path, news_set, tok_info):
    cfg = make_cfg(tmp_path, news_set, model={"vocab_size": 1000})
    with pytest.raises(ShardSetError, match="model.vocab_size") as e:
        dl.build_loaders(cfg, tok_info)
    assert e.value.field == "tokenizer.vocab_size"
    dl.build_loaders(make_cfg(tmp_path, news_set, model={"vocab_size": 32000}), tok_info)


def test_too_small_for_a_batch(tmp_path, news_set, tok_info):
    cfg = make_cfg(tmp_path, news_set, training={"batch_size": 10**6})
    with pytest.raises(PipelineError, match="fewer than one batch"):
        dl.build_loaders(cfg, tok_info)


def _proc_io(key: str) -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _proc_status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_startup_reads_no_token_data(tmp_path, tok_info):
    """A 2-billion-token set of sparse files (no data on disk): construction and the first batch
    touch only headers and one window, not the 4 GB of tokens (work done, not wall-clock: the
    bytes read by syscalls and the growth of resident memory, which a scan would inflate)."""
    d = tmp_path / "big"
    d.mkdir()
    records = []
    for i in range(4):
        name = shard_name(i)
        mm = np.lib.format.open_memmap(d / name, mode="w+", dtype=np.uint16, shape=(500_000_000,))
        del mm  # sparse: only the header is written (4 GB through write_shard would be real)
        records.append({"file": name, "tokens": 500_000_000, "documents": 1, "max_token_id": 0})
    shards.write_metadata(d, shards.shard_set_metadata(
        records, dtype=np.uint16, tokenizer_info=tok_info, source={"kind": "synthetic"},
        window=512, stride=256, shard_tokens=500_000_000))
    cfg = make_cfg(tmp_path, d, dataset={"window": 512})
    rchar0, rss0 = _proc_io("rchar"), _proc_status_kb("VmRSS")
    train, val, info = dl.build_loaders(cfg, tok_info)
    x, y = next(iter(train))
    read_mb = (_proc_io("rchar") - rchar0) / 2**20
    grown_mb = (_proc_status_kb("VmRSS") - rss0) / 1024
    assert read_mb < 64, f"start-up read {read_mb:.0f} MB"
    assert grown_mb < 256, f"start-up grew resident memory by {grown_mb:.0f} MB"
    assert x.shape == (8, 512)
    assert info["train_windows"] > 7_000_000 and info["total_tokens"] == 2_000_000_000


# --------------------------------------------------------------------------- on-the-fly
@pytest.fixture
def text_sources(tmp_path, news_docs):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = news_docs[:120]
    jsonl = tmp_path / "news.jsonl"
    bad = [b"not json", b'{"text": "caf\xe9"}', b"[" * 100_000, b'{"text": 1' + b"0" * 5000 + b"}",
           b'{"text": 5}', b'["a list"]']            # not JSON / UTF-8, too deep, a 5,001-digit integer
    jsonl.write_bytes("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)).encode()
                      + b"\n".join(bad) + b"\n")
    txt = tmp_path / "cleaned_news.txt"
    txt.write_text("".join(t + "\n" for t in docs), encoding="utf-8")
    pqf = tmp_path / "pq" / "part-0.parquet"
    pqf.parent.mkdir()
    pq.write_table(pa.table({"text": docs, "language_score": [0.9] * len(docs)}), pqf,
                   row_group_size=16)
    return {"jsonl": jsonl, "txt": txt, "parquet": pqf.parent}


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet"])
def test_on_the_fly_local(tmp_path, tok, text_sources, kind):
    cfg = make_cfg(tmp_path, tmp_path / "unused",
                   dataset={"mode": "on_the_fly", "on_the_fly_source": str(text_sources[kind]),
                            "on_the_fly_batch_docs": 16})
    train, val, info = dl.build_loaders(cfg, tok)
    assert info["mode"] == "on_the_fly" and info["train_windows"] is None
    a = drain(train)
    assert train.epoch == 1
    b = drain(train)
    assert len(a) > 10 and same(a, b)  # deterministic content
    x, y = a[0]
    assert x.shape == y.shape == (8, WINDOW) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert x[0, 0] == tok.bos_token_id  # the stream starts with a document
    allx = torch.cat([p[0] for p in a])
    assert (allx == tok.bos_token_id).sum() > 5 and (allx == tok.eos_token_id).sum() > 5
    v = drain(val)
    assert len(v) >= 1
    rows = lambda batches: {tuple(r.tolist()) for x, _ in batches for r in x}
    assert not rows(a) & rows(v)
    # resume: skip the consumed batches
    t2, _, _ = dl.build_loaders(cfg, tok)
    drain(t2, 4)
    t3, _, _ = dl.build_loaders(cfg, tok)
    t3.load_state_dict(t2.state_dict())
    assert same(a[:4] + drain(t3), a)


def test_on_the_fly_ranks_disjoint(tmp_path, tok, text_sources):
    cfg = make_cfg(tmp_path, tmp_path / "unused",
                   dataset={"mode": "on_the_fly", "on_the_fly_source": str(text_sources["jsonl"])})
    rows = lambda batches: {tuple(r.tolist()) for x, _ in batches for r in x}
    r0 = rows(drain(dl.build_loaders(cfg, tok, rank=0, world_size=2)[0]))
    r1 = rows(drain(dl.build_loaders(cfg, tok, rank=1, world_size=2)[0]))
    assert r0 and r1 and not r0 & r1


def test_on_the_fly_hub_unreachable(tmp_path, tok):
    cfg = make_cfg(tmp_path, tmp_path / "unused",
                   dataset={"mode": "on_the_fly", "on_the_fly_source": "HuggingFaceFW/fineweb",
                            "on_the_fly_config": "sample-10BT"})
    with pytest.raises(PipelineError, match="local"):
        dl.build_loaders(cfg, tok)
    missing = make_cfg(tmp_path, tmp_path / "unused",
                       dataset={"mode": "on_the_fly", "on_the_fly_source": str(tmp_path / "x.jsonl")})
    with pytest.raises(PipelineError, match="does not exist"):
        dl.build_loaders(missing, tok)


# --------------------------------------------------------------------------- auto_prepare
def test_auto_prepare_with_a_relative_base_config_variable(tmp_path, tok, news_docs, monkeypatch):
    """$LLM_PIPELINE_BASE_CONFIG relative to the user's folder: the prep stage, run from the
    project's folder, looked for it there ("base.json: file not found", exit 2)."""
    cleaned = tmp_path / "cleaned"
    cleaned.mkdir()
    (cleaned / "cleaned_news.txt").write_text("".join(d + "\n" for d in news_docs), encoding="utf-8")
    (tmp_path / "base.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLM_PIPELINE_BASE_CONFIG", "base.json")
    d = tmp_path / "auto_shards"
    cfg = make_cfg(tmp_path, d, dataset={"auto_prepare": True}, paths={"cleaned_dir": str(cleaned)})
    dl.build_loaders(cfg, tok)
    assert (d / "metadata.json").exists()


def test_auto_prepare_builds_missing_set(tmp_path, tok, news_docs):
    cleaned = tmp_path / "cleaned"
    cleaned.mkdir()
    (cleaned / "cleaned_news.txt").write_text("".join(d + "\n" for d in news_docs), encoding="utf-8")
    d = tmp_path / "auto_shards"
    cfg = make_cfg(tmp_path, d, dataset={"auto_prepare": True},
                   paths={"cleaned_dir": str(cleaned)})
    train, val, info = dl.build_loaders(cfg, tok)
    assert (d / "metadata.json").exists() and info["train_windows"] > 0
    x, y = next(iter(train))
    assert x.shape == (8, WINDOW)
    # stale: metadata from another tokenizer -> rebuilt with --force
    meta = json.loads((d / "metadata.json").read_text())
    meta["tokenizer"]["fingerprint"] = "0" * 64
    (d / "metadata.json").write_text(json.dumps(meta))
    dl.build_loaders(cfg, tok)
    assert json.loads((d / "metadata.json").read_text())["tokenizer"]["fingerprint"] != "0" * 64
