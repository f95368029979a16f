"""One HTTP request of ``serve`` in flight (library; no side effects): its sequences on the
model's lane and what came back for them, the counts of its log line and the pieces of its
answer (text, finish reasons, logprobs in the completion and chat shapes).

    job = Job(m, s, prompts, texts, chat, rid)     ``n`` sequences per prompt, choice i seeded seed + i
    job.submit()                                   into the model's running batch (ValueError:
                                                   refused; RuntimeError: the engine is stopping)
    for e in await job.arrived(): job.take(e)      until job.done
    job.cancel()                                   whatever is not finished (idempotent)
    job.end(log)                                   once: its log line and metrics

The engine thread calls each sequence's sink; the asyncio loop that built the Job reads the
events through :meth:`Job.arrived` (see the class for when it is woken). The answer's shapes
are built by utils/serve/responses.py (one JSON body) and utils/serve/sse.py (a stream).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from typing import Optional

from utils.data.chat import answer_decoding
from utils.data.tools import parse_reply
from utils.generation.detok import TextDecoder
from utils.generation.engine import Event, SamplingParams, Sequence
from utils.serve.protocol import ApiError, Sampling, new_id
from utils.serve.served import ServedModel


class Job:
    """One HTTP request's sequences and what came back for them: events from the engine
    thread wait in ``inbox``; :meth:`arrived` hands the asyncio loop all of them at once.

    The engine thread wakes the loop only when no wake-up is pending and at least
    ``m.stream_interval`` seconds passed since the last one (a finishing event always wakes
    it), and a stream writes what one wake-up brought in one write, a choice's tokens in one
    chunk (utils/serve/sse.py). So a request's first token goes out at once, and a model faster
    than 1 / stream_interval tokens/s sends its tokens in groups (at serve.stream_interval
    0.02: at most 50 writes a second per request) instead of paying a thread hand-off, an
    event-loop pass, a JSON chunk, a socket write and the client's parse per token, which for a
    small, fast model is a large share of its CPU time."""

    def __init__(self, m: ServedModel, s: Sampling, prompts: list[list[int]], texts: list[str],
                 chat: bool, rid: str, metrics=None):
        self.m, self.s, self.chat, self.id = m, s, chat, rid
        self.metrics = metrics              # utils/serve/metrics.py ServeMetrics, told in end()
        self.t0 = time.perf_counter()
        self.ttft: Optional[float] = None
        self.inbox: deque[Event] = deque()
        self._ready = asyncio.Event()
        self._woken = False                 # a wake-up is pending (set by the engine thread)
        self._last_wake = float("-inf")
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.texts = texts
        aio = asyncio.get_running_loop()

        def sink(e: Event) -> None:         # on the engine thread
            self.inbox.append(e)
            if not self._woken and (e.finish is not None or
                                    time.monotonic() - self._last_wake >= m.stream_interval):
                self._woken = True
                self._last_wake = time.monotonic()
                try:
                    aio.call_soon_threadsafe(self._ready.set)
                except RuntimeError:      # the event loop closed (shutdown): nobody is waiting
                    pass
        self.seqs: list[Sequence] = []
        continues, lead = answer_decoding(m.template) if chat else (True, "")
        temperature, top_k, top_p = m.sampling(s)
        for p, ids in enumerate(prompts):
            max_tokens = s.max_tokens or min(m.default_max_tokens, m.context - len(ids))
            for i in range(s.n):
                params = SamplingParams(max_tokens, temperature, top_k, top_p,
                                        None if s.seed is None else s.seed + i,
                                        frozenset(m.rules.stop_ids), s.stop, s.logprobs,
                                        prompt_logprobs=s.echo and s.logprobs is not None, grammar=s.grammar,
                                        prompt_lookup=s.prompt_lookup, adapter=m.adapter)
                self.seqs.append(Sequence(ids, params, tok=m.tok, sink=sink, tag=p * s.n + i,
                                          continues=continues, lead=lead, text_by_caller=True))
        self.text = [""] * len(self.seqs)
        self.finish: list[Optional[str]] = [None] * len(self.seqs)
        self.logprobs: list[list] = [[] for _ in self.seqs]
        self.call_ids: dict[int, list[str]] = {}     # choice -> the ids of its tool calls so far

    async def arrived(self) -> list[Event]:
        """Every event that arrived since the last call, in order (waits for at least one).
        The flag is cleared before the inbox is read, so an event appended after the read
        always schedules a new wake-up."""
        while True:
            self._woken = False
            if self.inbox:
                return [self.inbox.popleft() for _ in range(len(self.inbox))]
            self._ready.clear()
            await self._ready.wait()

    def submit(self) -> None:
        if self.m.adapter is not None and self.m.adapter not in self.m.adapters:   # unloaded meanwhile
            raise ApiError(404, f"the adapter '{self.m.id}' was unloaded while this request was read; "
                           "GET /v1/models lists what is served.", "model", "model_not_found")
        for seq in self.seqs:
            self.m.lane.submit(seq)

    def cancel(self) -> None:
        for seq in self.seqs:
            if not seq.done:
                self.m.lane.cancel(seq)

    def take(self, e: Event) -> None:
        i = e.seq.tag
        if e.token is not None and self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
        self.text[i] += e.text
        if (own := e.seq.caller_text) is not None:          # the text is ours to make (see Event)
            if e.token is not None:
                self.text[i] += own.push(e.token)[0]
            if e.finish not in (None, "cancelled", "error"):
                self.text[i] += own.finish()
        if e.logprob is not None:
            self.logprobs[i].append((e.token, e.logprob, e.top or []))
        if e.finish is not None:
            self.finish[i] = e.finish

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def error(self) -> Optional[str]:
        bad = [s.error for s in self.seqs if s.finish == "error"]
        return bad[0] if bad else None

    def usage(self) -> dict:
        c = sum(len(s.tokens) for s in self.seqs)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": c,
                "total_tokens": self.prompt_tokens + c}

    def end(self, log) -> None:
        """The request is over: its log line, and its counts in the metrics."""
        log(self.log_line())
        if self.metrics is not None:
            self.metrics.request_ended(self)

    def log_line(self) -> str:
        secs = time.perf_counter() - self.t0
        c = sum(len(s.tokens) for s in self.seqs)
        gen = secs - (self.ttft or 0.0)
        rate = f"{(c - len(self.seqs)) / gen:.1f} tokens/s" if gen > 0 and c > len(self.seqs) else "n/a"
        ttft = f"{self.ttft:.3f}s" if self.ttft is not None else "n/a"
        finish = [f or ("cancelled" if s.cancelled else "none") for f, s in zip(self.finish, self.seqs)]
        return (f"{self.id} model={self.m.id} prompt_tokens={self.prompt_tokens} completion_tokens={c} "
                f"ttft={ttft} {rate} finish={','.join(finish)} {secs:.2f}s")

    # -- response shapes
    def reason(self, i: int) -> str:
        if self.finish[i] == "length":
            return "length"
        return "tool_calls" if self.s.tools and self.calls(i)[1] else "stop"

    def calls(self, i: int) -> tuple[str, list[dict]]:
        """Choice i's reply read for tool calls (utils/data/tools.py): its text before the first
        call and its complete calls in OpenAI's shape (arguments as JSON text, an id each,
        stable for the job); the whole text and [] when tool calls are off."""
        if not self.s.tools:
            return self.text[i], []
        text, calls = parse_reply(self.text[i])
        ids = self.call_ids.setdefault(i, [])
        while len(ids) < len(calls):
            ids.append(new_id("call").replace("-", "_"))
        return text, [{"id": ids[k], "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                      for k, c in enumerate(calls)]

    def lp_echo(self, i: int) -> dict:
        """Choice i's echoed prompt as completion logprobs: each token of the prompt's text (BOS
        left out: it has no text) with its log-probability given the tokens before it (BOS
        included, so the first text token has one too; None only where nothing precedes it)
        and its k alternatives; ``text_offset`` where the token starts in the prompt's text."""
        seq = self.seqs[i]
        scored = seq.prompt_logprobs or []
        bos = self.m.tok.bos_token_id
        items = ([] if bos is not None and seq.prompt[:1] == [bos] else [(seq.prompt[0], None, None)]) + scored
        ids = [t for t, _, _ in items]
        offsets, text = [], TextDecoder(self.m.tok)     # a token starts where the text shown so far ends
        for t in ids:
            offsets.append(len(text.shown))
            text.push(t)
        return {"tokens": [self.m.token_text(t) for t in ids],
                "token_logprobs": [lp for _, lp, _ in items],
                "top_logprobs": [None if top is None else {self.m.token_text(a): b for a, b in top}
                                 for _, _, top in items],
                "text_offset": offsets}

    def lp_completion(self, i: int, start: int = 0) -> Optional[dict]:
        if self.s.logprobs is None:
            return None
        items = self.logprobs[i][start:]
        toks = [self.m.token_text(t) for t, _, _ in items]
        offsets, pos = [], len(self.texts[i // self.s.n]) if self.s.echo else 0
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": toks, "token_logprobs": [lp for _, lp, _ in items],
                "top_logprobs": [{self.m.token_text(a): b for a, b in top} for _, _, top in items],
                "text_offset": offsets}

    def lp_chat(self, i: int, start: int = 0) -> Optional[dict]:
        if self.s.logprobs is None:
            return None

        def entry(t, lp):
            return {"token": self.m.token_text(t), "logprob": lp, "bytes": list(self.m.token_bytes(t))}
        return {"content": [dict(entry(t, lp), top_logprobs=[entry(a, b) for a, b in top])
                            for t, lp, top in self.logprobs[i][start:]]}
