#!/usr/bin/env python3
"""The passkey study (docs/long_context.md): a small standard-attention model and an
Infini-attention model of the same size, trained the same way on CPU with passkey prompts
mixed into Wikipedia text, evaluated on the passkey grid up to 8x the training window.

    python perf/passkey_study.py [--work /tmp/passkey_study] [--steps 3000] [--window 128]
                                 [--segment 32] [--share 0.9] [--gate-lr 0.01]
                                 [--gate-weight-decay 0] [--no-delta-rule] [--samples 5]
                                 [--images docs/images]

One command, every step through the pipeline as a user runs it (``main.py train`` and
``main.py benchmark`` as subprocesses), in ``--work``:

1. a byte-level BPE tokenizer (``tokenizer.train_bpe``, 1,000 entries, every digit a token
   of its own unless ``--no-split-digits``) trained on the offline Wikipedia sample (gensim's
   enwiki dump, read by utils/data/mediawiki) and passkey prompts, so both kinds of text
   tokenize compactly;
2. one shard set (utils/data/shards) of windows exactly ``--window`` tokens long: a ``--share``
   fraction hold a passkey document — the benchmark's own prompt (utils/bench/passkey.py:
   instructions, filler, the needle, the question) with a random 5-digit key, taking a
   random ``--min-fill``..1 share of the window, followed by its answer " KEY." and EOS;
   in an ``--earlier`` fraction of them the needle ends in an earlier segment than the
   question (the key must come through the memory), else its depth is uniform — completed
   by a Wikipedia document; the rest consecutive Wikipedia tokens;
3. ``main.py train`` twice with the same data, seed, optimizer, schedule and steps: model
   ``standard`` (context ``8 x window``: RoPE reaches every evaluated length, the model only
   ever trained on ``window``) and model ``infini`` (segments of ``--segment`` tokens, gates
   with their own learning rate and weight decay); same shapes, so the same parameter count
   but for the infini model's one gate per head and layer;
4. ``main.py benchmark --tasks passkey`` on both: lengths 1x, 2x, 4x, 8x the window, depths
   0-100% in steps of 10, ``--samples`` per cell; heat maps copied to ``--images`` as
   passkey_standard.png and passkey_infini.png;
5. a summary (``summary.json`` and a markdown table on stdout): accuracy per length, the
   wall time of each training run, each infini layer's gate values (g per head).

Prints machine and date. The machine is shared: times are indicative.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ENWIKI = ROOT / "data" / "samples" / "enwiki" / "enwiki-sample-pages-articles.xml.bz2"
MODEL = {"preset": "custom", "d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4,
         "ffn_hidden": 384, "tie_embeddings": True}


def wiki_texts(limit_tokens_chars: int) -> list[str]:
    """Articles of the offline Wikipedia sample, cleaned, until about ``limit_tokens_chars``
    characters."""
    from utils.data import mediawiki
    out, total = [], 0
    with mediawiki.open_binary(ENWIKI) as f:
        for page in mediawiki.iter_xml_pages(f):
            if page.ns == 0 and not page.redirect and not mediawiki.is_redirect_text(page.text):
                text = mediawiki.wikitext_article_text(page.text, mediawiki.CleanOptions())
                if text:
                    out.append(text)
                    total += len(text)
            if total >= limit_tokens_chars:
                break
    return out


def make_tokenizer(work: Path, texts: list[str], split_digits: bool) -> Path:
    from tokenizer import train_bpe
    from utils.bench import passkey as P
    from utils.data.tok import save_tokenizer
    d = work / "tokenizer"
    if not d.exists():
        rng = random.Random(0)          # prompts in proportion to their share of the training text
        extra = [P.prompt_text(rng.randint(10_000, 99_999), rng.randint(0, 20), rng.uniform(0, 100))
                 for _ in range(len(texts) * 10)]
        how = "digits split" if split_digits else "digits merged"
        save_tokenizer(train_bpe(texts + extra, 1000, split_digits=split_digits), d,
                       f"passkey study: BPE on the enwiki sample ({how})")
    return d


def passkey_document(enc, rng: random.Random, window: int, segment: int, earlier: float,
                     min_fill: float) -> list[int]:
    """One passkey document (no BOS/EOS): the benchmark's prompt with a random 5-digit key,
    then its answer " KEY.". The prompt takes a random share (``min_fill`` .. 1) of the
    window, so the question lands in different segments; with probability ``earlier`` the
    needle's last token is in an earlier segment than the question's last token (the answer
    then needs the memory, for an infini model), else the depth is uniform."""
    from utils.bench import passkey as P
    key = rng.randint(10_000, 99_999)
    answer = enc(f" {key}.")
    # BOS + prompt + answer + EOS, then at least BOS + EOS of Wikipedia: within one window
    budget = rng.randint(int(min_fill * window), window - len(answer) - 3)
    needle = P.needle(key)
    must_split = rng.random() < earlier
    for _ in range(20):
        depth = rng.uniform(0, 100)
        text, _, n = (P.fit(lambda t: 1 + len(enc(t)), key, depth, budget)
                      or P.fit(lambda t: 1 + len(enc(t)), key, depth, window - len(answer) - 3))
        needle_end = len(enc(text[:text.index(needle) + len(needle)]))    # its position (BOS at 0)
        if not must_split or needle_end // segment < (n - 1) // segment:
            break
    return enc(text) + answer


def make_shards(work: Path, tok_dir: Path, texts: list[str], a, n_windows: int) -> Path:
    """Documents of exactly ``a.window`` tokens: passkey documents (a share ``a.share`` of the
    windows, each completed by a Wikipedia document) and Wikipedia alone."""
    import numpy as np
    from utils.data.shards import write_shard_set
    from utils.data.tok import describe, load_tokenizer_from
    out = work / "shards"
    if (out / "metadata.json").exists():
        return out
    tok = load_tokenizer_from(str(tok_dir))
    bos, eos = tok.bos_token_id, tok.eos_token_id
    enc = lambda t: tok.encode(t, add_special_tokens=False)   # noqa: E731
    wiki = np.concatenate([np.asarray(x) for x in tok(texts, add_special_tokens=False)["input_ids"]])
    rng = random.Random(a.seed)
    window, docs, n_passkey, pos = a.window, [], 0, 0

    def wiki_tokens(n):
        nonlocal pos
        if pos + n > len(wiki):
            pos = 0
        pos += n
        return [int(x) for x in wiki[pos - n:pos]]

    for _ in range(n_windows):
        if rng.random() < a.share:
            doc = [bos] + passkey_document(enc, rng, window, a.segment, a.earlier, a.min_fill) + [eos]
            docs.append(np.asarray(doc))
            docs.append(np.asarray([bos] + wiki_tokens(window - len(doc) - 2) + [eos]))
            n_passkey += 1
        else:
            docs.append(np.asarray([bos] + wiki_tokens(window - 2) + [eos]))
    assert sum(len(d) for d in docs) == n_windows * window
    write_shard_set(out, docs, describe(tok, str(tok_dir)), shard_tokens=10_000_000,
                    source={"kind": "passkey_study", "inputs": [str(ENWIKI)], "passkey_share": a.share,
                            "passkey_documents": n_passkey})
    return out


def write_configs(work: Path, tok_dir: Path, shards: Path, a) -> dict[str, Path]:
    base = {
        "paths": {"root": str(work), "samples_dir": str(ROOT / "data" / "samples")},
        "tokenizer": {"name": str(tok_dir)},
        "dataset": {"source": "wikipedia", "wikipedia_full_dir": str(shards), "window": a.window,
                    "stride": a.window, "val_split": 0.02, "seed": a.seed},
        "model": {**MODEL, "max_seq_len": 8 * a.window},
        "training": {"max_steps": a.steps, "batch_size": a.batch, "lr": a.lr, "min_lr": a.lr / 10,
                     "warmup_steps": max(1, a.steps // 20), "weight_decay": a.weight_decay, "seed": a.seed,
                     "eval_steps": max(1, a.steps // 5), "eval_batches": 8, "sample_tokens": 0,
                     "checkpoint_every": a.checkpoint_every or a.steps,
                     "keep_checkpoints": 1000 if a.checkpoint_every else 0, "device": "cpu",
                     "dtype": "fp32"},
        "logging": {"log_every": 50, "tensorboard": False},
        "benchmark": {"passkey_lengths": [a.window * k for k in (1, 2, 4, 8)],
                      "passkey_depths": list(range(0, 101, 10)), "seed": a.seed, "device": "cpu"},
    }
    infini = {"model": {"attention": "infini", "segment_length": a.segment, "max_seq_len": a.window,
                        "infini_gate": a.gate, "infini_delta_rule": not a.no_delta_rule},
              "training": {"gate_lr": a.gate_lr, "gate_weight_decay": a.gate_weight_decay}}
    files = {"base": work / "base.json", "infini": work / "infini.json"}
    files["base"].write_text(json.dumps(base, indent=2))
    files["infini"].write_text(json.dumps(infini, indent=2))
    return files


def stage(*args, log: Path, threads: int) -> float:
    """``main.py ARGS`` with its output in ``log``, on ``threads`` intra-op threads; returns
    the wall time."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", LLM_PIPELINE_BASE_CONFIG="none",
               OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(ROOT / "main.py"), *map(str, args)], stdout=f,
                              stderr=subprocess.STDOUT, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        sys.exit(f"main.py {' '.join(map(str, args[:3]))} failed ({proc.returncode}): see {log}")
    return time.perf_counter() - t0


def gates_of(checkpoint: Path) -> list[list[float]]:
    from utils.infini import gate_value
    from utils.run import load_checkpoint
    ck = load_checkpoint(checkpoint, "weights")
    kind = ck["model_args"]["infini_gate"]
    return [[round(float(x), 3) for x in gate_value(v.float(), kind)]
            for k, v in ck["model"].items() if k.endswith("memory.beta")]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/passkey_study"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1, help="of both models' matrices")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--segment", type=int, default=32)
    ap.add_argument("--share", type=float, default=0.9, help="fraction of passkey windows")
    ap.add_argument("--gate", default="hard_sigmoid", choices=["hard_sigmoid", "sigmoid", "tanh"])
    ap.add_argument("--gate-lr", type=float, default=0.01)
    ap.add_argument("--gate-weight-decay", type=float, default=0.0)
    ap.add_argument("--no-delta-rule", action="store_true")
    ap.add_argument("--split-digits", action=argparse.BooleanOptionalAction, default=True,
                    help="the study's BPE makes every digit a token (a key is always 5 tokens)")
    ap.add_argument("--earlier", type=float, default=0.9, help="fraction of passkey documents "
                    "whose needle ends in an earlier segment than the question")
    ap.add_argument("--min-fill", type=float, default=0.5, help="shortest passkey prompt, as a "
                    "fraction of the window (lengths are uniform up to the whole window)")
    ap.add_argument("--checkpoint-every", type=int, default=None, help="also keep a numbered "
                    "checkpoint every N steps (learning curves)")
    ap.add_argument("--samples", type=int, default=5, help="passkey samples per cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="standard,infini")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of each stage (a "
                    "tiny model on a shared machine runs best on one)")
    ap.add_argument("--images", type=Path, default=None, help="copy the heat maps here")
    return ap.parse_args()


def train_models(a, files: dict[str, Path]) -> tuple[dict[str, float], dict[str, Path]]:
    """Both trainings at once (each on ``a.threads`` threads: a 2-core machine runs two
    one-thread trainings in about the time of one): wall seconds and checkpoint per model."""
    from concurrent.futures import ThreadPoolExecutor
    names = a.models.split(",")
    ckpts = {}
    for name in names:
        run_dir = a.work / "checkpoints" / name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        ckpts[name] = run_dir / "checkpoint_latest.pt"

    def train(name):
        layers = ["--config", files["base"]] + (["--config", files["infini"]] if name == "infini" else [])
        seconds = stage("train", *layers, "--name", name, log=a.work / f"train_{name}.log",
                        threads=a.threads)
        print(f"trained {name} in {seconds:.0f} s", flush=True)
        return seconds
    with ThreadPoolExecutor(len(names)) as pool:
        times = dict(zip(names, pool.map(train, names)))
    return times, ckpts


def evaluate(a, files: dict[str, Path], ckpts: dict[str, Path], times: dict[str, float]) -> dict:
    """The passkey grid on every model: the summary (accuracy per length, grids, heat maps,
    gates), written to ``summary.json``; heat maps copied to ``a.images``."""
    out = a.work / "results"
    t1 = time.perf_counter()
    stage("benchmark", "--config", files["base"], "--tasks", "passkey", "--limit", f"passkey={a.samples}",
          "--output-dir", out, *ckpts.values(), log=a.work / "benchmark.log", threads=a.threads)
    result = json.loads(sorted(out.glob("benchmark_*[0-9].json"))[-1].read_text())
    summary = {"settings": {k: str(v) for k, v in vars(a).items()}, "train_seconds": times,
               "benchmark_seconds": time.perf_counter() - t1, "models": {}}
    for m, name in zip(result["models"], ckpts):
        r = m["results"]["passkey"]
        g = r["grid"]
        per_length = {}
        for c, L in enumerate(g["lengths"]):
            col = [row[c] for row in g["acc"]]
            per_length[L] = None if any(v is None for v in col) else sum(col) / len(col)
        summary["models"][name] = {"parameters": m["identity"]["parameters"], "per_length": per_length,
                                   "grid": g, "heatmap": r["heatmap"],
                                   "gates": gates_of(ckpts[name]) if name == "infini" else None}
        if a.images:
            a.images.mkdir(parents=True, exist_ok=True)
            shutil.copy(r["heatmap"], a.images / f"passkey_{name}.png")
    (a.work / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def print_summary(a, summary: dict) -> None:
    """The markdown table (accuracy per length) and each infini layer's gates."""
    times = summary["train_seconds"]
    lengths = next(iter(summary["models"].values()))["grid"]["lengths"]
    print("\n| model | parameters | train time | " + " | ".join(f"{L} tokens" for L in lengths) + " |")
    print("|---|---|---|" + "---|" * len(lengths))
    for name, s in summary["models"].items():
        cells = ["n/a" if s["per_length"][L] is None else f"{100 * s['per_length'][L]:.0f}%" for L in lengths]
        print(f"| {name} | {s['parameters']:,} | {times[name] / 60:.1f} min | " + " | ".join(cells) + " |")
    if "infini" in summary["models"]:
        print("\ngates g per head, by layer (infini):")
        for i, row in enumerate(summary["models"]["infini"]["gates"]):
            print(f"  layer {i}: {row}")
    print(f"\nbenchmark {summary['benchmark_seconds']:.0f} s; summary in {a.work / 'summary.json'}")


def main() -> int:
    a = parse_args()
    import torch
    from perf.machine import cpu_model
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
          f"torch {torch.__version__}; date {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"settings: {json.dumps({k: str(v) for k, v in vars(a).items()})}", flush=True)
    a.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    texts = wiki_texts(12_000_000)
    tok_dir = make_tokenizer(a.work, texts, a.split_digits)
    windows = int(a.steps * a.batch * 1.1 / 0.98) + 64
    shards = make_shards(a.work, tok_dir, texts, a, windows)
    files = write_configs(a.work, tok_dir, shards, a)
    print(f"data: {windows} windows of {a.window} tokens ({a.share:.0%} passkey) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    times, ckpts = train_models(a, files)
    print_summary(a, evaluate(a, files, ckpts, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
