"""Prefix caching: time to first token through `main.py serve` with the cache (``serve.prefix_cache_mb``
256) against without it (0), on a scripted chat and on requests sharing a long system prompt.

    python perf/prefix_cache.py [--model tiny|smollm2|both] [--repeats 3] [--turns 10] [--shared 8]

Two servers of the same model run side by side on 127.0.0.1 (``--max-batch 2 --context
2048 --threads 1``: on a machine shared with other jobs, one intra-op thread per step is the
steadier; ``--threads`` changes it), one with the cache and one without, driven by the official ``openai`` client,
streaming, greedy: TTFT is request sent -> first content chunk.

1. Chat: a conversation of ``--turns`` turns (each user message ~40 tokens, each answer up to
   ``--new-tokens``), every request resending the whole conversation as the chat page does.
   Each turn goes to both servers in turn (the answers are the same, greedy and exact, so the
   conversation is too); each repeat is a new conversation (its first message differs, so
   nothing carries over between repeats). Printed: TTFT of turns 1, 5 and 10 on each server
   (min / median / max over repeats), and the ratio turn 10 / turn 1 with the cache (target
   <= 1.5) and without.
2. Shared system prompt: ``--shared`` requests with the same ~500-token system prompt and
   different questions, one after another, alternating servers; each repeat's system prompt
   is new. Printed: TTFT of the first request and of the later ones (median of each repeat's
   later requests), and the ratio cached / uncached of the later ones.

3. Exactness (SmolLM2, in-process, ``--model smollm2`` or ``both``): the first-token logits of
   prompts whose start is cached against a prefill of the whole prompt (the largest absolute
   difference, and whether the argmax agrees), also for a next turn over a greedy answer
   whose KV the decode steps wrote.

Models: the tiny random-initialised checkpoint of perf/serve_throughput.py (the sample Mistral
SentencePiece tokenizer, 32k vocabulary), and SmolLM2-135M-Instruct from its Hugging Face folder
in the offline samples (``--hf-model``, imported at start). The load average is printed at start
and end: the machine is shared.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from perf.serve_throughput import Servers, build  # noqa: E402  (the tiny checkpoint and server handling)
from utils.data.sft import default_template  # noqa: E402
from utils.training.checkpoint import read_checkpoint, save_checkpoint  # noqa: E402

SMOLLM2 = ROOT / "data" / "samples" / "smollm2" / "SmolLM2-135M-Instruct"
TOPICS = ["rivers", "mountains", "old libraries", "the tides", "bridges", "glaciers", "deserts", "forests",
          "volcanoes", "islands", "caves", "lighthouses"]
SYSTEM = ("You are a careful assistant for a museum of natural history. Answer in plain words, name your "
          "sources when you know them, say when you are unsure, keep each answer short and friendly, and "
          "never invent the opening hours, prices or exhibitions of the museum. ")


def spread(xs: list[float]) -> str:
    return f"min {min(xs):.3f}  median {statistics.median(xs):.3f}  max {max(xs):.3f} s"


def ttft(client, model: str, messages: list[dict], new_tokens: int) -> tuple[float, str]:
    """(seconds to the first content chunk, the whole answer) of one streamed chat request."""
    t0 = time.perf_counter()
    first, parts = None, []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=new_tokens,
                                                temperature=0, stream=True):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            first = first or time.perf_counter() - t0
            parts.append(piece)
    return (first if first is not None else time.perf_counter() - t0), "".join(parts)


def chat(clients: dict, a, r: int) -> dict[str, list[float]]:
    """One scripted conversation on every server: each turn's TTFT per server."""
    out = {name: [] for name in clients}
    msgs: list[dict] = []
    for turn in range(a.turns):
        topic = TOPICS[turn % len(TOPICS)]
        msgs.append({"role": "user", "content": f"Conversation {r}, question {turn + 1}: what should a visitor "
                                                f"know about {topic}, how did they form, and where can one see "
                                                f"good examples of {topic} near the coast?"})
        answers = set()
        for name, (client, model) in clients.items():
            t, text = ttft(client, model, msgs, a.new_tokens)
            out[name].append(t)
            answers.add(text)
        if len(answers) != 1:
            raise SystemExit(f"turn {turn + 1}: the servers answered differently: {answers}")
        msgs.append({"role": "assistant", "content": answers.pop()})
    return out


def shared(clients: dict, a, r: int) -> dict[str, list[float]]:
    """``--shared`` requests with one long system prompt, alternating servers: TTFT of each."""
    system = f"Session {r}. " + SYSTEM * 8
    out = {name: [] for name in clients}
    for i in range(a.shared):
        msgs = [{"role": "system", "content": system},
                {"role": "user", "content": f"Tell me one fact about {TOPICS[i % len(TOPICS)]}."}]
        for name, (client, model) in clients.items():
            out[name].append(ttft(client, model, msgs, 4)[0])
    return out


def run_model(label: str, cmd_of, a) -> None:
    import openai
    with tempfile.TemporaryDirectory(prefix="perf-prefix-") as tmp, Servers(Path(tmp)) as servers:
        for name, mb in (("cache", "256"), ("no cache", "0")):
            servers._start(name, [*cmd_of(Path(tmp)), "--max-batch", "2", "--context", "2048",
                                  "--threads", str(a.threads), "--prefix-cache-mb", mb], "/health", "")
        clients = {}
        for name, (url, _) in servers.urls.items():
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
            clients[name] = (client, client.models.list().data[0].id)
        chats = {name: [] for name in clients}
        shares = {name: [] for name in clients}
        for r in range(a.repeats):
            print(f"({label.split(' ')[0]}: repeat {r + 1} of {a.repeats})", file=sys.stderr, flush=True)
            for name, ts in chat(clients, a, r).items():
                chats[name].append(ts)
            for name, ts in shared(clients, a, r).items():
                shares[name].append(ts)
        report(label, chats, shares, a)


def report(label: str, chats: dict, shares: dict, a) -> None:
    print(f"\n== {label}: scripted chat, {a.turns} turns, answers up to {a.new_tokens} tokens, greedy")
    for name, runs in chats.items():
        for turn in sorted({1, min(5, a.turns), a.turns}):
            print(f"  {name:9s} turn {turn:2d} TTFT  {spread([ts[turn - 1] for ts in runs])}")
        ratio = [ts[a.turns - 1] / ts[0] for ts in runs]
        print(f"  {name:9s} turn {a.turns} / turn 1: {' '.join(f'{x:.2f}' for x in ratio)}  "
              f"(median {statistics.median(ratio):.2f}{', target <= 1.5' if name == 'cache' else ''})")
    print(f"== {label}: {a.shared} requests sharing a ~{len((SYSTEM * 8).split())}-word system prompt")
    later = {}
    for name, runs in shares.items():
        later[name] = [statistics.median(ts[1:]) for ts in runs]
        print(f"  {name:9s} first request TTFT  {spread([ts[0] for ts in runs])}")
        print(f"  {name:9s} later requests TTFT {spread(later[name])}  (median of each repeat's)")
    ratio = [c / n for c, n in zip(later["cache"], later["no cache"])]
    print(f"  later requests, cache / no cache: {' '.join(f'{x:.2f}' for x in ratio)}")


def first_logits(engine, prompt: list[int]):
    """(the logits a prefill of ``prompt`` samples its first token from, prompt tokens reused)."""
    import torch
    from utils.generation.engine import Sequence, SamplingParams
    b = engine.batcher(1, 2048)
    got, real = {}, b._sample
    b._sample = lambda seqs, logits: got.setdefault("x", logits.clone()) is None or real(seqs, logits)
    seq = b.add(Sequence(prompt, SamplingParams(1, 0.0)))
    with torch.no_grad():
        b.step()
    return got["x"][0], seq.cached


def exactness() -> None:
    from utils.config import load_config
    from utils.generation.engine import Engine
    from utils.run import open_for_generation
    o = open_for_generation(SMOLLM2, load_config(), "cpu", say=lambda s: None)
    ids = o.tok.encode(SYSTEM * 4)
    cached, plain = Engine(o.model), Engine(o.model)
    cached.use_prefix_cache(256 << 20)
    print("\n== SmolLM2-135M-Instruct: first-token logits with a cached start against a whole prefill")
    cases = [(f"prompt of {cut + 30} tokens after one of {cut}", ids[:cut], ids[:cut + 30]) for cut in (40, 97, 150)]
    answer = plain.generate([ids[:120]], 40, temperature=0)[0]
    cases.append(("next turn over a 40-token greedy answer (KV written by decode steps)", ids[:120],
                  ids[:120] + answer + o.tok.encode(" And?")))
    for what, before, prompt in cases:
        cached.generate([before], 40, temperature=0)                    # stores its prompt + answer
        (a, n), (b, _) = first_logits(cached, prompt), first_logits(plain, prompt)
        print(f"  {what}: {n} reused, largest |difference| {float((a - b).abs().max()):.2e} "
              f"(logits up to {float(b.abs().max()):.0f}), argmax {'same' if a.argmax() == b.argmax() else 'DIFFERS'}")


def main() -> int:
    import torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--shared", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of each server's engine steps")
    a = ap.parse_args()
    print(f"perf/prefix_cache.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at "
          f"start, torch {torch.__version__}; {a.repeats} repeats, servers alternating request by request, "
          f"{a.threads} engine thread(s) each")
    main_py = [sys.executable, str(ROOT / "main.py"), "serve"]
    if a.model in ("tiny", "both"):
        def tiny(tmp: Path) -> list[str]:
            ck, cfg = build(tmp, "tiny", 2048)
            payload = read_checkpoint(ck)                   # as an SFT checkpoint with our chat template
            save_checkpoint(ck, {**payload, "kind": "sft", "chat_template": default_template()})
            return [*main_py, "--config", str(cfg), "--checkpoint", str(ck)]
        run_model("tiny (2 layers, d_model 64, 32k vocabulary; our chat template)", tiny, a)
    if a.model in ("smollm2", "both"):
        exactness()
        run_model("SmolLM2-135M-Instruct (--hf-model, fp32)", lambda tmp: [*main_py, "--hf-model", str(SMOLLM2)], a)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
