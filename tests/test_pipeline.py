"""End to end through main.py on the offline sample, the way the demo and a user run it:
clean the real enwiki XML dump -> save the tokenizer -> prepare shards -> load batches, then
a tokenizer change makes the shard set stale (refused) and auto_prepare rebuilds it."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, SPM_MODEL, offline_env, run_stage
from utils.config import load_config
from utils.data.textio import iter_articles


def run_loader(cfg, *args):
    return subprocess.run([sys.executable, str(ROOT / "dataloader.py"), "--config", str(cfg), *args],
                          capture_output=True, text=True, timeout=300, env=offline_env())


def test_clean_prepare_load_then_stale_and_auto_prepare(tmp_path, tmp_config, samples):
    cfg = tmp_config({"tokenizer": {"name": str(SPM_MODEL)},
                      "wikipedia": {"raw_dir": str(samples / "enwiki")},
                      "dataset": {"window": 64, "shard_tokens": 200_000},
                      "training": {"batch_size": 4}})
    # 1. clean (real MediaWiki XML) and save the tokenizer under tmp/tokenizers/
    p = run_stage("clean", "--config", cfg, "--test")
    assert p.returncode == 0, p.stderr
    cleaned = sorted((tmp_path / "data" / "cleaned_articles").glob("cleaned_*.txt"))
    assert [c.name for c in cleaned] == ["cleaned_enwiki-sample-pages-articles.txt"]
    articles = list(iter_articles(cleaned))
    assert len(articles) == 106
    p = run_stage("tokenize", "--config", cfg)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "tokenizers" / "mistral-v1" / "tokenizer.json").exists()

    # 2. prepare (test mode) -> a complete shard set describing itself
    p = run_stage("prepare", "--config", cfg, "--test")
    assert p.returncode == 0, p.stderr
    shard_dir = tmp_path / "data" / "tokenized_datasets" / "wikipedia_test"
    assert (shard_dir / "metadata.json").exists()
    assert len(list(shard_dir.glob("tokens_*.npy"))) >= 2

    # 3. load batches the way the trainer will, and find a window's text in the articles
    p = run_loader(cfg, "--test")
    assert p.returncode == 0, p.stderr
    assert "first training batch: x (4, 64) torch.int64, y (4, 64) torch.int64" in p.stdout
    assert "(y is x shifted left by one: True)" in p.stdout

    import dataloader
    from utils.data.tok import load_tokenizer
    c = load_config(cfg, test=True)
    tok = load_tokenizer(c)
    train, val, info = dataloader.build_loaders(c, tok)
    assert info["train_windows"] > 0 and info["val_windows"] > 0
    x, y = next(iter(train))
    corpus = "\n".join(articles)
    found = 0
    for row in x:
        pieces = tok.decode(row.tolist()).replace("<s>", "</s>").split("</s>")
        longest = max(pieces, key=len)
        core = longest[len(longest) // 4: 3 * len(longest) // 4]  # away from cut-off token edges
        if len(core) > 20:
            assert core in corpus, core
            found += 1
    assert found >= 2

    # 4. a different tokenizer makes the set stale: refused with the field and the fix ...
    p = run_stage("tokenize", "--config", cfg, "--train", "--vocab-size", "800",
                 "--input", tmp_path / "data" / "cleaned_articles")
    assert p.returncode == 0, p.stderr
    bpe = tmp_path / "tokenizers" / "bpe"
    stale_cfg = tmp_config({"tokenizer": {"name": str(bpe)},
                            "wikipedia": {"raw_dir": str(samples / "enwiki")},
                            "dataset": {"window": 64, "shard_tokens": 200_000},
                            "training": {"batch_size": 4}}, name="stale.json")
    p = run_loader(stale_cfg, "--test")
    assert p.returncode == 1
    assert "stale shard set: tokenizer.fingerprint" in p.stderr
    assert "python main.py prepare --test" in p.stderr and "Traceback" not in p.stderr

    # ... and with dataset.auto_prepare the loader rebuilds it first (the seed's token cache).
    auto_cfg = tmp_config({"tokenizer": {"name": str(bpe)},
                           "wikipedia": {"raw_dir": str(samples / "enwiki")},
                           "dataset": {"window": 64, "shard_tokens": 200_000, "auto_prepare": True},
                           "training": {"batch_size": 4}}, name="auto.json")
    p = run_loader(auto_cfg, "--test")
    assert p.returncode == 0, p.stderr
    import json
    meta = json.loads((shard_dir / "metadata.json").read_text())
    assert meta["tokenizer"]["name"].endswith("bpe") and meta["tokenizer"]["vocab_size"] == 800
