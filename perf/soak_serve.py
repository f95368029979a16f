"""Soak: `main.py serve` kept under mixed load on loopback for a long time, its memory, open
files and time to first token watched window by window.

    python perf/soak_serve.py [--minutes 30] [--window 300] [--streams 4] [--seed 0] [--json FILE]
    python perf/soak_serve.py --url http://127.0.0.1:8000 --pids 1234,1235 --model NAME ...   a running server

Without ``--url`` it writes a tiny random checkpoint with our chat template (the sample
SentencePiece tokenizer, 32k vocabulary: what tests/test_serve.py serves) and starts `python
main.py serve` on a free port. ``--streams`` threads each send one request after another with
the official ``openai`` client (and raw sockets), each thread going through the kinds in turn
from its own starting point (questions and seeds drawn from a seeded generator): a chat reply, a streamed chat reply (its time to first token, TTFT, is the one
measured), a completion, a JSON-schema reply, a required tool call, a stream cancelled after
its first chunk, a raw connection dropped mid-stream, and a bad request (which must be a
400). At each ``--window`` seconds it reads, from /proc, the resident memory (VmRSS) and the
open files of the server's processes (the HTTP process and its engine process), and prints a
line per window: requests by kind, 5xx answers and other failures, RSS, the prefix cache's
bytes in use (/health), open files, TTFT p50 and p99, and the machine's 1-minute load average
(TTFT on shared cores moves with it). The prefix cache grows by design up to
its budget (serve.prefix_cache_mb, 256 MiB by default: each request's prompt and reply blocks
are kept for a later turn, least recently used evicted past the budget); the server this
script starts has ``--prefix-cache-mb`` (16) so that the cache is full by the end of the
warm-up window and any later growth is not the cache's.

Goals (issue 51): RSS growth under 5% from the first window after warm-up (the second) to
the last, p99 TTFT of every window after warm-up within 20% of their median, zero 5xx and
zero unexpected answers. The summary says which hold; exit 1 when one does not.
tests/test_tools.py runs :func:`soak` for seconds against its own server.

LoRA adapters (``--adapters N``, default 2; 0: none): the server it starts also serves N
random LoRA adapters (PEFT folders written here, ``--adapter``), and the kinds then include a
chat reply and a streamed one (its TTFT measured with the others) from a random adapter, in
the same batches as the base's rows, and a runtime swap (``POST /v1/adapters`` of one more
adapter, a request to it, ``DELETE`` it; one swap at a time). Against a running server
(``--url``): ``--adapter-names a,b`` (and ``--swap-path DIR`` for the swap).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from perf.serve_adapters import write_adapters   # noqa: E402  (random PEFT LoRA folders)

KINDS = ("chat", "chat_stream", "completion", "json", "tool", "cancel", "disconnect", "bad")
ADAPTER_KINDS = ("adapter_chat", "adapter_stream", "adapter_swap")    # with adapters (see the docstring)
_SWAP = threading.Lock()                                              # one runtime swap at a time
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 130}}}
TOOLS = [{"type": "function", "function": {"name": "gcd", "description": "The greatest common divisor.",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "required": ["a", "b"],
                                                          "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 999},
                                                                         "b": {"type": "integer", "minimum": 1, "maximum": 999}}}}}]
QUESTIONS = ["Why is the sky blue?", "What is the greatest common divisor of 84 and 36?", "Name a prime number.",
             "Tell me about rivers.", "How far is the moon?", "What is a token?"]


def proc_figures(pids: list[int]) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of the processes, summed (Linux /proc)."""
    rss = fds = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) * 1024
        fds += len(os.listdir(f"/proc/{pid}/fd"))
    return rss, fds


def children(pid: int) -> list[int]:
    """The process and its descendants (the server's engine process)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            kids = (task / "children").read_text().split()
            todo += [int(k) for k in kids]
    return out


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


class _Tally:
    """What one window saw (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {k: 0 for k in KINDS + ADAPTER_KINDS}
        self.server_errors = 0
        self.unexpected: list[str] = []
        self.ttft: list[float] = []

    def add(self, kind: str, ttft=None, error=None, status=None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if ttft is not None:
                self.ttft.append(ttft)
            if status is not None and status >= 500:
                self.server_errors += 1
            if error is not None and len(self.unexpected) < 20:
                self.unexpected.append(f"{kind}: {error}")


def _one(client, url: str, model: str, kind: str, rng: random.Random, tally: _Tally, max_tokens: int,
         adapters: tuple = (), swap: Optional[str] = None) -> None:
    """One request of ``kind``; what it got goes into ``tally``."""
    import openai
    if kind in ("adapter_chat", "adapter_stream"):          # the same requests, on an adapter
        base_kind = "chat" if kind == "adapter_chat" else "chat_stream"
        return _one(client, url, f"{model}:{rng.choice(adapters)}", base_kind, rng, _Renamed(tally, kind),
                    max_tokens)
    q = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    seed = rng.randrange(1 << 30)
    try:
        if kind == "adapter_swap":
            _swap(client, url, model, swap, max_tokens, seed)
        elif kind == "chat":
            r = client.chat.completions.create(model=model, messages=q, max_tokens=max_tokens, seed=seed)
            assert r.choices[0].finish_reason in ("stop", "length"), r
        elif kind == "chat_stream":
            t0, first = time.perf_counter(), None
            for chunk in client.chat.completions.create(model=model, messages=q, max_tokens=max_tokens, seed=seed,
                                                        stream=True):
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
            tally.add(kind, ttft=first)
            return
        elif kind == "completion":
            client.completions.create(model=model, prompt="The history of", max_tokens=max_tokens, seed=seed)
        elif kind == "json":
            r = client.chat.completions.create(model=model, messages=q, max_tokens=80, seed=seed, response_format={
                "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
            if r.choices[0].finish_reason == "stop":
                json.loads(r.choices[0].message.content)
        elif kind == "tool":
            r = client.chat.completions.create(model=model, messages=q, max_tokens=60, seed=seed, tools=TOOLS,
                                               tool_choice="required", parallel_tool_calls=False)
            json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        elif kind == "cancel":
            stream = client.chat.completions.create(model=model, messages=q, max_tokens=max_tokens, seed=seed, stream=True)
            next(iter(stream))
            stream.close()
        elif kind == "disconnect":
            _drop_mid_stream(url, model, q, max_tokens)
        elif kind == "bad":
            try:
                client.chat.completions.create(model=model, messages=q, temperature=7)
                tally.add(kind, error="a bad request was answered 200")
                return
            except openai.BadRequestError:
                pass
        tally.add(kind)
    except openai.APIStatusError as e:
        tally.add(kind, error=f"{e.status_code} {str(e)[:200]}", status=e.status_code)
    except Exception as e:          # a broken stream, a reply that does not parse: counted, the soak goes on
        tally.add(kind, error=f"{type(e).__name__}: {str(e)[:200]}")


class _Renamed:
    """A tally that counts under another kind (an adapter's request made as a base kind)."""

    def __init__(self, tally: _Tally, kind: str):
        self.tally, self.kind = tally, kind

    def add(self, kind: str, **kw) -> None:
        self.tally.add(self.kind, **kw)


def _swap(client, url: str, model: str, path: str, max_tokens: int, seed: int) -> None:
    """Load the adapter at ``path`` as "swap" at runtime, ask it once, unload it."""
    import httpx2 as httpx            # the openai client's own HTTP library
    headers = {"Authorization": f"Bearer {client.api_key}"}
    with _SWAP:
        r = httpx.post(url + "/v1/adapters", json={"name": "swap", "path": path}, headers=headers, timeout=120)
        assert r.status_code == 200, f"load: {r.status_code} {r.text[:200]}"
        try:
            client.completions.create(model=f"{model}:swap", prompt="The history of", max_tokens=max_tokens,
                                      seed=seed)
        finally:
            r = httpx.delete(url + "/v1/adapters/swap", headers=headers, timeout=120)
            assert r.status_code == 200, f"unload: {r.status_code} {r.text[:200]}"


def _drop_mid_stream(url: str, model: str, messages: list, max_tokens: int) -> None:
    """A streamed request over a raw socket, closed after the first bytes of its answer."""
    u = urlparse(url)
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}).encode()
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        s.recv(256)


def soak(url: str, pids: list[int], model: str, seconds: float, window: float, streams: int = 4, seed: int = 0,
         max_tokens: int = 24, say=print, adapters: tuple = (), swap: Optional[str] = None) -> dict:
    """Drive the server at ``url`` for ``seconds`` with ``streams`` workers; one record per window
    (see the module docstring) and a summary against the goals. ``adapters``: names of the
    model's LoRA adapters to drive too; ``swap``: an adapter folder to load and unload."""
    kinds = KINDS + (ADAPTER_KINDS[:2] if adapters else ()) + (ADAPTER_KINDS[2:] if swap else ())
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("LLM_SERVE_API_KEY", "unused"),
                           max_retries=0, timeout=120)
    windows, end, stop = [], time.monotonic() + seconds, threading.Event()
    for w in range(max(1, round(seconds / window))):
        tally, stop_at = _Tally(), min(end, time.monotonic() + window)

        def worker(k: int) -> None:
            rng = random.Random(seed * 1000 + w * 100 + k)
            start, i = k * len(kinds) // streams, 0          # the kinds in turn, each worker from its own
            while time.monotonic() < stop_at and not stop.is_set():
                _one(client, url, model, kinds[(start + i) % len(kinds)], rng, tally, max_tokens, adapters, swap)
                i += 1
        with cf.ThreadPoolExecutor(streams) as pool:
            futures = [pool.submit(worker, k) for k in range(streams)]
            try:
                while cf.wait(futures, timeout=0.5).not_done:    # short waits: a signal is seen at once
                    pass
            except KeyboardInterrupt:         # Ctrl-C / SIGTERM: the workers end after their request
                stop.set()
                raise
            for f in futures:
                f.result()
        rss, fds = proc_figures(pids)
        rec = {"window": w, "requests": dict(tally.counts), "server_errors": tally.server_errors,
               "unexpected": tally.unexpected, "rss_mib": round(rss / 2 ** 20, 1), "open_files": fds,
               "ttft_p50": _percentile(tally.ttft, 0.5), "ttft_p99": _percentile(tally.ttft, 0.99),
               "prefix_cache_mib": _prefix_cache_mib(client, url), "load_1min": round(os.getloadavg()[0], 2)}
        windows.append(rec)
        say(f"window {w}: {sum(tally.counts.values())} requests, {tally.server_errors} 5xx, "
            f"{len(tally.unexpected)} unexpected, RSS {rec['rss_mib']} MiB (prefix cache {rec['prefix_cache_mib']} "
            f"MiB), {fds} open files, TTFT p50 {rec['ttft_p50'] * 1000:.0f} ms p99 {rec['ttft_p99'] * 1000:.0f} ms, "
            f"load {rec['load_1min']}")
    return {"windows": windows, "summary": summarize(windows)}


def _prefix_cache_mib(client, url: str):
    """The prefix caches' bytes in use as /health shows them (None when it does not: no cache,
    or a key the soak was not given), MiB."""
    import httpx2 as httpx            # the openai client's own HTTP library
    headers = {"Authorization": f"Bearer {client.api_key}"}
    models = httpx.get(url + "/health", headers=headers, timeout=30).json()["models"]
    used = [m["prefix_cache"]["bytes_used"] for m in models.values() if m.get("prefix_cache")]
    return round(sum(used) / 2 ** 20, 1) if used else None


def summarize(windows: list[dict]) -> dict:
    """The goals over the windows after the first (warm-up), when there are several."""
    after = windows[1:] if len(windows) > 1 else windows
    rss_growth = after[-1]["rss_mib"] / after[0]["rss_mib"] - 1
    p99 = [w["ttft_p99"] for w in after if w["ttft_p99"] == w["ttft_p99"]]
    mid = statistics.median(p99) if p99 else float("nan")
    spread = max(abs(x / mid - 1) for x in p99) if p99 else float("nan")
    errors = sum(w["server_errors"] for w in windows)
    unexpected = sum(len(w["unexpected"]) for w in windows)
    return {"rss_growth": rss_growth, "ttft_p99_spread": spread, "server_errors": errors, "unexpected": unexpected,
            "open_files": [w["open_files"] for w in windows],
            "goals": {"rss_growth_under_5pct": rss_growth < 0.05, "ttft_p99_within_20pct": spread <= 0.20,
                      "zero_5xx": errors == 0, "zero_unexpected": unexpected == 0}}


def _start_server(tmp: Path, prefix_cache_mb: int, adapters: int = 0):
    """A tiny random chat checkpoint and `main.py serve` on a free port, with ``adapters`` random
    LoRA adapters a0, a1, ...: (process, url, model, adapter names, a folder for the swap)."""
    import subprocess
    import model as model_lib
    import torch
    from utils.data import sft
    from utils.data.tok import describe, load_tokenizer_from
    from utils.training.checkpoint import save_checkpoint
    spm = ROOT / "data" / "samples" / "tokenizers" / "mistral-v1" / "tokenizer.model"
    tok = load_tokenizer_from(str(spm))
    margs = model_lib.ModelArgs(vocab_size=len(tok), d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                max_seq_len=1024, bos_id=tok.bos_token_id)
    torch.manual_seed(0)
    ck = tmp / "checkpoints" / "soak" / "checkpoint_best.pt"
    ck.parent.mkdir(parents=True)
    save_checkpoint(ck, {"kind": "sft", "model": model_lib.create_model(margs).state_dict(),
                         "model_args": margs.to_dict(), "tokenizer": describe(tok, str(spm)),
                         "chat_template": sft.default_template(), "step": 0})
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps({"paths": {"root": str(tmp)}, "tokenizer": {"name": str(spm)},
                               "serve": {"prefix_cache_mb": prefix_cache_mb}}))
    folders = write_adapters(tmp, ck, adapters + 1, 8, ["q_proj", "v_proj", "up_proj"]) if adapters else []
    names = tuple(f.name for f in folders[:-1])
    flags = [x for f in folders[:-1] for x in ("--adapter", f"{f.name}={f}")]
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "serve", "--config", str(cfg), "--port", "0",
                             "--checkpoint", str(ck.parent), *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.split("listening on ")[1].strip(), "soak", names, (str(folders[-1]) if folders else None)
    raise RuntimeError("the server did not start")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--window", type=float, default=300.0, help="seconds per window")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="a running server (else one is started)")
    p.add_argument("--pids", default="", help="its processes, comma-separated (RSS, open files)")
    p.add_argument("--model", default=None)
    p.add_argument("--adapters", type=int, default=2, help="random LoRA adapters on the server it starts (0: none)")
    p.add_argument("--adapter-names", default="", help="with --url: the model's adapters to drive, comma-separated")
    p.add_argument("--swap-path", default=None, help="with --url: an adapter folder to load and unload at runtime")
    p.add_argument("--json", default=None, help="write the windows and summary here")
    p.add_argument("--prefix-cache-mb", type=int, default=16,
                   help="serve.prefix_cache_mb of the server it starts: the cache fills to this budget "
                        "(then evicts), which is memory growth by design; a small one is full within "
                        "the warm-up window, so later growth is a leak (default 16)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return _run(a)
    except KeyboardInterrupt:
        print("soak: interrupted; the server it started is stopped", file=sys.stderr)
        return 130


def _run(a) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        proc = None
        if a.url is None:
            proc, url, model, adapters, swap = _start_server(Path(tmp), a.prefix_cache_mb, a.adapters)
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain its output
            time.sleep(1.0)
            pids = children(proc.pid)
        else:
            url, model, pids = a.url.rstrip("/"), a.model, [int(x) for x in a.pids.split(",") if x]
            adapters, swap = tuple(x for x in a.adapter_names.split(",") if x), a.swap_path
        try:
            out = soak(url, pids, model, a.minutes * 60, a.window, a.streams, a.seed, adapters=adapters, swap=swap)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    s = out["summary"]
    print(json.dumps(s, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0 if all(s["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
