"""Serving throughput: `main.py serve` (continuous batching) against direct `generate` calls one
after another and against llama.cpp's own OpenAI server (``llama_cpp.server``) on the same
weights exported to GGUF.

    python perf/serve_throughput.py [--size tiny|7m] [--streams 1,4,8,16] [--repeats 3]
                                    [--new-tokens 64] [--gguf-dtype f32] [--no-llama]
    python perf/serve_throughput.py --model .cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
                                    --streams 1,8 --gguf-dtype f32|q8_0     a real model

``--model PATH`` (a Hugging Face Llama folder or .gguf file) serves that model instead: ours
imports it (fp32, ``--hf-model``), llama.cpp gets the same fp32 weights written by our GGUF
writer in ``--gguf-dtype``; both with a 1024-token context. Otherwise: the same
random-initialised weights everywhere (a checkpoint written here with the sample Mistral
SentencePiece tokenizer, 32k vocabulary; exported with ``main.py export --format gguf``), the
same prompts (``--streams`` of them, different per stream), ``--new-tokens`` per request,
temperature 0. Each server runs as its own process on 127.0.0.1 and is driven with the official
``openai`` client, one thread per concurrent stream, streaming (SSE): the time to first token
(TTFT, request sent -> first text chunk) and the aggregate new tokens/s (all streams' text
chunks / wall time of the round; EOS can end a stream early on either side, so tokens are
counted, not assumed). ``direct`` is in-process ``Engine.generate`` on one prompt at a time,
the same prompts back to back: what a script without a server gets. Contenders alternate
within each repeat; min / median / max over repeats.

Targets (issue 18): at 8 streams >= 3x the 1-stream aggregate; at 1 stream the HTTP + SSE
overhead <= 10% of direct generation (ours/direct >= 0.90); the ratio against llama.cpp's
server at each concurrency is reported. llama.cpp gets 2 threads (this machine's cores);
our engine uses its own thread rule (``Engine.step_threads``).
Needs the test requirements (openai, llama-cpp-python with its server extras:
``pip install sse-starlette starlette-context pydantic-settings``).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TOK_DIR = ROOT / "data" / "samples" / "tokenizers" / "mistral-v1"
SIZES = {"tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2),
         "7m": dict(d_model=192, n_layers=4, n_heads=6, n_kv_heads=2)}
PROMPTS = ["The history of the city begins", "In mathematics, a group is", "The river flows through",
           "During the war, the army", "The album was recorded in", "Scientists have found that",
           "The first known use of the word", "After the election, the new government"]


def spread(xs, fmt):
    return f"min {format(min(xs), fmt)}  median {format(statistics.median(xs), fmt)}  max {format(max(xs), fmt)}"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def build(work: Path, size: str, context: int) -> tuple[Path, Path]:
    """A random-initialised checkpoint with the sample tokenizer, and its config."""
    import torch
    import model as M
    from utils.data.tok import describe, load_tokenizer_from
    from utils.training.checkpoint import save_checkpoint
    tok = load_tokenizer_from(str(TOK_DIR / "tokenizer.model"))
    torch.manual_seed(0)
    args = M.ModelArgs(vocab_size=len(tok), max_seq_len=context, bos_id=tok.bos_token_id,
                       tie_embeddings=True, **SIZES[size])
    m = M.create_model(args)
    ck = work / "checkpoints" / f"perf_{size}" / "checkpoint_best.pt"
    save_checkpoint(ck, {"kind": "pretrain", "model": m.state_dict(), "model_args": args.to_dict(),
                         "tokenizer": describe(tok, str(TOK_DIR / "tokenizer.model")), "step": 0})
    cfg = work / "config.json"
    cfg.write_text(json.dumps({"paths": {"root": str(work), "samples_dir": str(ROOT / "data" / "samples")},
                               "tokenizer": {"name": str(TOK_DIR / "tokenizer.model")}}))
    return ck, cfg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx2 as httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise SystemExit(f"no answer from {url} within {timeout} s")


def start_ours(cfg: Path, ck: Path, slots: int, log: Path, context: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    flag = "--checkpoint" if ck.suffix == ".pt" else "--hf-model"
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "serve", "--config", str(cfg),
                             flag, str(ck), "--port", str(port), "--max-batch", str(slots),
                             "--context", str(context)],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    return proc, url + "/v1"


def start_llama(gguf: Path, context: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
                             "127.0.0.1", "--port", str(port), "--n_ctx", str(context), "--n_threads", "2",
                             "--n_threads_batch", "2"], stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", proc)
    return proc, url + "/v1"


def round_http(base: str, model: str, prompts: list[str], new_tokens: int) -> tuple[float, list[float], int]:
    """All prompts at once, one streaming request each: (aggregate tokens/s, TTFTs, tokens)."""
    from openai import OpenAI
    client = OpenAI(base_url=base, api_key="x", max_retries=0, timeout=600)

    def one(prompt):
        t0 = time.perf_counter()
        ttft, n = None, 0
        for ch in client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens,
                                            temperature=0, stream=True):
            if ch.choices and ch.choices[0].text:
                n += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
        return ttft if ttft is not None else float("nan"), n

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(one, prompts))
    wall = time.perf_counter() - t0
    n = sum(k for _, k in got)
    return n / wall, [t for t, _ in got], n


def round_direct(engine, tok, prompts: list[str], new_tokens: int) -> tuple[float, list[float], int]:
    from utils.data.tok import encode_plain
    ids = [[tok.bos_token_id] + encode_plain(tok, [p])[0] for p in prompts]
    t0 = time.perf_counter()
    n, ttfts = 0, []
    for p in ids:                                          # one after another
        t1 = time.perf_counter()
        first = None
        for _ in engine.stream(p, new_tokens, temperature=0, eos_id=tok.eos_token_id):
            if first is None:
                first = time.perf_counter() - t1
            n += 1
        ttfts.append(first if first is not None else float("nan"))
    return n / (time.perf_counter() - t0), ttfts, n


def write_llama_gguf(work: Path, cfg: Path, ck: Path, model, tok, dtype: str) -> Path:
    """The same weights as GGUF: ``main.py export`` for our checkpoint, the GGUF writer on the
    imported model otherwise."""
    if ck.suffix == ".pt":
        r = subprocess.run([sys.executable, str(ROOT / "main.py"), "export", "--config", str(cfg),
                            "--checkpoint", str(ck), "--format", "gguf", "--dtype", dtype,
                            "--out", str(work / "gguf")], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"export failed:\n{r.stderr}")
        return next((work / "gguf").glob("*.gguf"))
    from utils.hf.to_gguf import write_gguf
    return write_gguf(work / f"model-{dtype}.gguf", model, tok, dtype=dtype, name=ck.stem)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="7m", choices=sorted(SIZES))
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gguf-dtype", default="f32", choices=["f32", "f16", "q8_0"])
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp's server")
    ap.add_argument("--model", type=Path, default=None, help="a Hugging Face Llama folder or .gguf file")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    streams = [int(s) for s in a.streams.split(",")]
    context = 256
    import torch
    from utils.data.tok import load_tokenizer_from
    from utils.generation.engine import Engine
    from utils.run import load_model
    with tempfile.TemporaryDirectory(prefix="serve_perf_") as tmp:
        work = Path(tmp)
        if a.model is None:
            ck, cfg = build(work, a.size, context)
            tok = load_tokenizer_from(str(TOK_DIR / "tokenizer.model"))
            model = load_model(ck)[0]
        else:
            from utils.hf.import_hf import load_hf_llama
            context = 1024
            ck, cfg = a.model.resolve(), work / "config.json"
            cfg.write_text(json.dumps({"paths": {"root": str(work)}}))
            imported = load_hf_llama(ck)
            model, tok = imported.model.eval(), imported.tok
        engine = Engine(model)
        name = f"perf_{a.size}" if a.model is None else (ck.stem if ck.suffix == ".gguf" else ck.name)
        procs, servers = [], {}
        p, url = start_ours(cfg, ck, max(streams), work / "ours.log", context)
        procs.append(p)
        servers["ours"] = (url, name)
        if not a.no_llama:
            gguf = write_llama_gguf(work, cfg, ck, model, tok, a.gguf_dtype)
            p, url = start_llama(gguf, context, work / "llama.log")
            procs.append(p)
            servers["llama.cpp"] = (url, str(gguf))
        try:
            report(a, streams, servers, engine, tok)
        finally:
            for p in procs:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
    return 0


def report(a, streams, servers, engine, tok) -> None:
    import torch
    n_params = sum(p.numel() for p in engine.model.parameters())
    print(f"perf/serve_throughput.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    what = f"{a.size} model" if a.model is None else f"model {a.model.name} (imported)"
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; {what} "
          f"({n_params / 1e6:.1f}M params, {engine.model.args.vocab_size} vocabulary), fp32 ours, GGUF {a.gguf_dtype} for llama.cpp; "
          f"{a.new_tokens} new tokens per request, greedy, {a.repeats} repeats, contenders alternating")
    for name, (url, model) in servers.items():                       # warm-up
        round_http(url, model, PROMPTS[:2], 4)
    round_direct(engine, tok, PROMPTS[:1], 4)
    single = {}
    for c in streams:
        prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(c)]
        rates = {k: [] for k in ["direct", *servers]}
        ttfts = {k: [] for k in rates}
        for _ in range(a.repeats):
            r, t, _ = round_direct(engine, tok, prompts, a.new_tokens)
            rates["direct"].append(r)
            ttfts["direct"] += t
            for name, (url, model) in servers.items():
                r, t, _ = round_http(url, model, prompts, a.new_tokens)
                rates[name].append(r)
                ttfts[name] += t
        print(f"\n{c} concurrent stream(s):")
        for name in rates:
            print(f"  {name:9s} aggregate new tokens/s {spread(rates[name], ',.0f')};  TTFT p50 "
                  f"{pct(ttfts[name], .5) * 1000:.0f} ms  p95 {pct(ttfts[name], .95) * 1000:.0f} ms")
        ours = rates["ours"]
        print(f"  ours/direct   {spread([o / d for o, d in zip(ours, rates['direct'])], '.2f')}"
              + ("   (1 stream: HTTP+SSE overhead target ours/direct >= 0.90)" if c == 1 else ""))
        if "llama.cpp" in rates:
            print(f"  ours/llama.cpp {spread([o / q for o, q in zip(ours, rates['llama.cpp'])], '.2f')}")
        if c == 1:
            single = ours
        elif single:
            print(f"  ours {c} streams / ours 1 stream  {spread([o / s for o, s in zip(ours, single)], '.2f')}"
                  + ("   (target at 8 streams: >= 3)" if c == 8 else ""))


if __name__ == "__main__":
    sys.exit(main())
