"""The answers of ``serve`` (library; no side effects): an admitted request's job run to its
answer, and the error response every refusal is written with.

    return await answer(request, job, log)     submits the job; a stream (utils/serve/sse.py), or
                                               once every sequence finished one JSON body in
                                               OpenAI's completion or chat shape
    ErrorResponse(error_body(...), status_code=400)

:func:`answer` raises ApiError 400 when the lane refuses a sequence, 503 (``Connection: close``)
while the engine stops, 500 when generation failed; a client that disconnects while it waits
for a JSON body cancels the job's sequences. One log line per request, once it ends.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from utils.serve.job import Job
from utils.serve.protocol import ApiError, now
from utils.serve.sse import event_stream


class ErrorResponse(JSONResponse):
    """An error body as ASCII-escaped JSON: it encodes whatever client text a message quotes
    (JSONResponse writes UTF-8, which a lone surrogate from a JSON escape cannot be)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


async def answer(request: Request, job: Job, log):
    try:
        job.submit()
    except ValueError as e:
        job.cancel()
        raise ApiError(400, str(e), None, "invalid_value") from None
    except RuntimeError:                # Lane.submit: the engine is stopping (SIGINT / SIGTERM)
        job.cancel()
        raise ApiError(503, "the server is shutting down and takes no new requests; send it to "
                       "another server, or again once this one is back.", None, "shutting_down",
                       "server_error", headers={"Connection": "close"}) from None
    if job.s.stream:
        return StreamingResponse(event_stream(job, log), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        while not job.done:
            for e in await job.arrived():
                job.take(e)
    finally:
        watcher.cancel()
        job.cancel()
    job.end(log)
    if job.error():
        raise ApiError(500, f"generation failed: {job.error()}", None, "engine_error", "server_error")
    return JSONResponse(full_body(job))


async def _watch_disconnect(request: Request, job: Job) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancel()
            return


def full_body(job: Job) -> dict:
    """The JSON body of a finished job: every choice's text (a completion's echoed prompt
    first), logprobs and finish reason, and the usage."""
    s, created, model = job.s, now(), job.m.id
    choices = []
    for i, _ in enumerate(job.seqs):
        if job.chat:
            text, calls = job.calls(i)
            message = {"role": "assistant", "content": text or None} if calls else {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": i, "message": message, "logprobs": job.lp_chat(i), "finish_reason": job.reason(i)})
        else:
            text = (job.texts[i // s.n] if s.echo else "") + job.text[i]
            lp = job.lp_completion(i)
            if lp is not None and s.echo:
                lp = {k: v + lp[k] for k, v in job.lp_echo(i).items()}
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": job.reason(i)})
    return {"id": job.id, "object": "chat.completion" if job.chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": job.usage()}
