"""Prompt-lookup speculative decoding (utils/generation/speculative.py) against plain greedy
decoding, on SmolLM2-135M-Instruct, fp32 and int8, batch 1.

    python perf/speculative_decoding.py [--quick] [--repeats 3] [--new-tokens 128] [--k 4,8]

Two tasks through the model's chat template: ``edit`` (correct the spelling of a given
paragraph: the answer copies the prompt, prompt lookup's case) and ``free`` (write a story:
nothing to copy). Each contender (plain, and prompt lookup with k draft tokens per step) runs
the same prompt through its own ``Engine`` (kept: its decode weights), greedy, alternating
per repeat; the tokens of every contender must equal plain decoding's (a mismatch is printed).
Printed: new tokens/s min / median / max, the ratio to plain per repeat, and tokens per
forward pass (accepted drafts + 1). ``--quick``: 1 repeat, 64 new tokens, k 4, fp32 only.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SMOLLM2 = ROOT / "data" / "samples" / "smollm2" / "SmolLM2-135M-Instruct"
PARAGRAPH = ("The river valey was settled in the early ninteenth century by farmers who came from the "
             "coast. They built there houses along the banks, cleared the forrest for fields of wheat and "
             "barley, and within a generation the small villige had a mill, a school and a church. When "
             "the railway arived in 1871 the town grew quickly, and its population doubled in ten years.")
TASKS = {"edit": "Rewrite the following paragraph with its spelling mistakes corrected. Change nothing "
                 "else.\n\n" + PARAGRAPH,
         "free": "Write a short story about a lighthouse keeper who finds a message in a bottle."}


def spread(xs, fmt):
    return f"min {format(min(xs), fmt)}  median {format(statistics.median(xs), fmt)}  max {format(max(xs), fmt)}"


def passes(engine, prompt, new_tokens):
    """(tokens, forward passes, seconds) of one greedy generation of ``prompt``."""
    from utils.generation.engine import SamplingParams, Sequence
    b = engine.batcher(1, len(prompt) + new_tokens + 1)
    seq = b.add(Sequence(prompt, SamplingParams(new_tokens, temperature=0)))
    t0 = time.perf_counter()
    steps = sum(1 for _ in engine.run(b))
    return seq.tokens, steps, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", default="4,8", help="draft tokens per step, comma-separated")
    ap.add_argument("--precisions", default="fp32,int8")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 64 new tokens, k 4, fp32")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.new_tokens, a.k, a.precisions = 1, 64, "4", "fp32"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import copy
    import torch
    from utils.generation.engine import Engine
    from utils.hf.import_hf import load_hf_llama
    from utils.quant import quantize_int8
    imp = load_hf_llama(SMOLLM2)
    ks = [int(k) for k in a.k.split(",")]
    print(f"perf/speculative_decoding.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start, "
          f"torch {torch.__version__}; SmolLM2-135M-Instruct, greedy, batch 1, {a.new_tokens} new tokens, "
          f"{a.repeats} repeats, contenders alternating")
    for precision in a.precisions.split(","):
        model = imp.model
        if precision == "int8":
            model = copy.deepcopy(imp.model)
            quantize_int8(model)
        engines = {"plain": Engine(model), **{f"lookup k={k}": Engine(model, prompt_lookup=k) for k in ks}}
        for task, text in TASKS.items():
            prompt = list(imp.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      return_dict=False))
            for e in engines.values():
                passes(e, prompt, 8)                                          # warm-up
            rates = {n: [] for n in engines}
            per_pass, same = {}, {}
            for _ in range(a.repeats):
                for name, e in engines.items():
                    toks, steps, sec = passes(e, prompt, a.new_tokens)
                    rates[name].append(len(toks) / sec)
                    per_pass[name] = len(toks) / steps
                    same[name] = toks if name == "plain" else toks == same["plain"]
            print(f"\n{precision}, {task} ({len(prompt)}-token prompt):")
            for name in engines:
                extra = "" if name == "plain" else (f";  tokens equal plain's: {'yes' if same[name] else 'NO'};  "
                                                    f"ratio to plain {spread([r / p for r, p in zip(rates[name], rates['plain'])], '.2f')}")
                print(f"  {name:<12} new tokens/s {spread(rates[name], ',.1f')};  tokens per pass {per_pass[name]:.2f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
