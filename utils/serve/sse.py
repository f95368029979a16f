"""The server-sent events of a streamed request of ``serve`` (``"stream": true``; library: no
side effects).

    StreamingResponse(event_stream(job, log), media_type="text/event-stream")

Contract: the role first (chat; a completion with ``echo`` and no logprobs: the prompts), text
deltas, each choice's finish_reason, the usage chunk when asked for, then ``data: [DONE]``.
What one wake-up brought (:class:`~utils.serve.job.Job`) goes out in one write (the last one
with the usage chunk and ``[DONE]``), a choice's new tokens in one chunk: their text joined
(and their logprobs, one entry per token); with ``serve.stream_interval`` 0 every token is a
chunk of its own, sent as soon as the event loop takes it. A plain text delta is its choice's
JSON template with the text filled in. An engine error, or the engine stopping, ends the stream
with an error event in OpenAI's shape, then ``[DONE]``. However the stream ends (the client
leaving included), the job's unfinished sequences are cancelled and its log line written.
"""
from __future__ import annotations

import json
from typing import Optional

from utils.data.tools import CALL_OPEN
from utils.generation.engine import Event
from utils.serve.job import Job
from utils.serve.protocol import error_body, now


async def event_stream(job: Job, log):
    """The stream's writes, each a string of one or more ``data:`` events."""
    c = _Chunks(job)
    try:
        if (first := c.opening()) is not None:
            yield first
        ended = False
        while not ended:
            out, broken = c.wake_up(await job.arrived())
            ended = broken or job.done
            if ended:                                     # the end goes out with the last tokens
                if c.s.include_usage and job.done:
                    out.append(c.chunk([], job.usage()))
                out.append("data: [DONE]\n\n")
            if out:
                yield "".join(out)
    finally:
        job.cancel()
        job.end(log)


class _Chunks:
    """The ``data:`` events of one request's stream, made from what its Job holds."""

    def __init__(self, job: Job):
        self.job, self.s, self.created = job, job.s, now()
        self.kind = "chat.completion.chunk" if job.chat else "text_completion"
        self.templates: dict[int, tuple[str, str]] = {}
        self.merge = job.m.stream_interval > 0
        self.tools = job.chat and job.s.tools                   # the reply may call tools
        self.sent: dict[int, tuple[int, int]] = {}              # choice -> (text, calls) sent
        # echo with logprobs: a choice's prompt goes out with its scores, which exist once its
        # prompt is prefilled: before the first thing that arrives for it
        self.unechoed = set(range(len(job.seqs))) if self.s.echo and self.s.logprobs is not None else set()

    def chunk(self, choices, usage=None) -> str:
        job = self.job
        body = {"id": job.id, "object": self.kind, "created": self.created, "model": job.m.id,
                "choices": choices}
        if self.s.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def delta(self, i: int, text: str, finish=None, lp_from: Optional[int] = None) -> dict:
        job = self.job
        if job.chat:
            d = {"index": i, "delta": {"content": text} if text else {}, "logprobs": None,
                 "finish_reason": finish}
            if lp_from is not None:
                d["logprobs"] = job.lp_chat(i, lp_from)
        else:
            d = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
            if lp_from is not None:
                d["logprobs"] = job.lp_completion(i, lp_from)
        return d

    def text_chunk(self, i: int, text: str) -> str:
        if i not in self.templates:
            mark = "\x00text\x00"
            self.templates[i] = tuple(self.chunk([self.delta(i, mark)]).split(json.dumps(mark)))
        head, tail = self.templates[i]
        return head + json.dumps(text, ensure_ascii=False) + tail

    def piece(self, i: int, since: tuple[int, int]) -> list[str]:
        """Choice i's chunk of what arrived since ``since`` (its text length and logprob count
        then): text and logprobs, or nothing when neither grew."""
        if self.tools:
            return self.tool_piece(i)
        text = self.job.text[i][since[0]:]
        if len(self.job.logprobs[i]) > since[1]:
            return [self.chunk([self.delta(i, text, None, since[1])])]
        return [self.text_chunk(i, text)] if text else []

    def tool_piece(self, i: int) -> list[str]:
        """Choice i's chunks when its reply may call tools: its text up to where a call could be
        starting (the characters that may open ``<tool_call>``, and the white space before them,
        are held back until they do or do not: a reply with calls has the text a plain answer
        has, utils/data/tools.py parse_reply), then each call once complete, as one
        ``tool_calls`` delta with its id, name and whole arguments (the openai client joins
        deltas by index). A reply that ends without a complete call sends what was held back as
        text."""
        job = self.job
        full, final = job.text[i], job.finish[i] is not None
        at = full.find(CALL_OPEN)
        if at >= 0:
            visible = full[:at].rstrip()
        else:
            held = next((k for k in range(min(len(CALL_OPEN) - 1, len(full)), 0, -1)
                         if full.endswith(CALL_OPEN[:k])), 0)
            visible = full if final else full[:len(full) - held].rstrip()
        out = []
        sent, n_calls = self.sent.get(i, (0, 0))
        if len(visible) > sent:
            out.append(self.text_chunk(i, visible[sent:]))
            sent = len(visible)
        if at >= 0:
            calls = job.calls(i)[1]
            for k in range(n_calls, len(calls)):
                out.append(self.chunk([{"index": i, "delta": {"tool_calls": [{"index": k, **calls[k]}]},
                                        "logprobs": None, "finish_reason": None}]))
            n_calls = len(calls)
            if final and not calls and len(full) > sent:
                out.append(self.text_chunk(i, full[sent:]))
                sent = len(full)
        self.sent[i] = (sent, n_calls)
        return out

    def echo(self, i: int) -> list[str]:
        if i not in self.unechoed:
            return []
        self.unechoed.discard(i)
        return [self.chunk([{"index": i, "text": self.job.texts[i // self.s.n],
                             "logprobs": self.job.lp_echo(i), "finish_reason": None}])]

    def opening(self) -> Optional[str]:
        """The first write, before any event: the assistant's role (chat), or the echoed prompts
        when they carry no logprobs; None otherwise."""
        job, s = self.job, self.s
        if job.chat:
            return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(len(job.seqs))])
        if s.echo and not self.unechoed:
            return self.chunk([self.delta(i, job.texts[i // s.n]) for i in range(len(job.seqs))])
        return None

    def wake_up(self, events: list[Event]) -> tuple[list[str], bool]:
        """The chunks of one wake-up's events, and whether the stream ends with them (an error)."""
        job = self.job
        out, open_ = [], {}                       # choice -> (text length, logprobs) before its tokens
        for e in events:
            i = e.seq.tag
            if e.finish in ("error", "cancelled"):
                for j, since in open_.items():
                    out += self.piece(j, since)
                why = self.broken(e)
                job.take(e)
                return out + [why], True
            out += self.echo(i)
            since = open_.pop(i, None) or (len(job.text[i]), len(job.logprobs[i]))
            job.take(e)
            if e.finish is None and self.merge:
                open_[i] = since                  # more of choice i may follow in this wake-up
                continue
            out += self.piece(i, since)
            if e.finish is not None:
                out.append(self.chunk([self.delta(i, "", job.reason(i))]))
        for i, since in open_.items():
            out += self.piece(i, since)
        return out, False

    @staticmethod
    def broken(e: Event) -> str:
        """The error event of a sequence that failed or that the stopping engine cancelled."""
        why = (error_body(f"generation failed: {e.seq.error}", "server_error", code="engine_error")
               if e.finish == "error" else
               error_body("the server stopped this generation (shutting down).", "server_error",
                          code="cancelled"))
        return f"data: {json.dumps(why)}\n\n"
