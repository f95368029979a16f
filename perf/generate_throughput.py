"""Generation throughput: the generation engine's KV-cache decoding (utils/generation/engine.py) against transformers' ``generate``.

    python perf/generate_throughput.py [--repeats 3] [--new-tokens 128] [--prompt-len 32]
                                       [--size 7m] [--batches 1,8]

Same weights on both sides (ours copied into LlamaForCausalLM with utils.hf.mapping.to_hf_state_dict,
attn "sdpa"), fp32, greedy, the same random prompts, EOS disabled so every row produces
exactly ``--new-tokens`` tokens. Timed region: one whole ``generate`` call (prefill + decode),
after one warm-up call; new tokens/s = batch x new tokens / seconds (also per CPU-second
of the process, which other processes' load disturbs less). Both contenders run in
one process, alternating per repeat, with the same threads; min / median / max over repeats.
The outputs are compared too: greedy decoding of the same weights must give the same tokens
(a mismatch is printed, since a fast wrong answer is worth nothing).

``--threads N`` sets the process's intra-op threads for both contenders (default: torch's
own, one per core). Our generation additionally runs a small model's small steps (fewer
than 2^26 weights, at most 2^28 multiply-adds: every 7m step here but the batch-8 prefill) on
one thread, see ``Engine.step_threads``; ``--threads 1`` therefore compares the code alone,
both sides on one thread.

Batch 1 also times the interactive path: inference.py's ``Session.generate`` (what ``main.py
infer`` runs per prompt: ``Engine.stream`` plus incremental detokenization and a text
callback per token) with the sample Mistral tokenizer (32k vocabulary, the same size),
reporting its time to first token (prompt in, first token out, prefill included) and its
new tokens/s, next to ``generate``'s, so the streaming layer's cost is visible.

``--smollm2``: SmolLM2-135M-Instruct at batch 1 against llama.cpp (llama-cpp-python's
``Llama``, in this process, ``--llama-threads`` threads) on the same weights (the sample's
Q4_1 GGUF imported once, as perf/serve_throughput.py --smollm2 does, and exported by
``main.py export`` as f32 and q8_0 GGUF): ours fp32 and int8 by the engine's rules (decode
threads chosen by measurement, utils/generation/threads.py ``DecodeThreads``), ours with the
decode steps fixed on all threads (the rule before), llama.cpp f32 and q8_0; then a prompt
whose answer copies it (an edit) with prompt-lookup speculative decoding
(utils/generation/speculative.py) against plain decoding and llama.cpp; with ``--compile``
also ours with the compiled decode step (compile time printed). All contenders alternate per
repeat; each prints new tokens/s (64 new tokens, greedy, min / median / max) and its ratio to
llama.cpp at the same precision, and ours its fraction of the machine's memory-bandwidth
bound (bytes of weights read per token / read bandwidth measured here). ``--quick``: 1
repeat, 32 new tokens.
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
VOCAB = 32_000
SIZES = {"7m": dict(d_model=192, n_layers=4, n_heads=6, n_kv_heads=2),
         "50m": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4)}


def spread(xs, fmt):
    return (f"min {format(min(xs), fmt)}  median {format(statistics.median(xs), fmt)}  "
            f"max {format(max(xs), fmt)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--size", default="7m", choices=sorted(SIZES))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M at batch 1 against llama.cpp")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "smollm2")
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="--smollm2: also the compiled decode step")
    ap.add_argument("--quick", action="store_true", help="--smollm2: 1 repeat, 32 new tokens")
    a = ap.parse_args()
    if a.smollm2:
        from perf.smollm2_decode import smollm2_batch1
        return smollm2_batch1(a)

    import torch
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    import model as M
    import utils.hf.mapping as H
    from utils.generation.engine import Engine
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    torch.manual_seed(0)
    args = M.ModelArgs(vocab_size=VOCAB, max_seq_len=a.prompt_len + a.new_tokens,
                       tie_embeddings=True, **SIZES[a.size])
    ours = M.create_model(args).eval()
    hf = LlamaForCausalLM(H.hf_config(args)).eval()
    hf.config._attn_implementation = "sdpa"
    hf.load_state_dict(H.to_hf_state_dict(ours), strict=False)
    hf.tie_weights()
    print(f"perf/generate_throughput.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads (ours: 1 per small step); {a.size} model "
          f"({sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M params), fp32, greedy, "
          f"prompt {a.prompt_len} tokens, {a.new_tokens} new tokens, {a.repeats} repeats")

    engine = Engine(ours)               # kept across calls, as infer keeps it (its decode weights)
    g = torch.Generator().manual_seed(1)
    for batch in [int(b) for b in a.batches.split(",")]:
        prompts = torch.randint(3, VOCAB, (batch, a.prompt_len), generator=g)

        def run_ours():
            return engine.generate(prompts.tolist(), max_new_tokens=a.new_tokens, temperature=0.0)

        def run_hf():
            with torch.no_grad():
                out = hf.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
            return out[:, a.prompt_len:].tolist()

        same = run_ours() == run_hf()   # also the warm-up
        t_ours, t_hf, c_ours, c_hf = [], [], [], []
        for _ in range(a.repeats):
            for fn, wall, cpu in ((run_ours, t_ours, c_ours), (run_hf, t_hf, c_hf)):
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        n = batch * a.new_tokens
        r_ours, r_hf = [n / t for t in t_ours], [n / t for t in t_hf]
        print(f"\nbatch {batch}: identical greedy tokens: {'yes' if same else 'NO'}")
        print(f"  ours  new tokens/s {spread(r_ours, ',.0f')}")
        print(f"  HF    new tokens/s {spread(r_hf, ',.0f')}")
        print(f"  ratio ours/HF      {spread([o / h for o, h in zip(r_ours, r_hf)], '.2f')}")
        print(f"  new tokens per CPU-second (all threads; less sensitive to other load): "
              f"ours {statistics.median(n / c for c in c_ours):,.0f}, HF {statistics.median(n / c for c in c_hf):,.0f}, "
              f"ratio {spread([h / o for o, h in zip(c_ours, c_hf)], '.2f')}")
        if batch == 1:
            interactive(engine, a, run_ours)
    return 0


def interactive(engine, a, run_ours) -> None:
    """Batch 1 through inference.Session.generate (streaming + detokenizing) vs generate."""
    import types
    import inference
    from utils.data.tok import load_tokenizer_from
    tok_dir = ROOT / "data" / "samples" / "tokenizers" / "mistral-v1"
    if not tok_dir.exists():
        print(f"  interactive path: skipped ({tok_dir} is missing; run `make samples`)")
        return
    tok = load_tokenizer_from(str(tok_dir))
    session = inference.Session.__new__(inference.Session)
    session.cfg, session.raw, session.err = None, False, sys.stderr
    loaded = inference.Loaded(Path("perf"), "perf", engine.model, "pretrain", None, 0, tok, engine)
    words = "the history of the river valley and the people who lived near it " * 8
    text = tok.decode(tok(words, add_special_tokens=False)["input_ids"][:a.prompt_len - 1])
    params = inference.Params(max_new_tokens=a.new_tokens, temperature=0.0, top_k=0, top_p=1.0)
    shown = []
    note = types.SimpleNamespace(lines=[])
    session.generate(loaded, text, params, shown.append, note.lines.append)   # warm-up
    ttft, rate, plain = [], [], []
    for _ in range(a.repeats):
        shown.clear()
        _, st = session.generate(loaded, text, params, shown.append, note.lines.append)
        ttft.append(st.ttft * 1e3)
        rate.append(st.tokens / st.seconds)
        t0 = time.perf_counter()
        run_ours()
        plain.append(a.new_tokens / (time.perf_counter() - t0))
    print(f"  interactive (inference.Session.generate: stream + detokenize, "
          f"{len(tok(text, add_special_tokens=False)['input_ids']) + 1}-token prompt):")
    print(f"    time to first token ms {spread(ttft, ',.1f')}")
    print(f"    new tokens/s           {spread(rate, ',.0f')}")
    print(f"    generate() tokens/s    {spread(plain, ',.0f')}  (interleaved with the above)")
    print(f"    ratio interactive/generate {spread([r / p for r, p in zip(rate, plain)], '.2f')}")


if __name__ == "__main__":
    sys.exit(main())
