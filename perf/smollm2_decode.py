"""SmolLM2-135M-Instruct decoding at batch 1 against llama.cpp in one process: the
``--smollm2`` mode of perf/generate_throughput.py (its docstring says what is measured)."""
from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
EDIT = ("Rewrite the following paragraph with its spelling mistakes corrected. Change nothing else.\n\n"
        "The river valey was settled in the early ninteenth century by farmers who came from the coast. "
        "They built there houses along the banks, cleared the forrest for fields of wheat and barley, and "
        "within a generation the small villige had a mill, a school and a church.")


def spread(xs, fmt):
    return f"min {format(min(xs), fmt)}  median {format(statistics.median(xs), fmt)}  max {format(max(xs), fmt)}"


def read_bandwidth() -> float:
    """Bytes/s this machine's torch reads on all threads: the best of 5 reads of 256 MiB of
    fp32, each read by a sum and by a one-row product over column panels (how the fp32 decode
    pack streams its weights, utils/generation/cpu.py), whichever is faster."""
    import torch
    from utils.generation.cpu import panel_mm, panels
    x = torch.ones(1 << 26)
    w = panels(x.view(4096, 1 << 14), torch.get_num_threads())
    row = torch.ones(1, 4096)
    best = float("inf")
    for _ in range(5):
        for read in (x.sum, lambda: panel_mm(row, w)):
            t0 = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter's and buffer's storage once, but
    the embedding table when it is not also the head (a step reads one row of it)."""
    emb = model.tok_embeddings.weight
    tied = getattr(model.lm_head, "weight", None) is emb
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        if (t is emb and not tied) or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def llama_generator(gguf: Path, threads: int, prompt_ids: list[int]):
    """``gen(n)``: llama.cpp's first ``n`` greedy tokens after ``prompt_ids`` (the cache reset first)."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(gguf), n_threads=threads, n_ctx=512, verbose=False, logits_all=False)

    def gen(n: int) -> list[int]:
        llm.reset()
        out = []
        for t in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            out.append(t)
            if len(out) == n:
                break
        return out
    return gen


def llama_runner(gguf: Path, threads: int, prompt_ids: list[int], n: int):
    gen = llama_generator(gguf, threads, prompt_ids)
    return lambda: gen(n)


def ours_runner(engine, prompt_ids: list[int], n: int):
    def run():
        return engine.generate([prompt_ids], n, temperature=0)[0]
    return run


def interleave(runs: dict, repeats: int, n: int) -> tuple[dict, dict]:
    rates, outs = {k: [] for k in runs}, {}
    for r in runs.values():
        r()                                                            # warm-up
    for _ in range(repeats):
        for k, r in runs.items():
            t0 = time.perf_counter()
            outs[k] = r()
            rates[k].append(len(outs[k]) / (time.perf_counter() - t0))
    return rates, outs


def smollm2_models(cache: Path) -> tuple:
    """(fp32 model, int8 copy, tokenizer, {"f32": GGUF, "q8_0": GGUF}) of SmolLM2-135M-Instruct:
    imported once into ``cache`` from the shipped sample (no download) and exported once."""
    import copy
    from perf.serve_throughput import SMOLLM2_GGUF, exported_gguf, smollm2_run
    from utils.config import load_config
    from utils.quant import quantize_int8
    from utils.run import load_model_and_tokenizer
    cache.mkdir(parents=True, exist_ok=True)
    sample = ROOT / "data" / "samples" / "smollm2" / SMOLLM2_GGUF
    if sample.is_file() and not (cache / SMOLLM2_GGUF).is_file():
        shutil.copyfile(sample, cache / SMOLLM2_GGUF)                   # no download
    run, cfg = smollm2_run(cache)
    ck = run / "checkpoint_best.pt"
    ggufs = {d: exported_gguf(cfg, ck, cache / f"gguf-{d}", d, reuse=True) for d in ("f32", "q8_0")}
    fp32, _, tok, _ = load_model_and_tokenizer(ck, load_config(cfg), say=lambda s: None)
    int8 = copy.deepcopy(fp32)
    quantize_int8(int8)
    return fp32, int8, tok, ggufs


def chat_ids(tok, text: str) -> list[int]:
    """SmolLM2's chat turns around ``text``: the prompt ids of one user message, as its template."""
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [start] + enc(f"user\n{text}") + [end] + enc("\n") + [start] + enc("assistant\n")


def smollm2_batch1(a) -> int:
    import torch
    from utils.generation.engine import Engine
    if a.quick:
        a.repeats, a.new_tokens = 1, 32
    n = a.new_tokens
    fp32, int8, tok, ggufs = smollm2_models(a.cache)
    bw = read_bandwidth()
    print(f"perf/generate_throughput.py --smollm2  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start, "
          f"torch {torch.__version__}; SmolLM2-135M-Instruct (the same weights everywhere), batch 1, greedy, "
          f"{n} new tokens, {a.repeats} repeats, contenders alternating; llama.cpp {a.llama_threads} threads; "
          f"read bandwidth {bw / 1e9:.1f} GB/s")
    bound = {"fp32": bw / weight_bytes(fp32), "int8": bw / weight_bytes(int8)}
    for what, text, lookup in (("free text", FREE, 0), ("an edit (the answer copies the prompt)", EDIT, 8)):
        ids = chat_ids(tok, text)
        runs = {}
        for prec, model, gg in (("fp32", fp32, "f32"), ("int8", int8, "q8_0")):
            runs[f"ours {prec}"] = ours_runner(Engine(model), ids, n)
            if lookup:
                runs[f"ours {prec} lookup {lookup}"] = ours_runner(Engine(model, prompt_lookup=lookup), ids, n)
            else:
                runs[f"ours {prec} all threads"] = ours_runner(Engine(model, threads=torch.get_num_threads()), ids, n)
            if a.compile and not lookup:
                e = Engine(model, compile="on")
                print(f"  ours {prec} compiled: compile {e.compile_now():.0f} s", flush=True)
                runs[f"ours {prec} compiled"] = ours_runner(e, ids, n)
            runs[f"llama.cpp {gg}"] = llama_runner(ggufs[gg], a.llama_threads, ids, n)
        rates, outs = interleave(runs, a.repeats, n)
        print(f"\n{what}, {len(ids)}-token prompt:")
        for k, r in rates.items():
            prec = "int8" if "int8" in k else "fp32"
            ref = rates["llama.cpp " + ("q8_0" if prec == "int8" else "f32")]
            line = f"  {k:<24} new tokens/s {spread(r, ',.1f')}"
            if k.startswith("ours"):
                line += (f";  / llama.cpp {spread([x / y for x, y in zip(r, ref)], '.2f')};  "
                         f"{statistics.median(r) / bound[prec]:.0%} of the bandwidth bound ({bound[prec]:.0f}/s)")
                base = outs[f"ours {prec}"]
                if outs[k] != base:
                    line += "  TOKENS DIFFER from ours plain"
            print(line, flush=True)
    return 0
