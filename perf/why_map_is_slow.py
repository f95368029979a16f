"""Why the seeds/003 `datasets.map` recipe is slow: one thread, the same text, three ways.

    python perf/why_map_is_slow.py [--mb 20]

perf/prep_throughput.py shows the recipe (c) far behind the engine. This script isolates the
tokenizer call it makes. On one thread (TOKENIZERS_PARALLELISM=false), on the same cleaned
Wikipedia text (the corpus prep_throughput builds, in batches of 1,000 documents as the
recipe's map uses), it times:

  (1) ``encode_batch_fast`` on the list of documents (what the prep engine's workers run);
  (2) ``tokenizer(list_of_documents)`` through transformers (the seeds/002 "old way" call);
  (3) ``tokenizer(eos.join(documents), return_tensors="pt")``: the recipe's call, the whole
      batch as ONE string; then (4) its chunking into 512-token Python lists.

If (3) is far slower than (1) and (2) on one thread, the recipe's cost is in tokenizing each
batch as one giant sequence, not in worker processes fighting the tokenizer's thread pool.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import perf.prep_throughput as P  # noqa: E402  (corpus and tokenizer set-up, shared)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=20.0, help="MB of cleaned text")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines, origin = P.cleaned_lines(tmp)
        corpus = tmp / "corpus"
        corpus.mkdir()
        P.build_corpus(lines, a.mb, corpus)
        texts = P.read_texts(corpus)
    tok = P.load_tok()
    batches = [texts[i:i + P.BATCH] for i in range(0, len(texts), P.BATCH)]
    backend = tok.backend_tokenizer

    t = time.perf_counter()
    n = sum(len(e.ids) for b in batches for e in backend.encode_batch_fast(b, add_special_tokens=False))
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    for b in batches:
        tok(b)["input_ids"]
    t2 = time.perf_counter() - t
    t = time.perf_counter()
    joined = [tok(tok.eos_token.join(b), truncation=False, return_tensors="pt")["input_ids"][0]
              for b in batches]
    t3 = time.perf_counter() - t
    t = time.perf_counter()
    for ids in joined:
        [ids[i:i + P.CONTEXT].tolist() for i in range(0, len(ids), P.CONTEXT)]
    t4 = time.perf_counter() - t

    print(f"why_map_is_slow: {P.machine_info()}")
    print(f"text: {sum(map(len, texts)) / 1e6:.1f} MB, {len(texts):,} documents in {len(batches)} "
          f"batch(es) of up to {P.BATCH}; {origin}; one thread; {n:,} tokens")
    print(f"  (1) encode_batch_fast(list of documents)       {t1:7.2f} s  {n / t1:>12,.0f} tok/s")
    print(f"  (2) tokenizer(list of documents)               {t2:7.2f} s  {n / t2:>12,.0f} tok/s")
    print(f"  (3) tokenizer(EOS-joined batch as one string)  {t3:7.2f} s  {n / t3:>12,.0f} tok/s"
          f"   ({t3 / t1:.1f}x the time of (1))")
    print(f"  (4) chunking (3) into {P.CONTEXT}-token lists          {t4:7.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
