"""What a request of ``serve`` must pass before anything runs (library; no side effects): its
body read within the limits as UTF-8 JSON, the model it names, and room for it in that model's
context and queue. Each refusal is an :class:`~utils.serve.protocol.ApiError` (OpenAI's error
body and its HTTP status), raised before a sequence is made.

    body = await read_json(request, limits, log)     415, 413, 408 (connection closed), 400
    m = pick_model(models, s.model)                  400 (none named among several), 404
    prompts = fit(m, s, prompts, chat)               400 context_length_exceeded / too many
                                                     sequences, 429 with Retry-After: queue full
    s.grammar = await compile_grammar(s, lead, calls)
                                                     the output grammar (response_format, tools in
                                                     the model's call format), compiled off the
                                                     event loop: 400 past MAX_SCHEMA_BYTES or
                                                     COMPILE_SECONDS
"""
from __future__ import annotations

import asyncio
import codecs
import json
from typing import Callable, Optional

from fastapi import Request

from utils.config import json_error_text
from utils.serve.protocol import (MAX_SCHEMA_BYTES, ApiError, Limits, Sampling, build_grammar, clip,
                                  constraint_size, shown)
from utils.serve.served import ServedModel

RETRY_AFTER = 1                     # seconds a 429 asks the client to wait (Retry-After)
COMPILE_SECONDS = 10.0              # the longest a request's grammar may take to compile


async def read_json(request: Request, limits: Limits, log: Callable[[str], None]):
    """The body as JSON: uncompressed (415 otherwise), at most ``limits.max_body_bytes`` (413
    beyond, read no further), UTF-8 (:func:`_utf8`), all here within ``limits.read_timeout``
    seconds of the start of its reading (408 with ``Connection: close`` otherwise, however the
    bytes trickle in, and one log line; utils/serve/connections.py bounds the headers and any body
    nobody reads). A client that leaves before its body is all here raises ClientDisconnect
    (one log line, no answer: see utils/serve/app.py)."""
    encoding = request.headers.get("content-encoding", "").strip()
    if encoding.lower() not in ("", "identity"):
        raise ApiError(415, f"Content-Encoding '{clip(encoding)}' is not supported; send the JSON "
                       "uncompressed (no Content-Encoding header).", None, "unsupported_content_encoding")
    cap = limits.max_body_bytes
    too_big = ApiError(413, f"the request body is larger than {cap} bytes (12 x serve.max_prompt_chars "
                       "+ 1 MiB).", None, "request_too_large", headers={"Connection": "close"})  # the rest is unread
    if int(request.headers.get("content-length") or 0) > cap:
        raise too_big
    raw = bytearray()
    try:
        async with asyncio.timeout(limits.read_timeout):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > cap:
                    raise too_big
    except TimeoutError:
        length = request.headers.get("content-length")
        of = f" of its {clip(length, 20)}" if length else ""
        log(f"a request to {clip(request.url.path)} sent {len(raw)}{of} body bytes in serve.read_timeout "
            f"({limits.read_timeout:g} s): answered 408, connection closed")
        raise ApiError(408, f"the request body did not arrive within {limits.read_timeout:g} s (serve.read_timeout; "
                       f"{len(raw)}{of} bytes came): send it without pausing.", None, "request_timeout",
                       headers={"Connection": "close"}) from None
    try:
        return json.loads(_utf8(bytes(raw)))
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}).", None, "invalid_json") from None
    except (ValueError, RecursionError) as e:     # too deep, an integer of 4,300+ digits
        raise ApiError(400, f"the request body is not valid JSON: {json_error_text(e)}.", None,
                       "invalid_json") from None


def _utf8(raw: bytes) -> str:
    """The body's text as strict UTF-8 (a leading byte order mark allowed, as RFC 8259 lets a
    parser): ``json.loads`` on bytes would guess UTF-16 or UTF-32 and take them. 400 naming
    the first bad byte's offset."""
    nul = raw.find(b"\x00")            # never in JSON text; in every ASCII character of UTF-16/32
    if nul >= 0:
        raise ApiError(400, f"the request body is not UTF-8 JSON: a NUL byte at offset {nul} (UTF-16 "
                       "or UTF-32?); send the JSON encoded as UTF-8.", None, "invalid_json")
    skip = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte 0x{e.object[e.start]:02x} at offset "
                       f"{skip + e.start}); send the JSON encoded as UTF-8.", None, "invalid_json") from None


def pick_model(models: dict, name: Optional[str]) -> ServedModel:
    """The model a request names: a served model's id, ``id:adapter`` for one of its LoRA
    adapters (utils/generation/adapters.py), or an adapter's bare name where only one model
    has an adapter of that name (as vLLM names a LoRA)."""
    if name is None:
        if len(models) == 1:
            return next(iter(models.values()))
        raise ApiError(400, f"'model' is required: this server has {', '.join(models)}.", "model",
                       "missing_required")
    if name in models:
        return models[name]
    base, colon, adapter = name.rpartition(":")
    if colon and base in models and adapter in models[base].adapters:
        return models[base].with_adapter(adapter)
    owners = [m for m in models.values() if name in m.adapters]
    if len(owners) == 1:
        return owners[0].with_adapter(name)
    known = [*models, *(f"{k}:{a}" for k, m in models.items() for a in m.adapters)]
    raise ApiError(404, f"the model '{clip(name, 80)}' does not exist here; GET /v1/models lists "
                   f"{clip(', '.join(known), 400)}.", "model", "model_not_found")


def fit(m: ServedModel, s: Sampling, prompts: list[list[int]], chat: bool) -> list[list[int]]:
    """``prompts`` if they fit: 400 ``context_length_exceeded`` naming the prompt's field when
    the prompt alone fills the context, else the max_tokens field that was sent; 400 for more
    sequences than the queue ever holds; 429 (with Retry-After) while the queue is full."""
    for ids in prompts:
        room = m.context - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, which leaves no room for a reply in "
                           f"the model's context of {m.context} tokens: shorten the prompt.",
                           "messages" if chat else "prompt", "context_length_exceeded")
        if s.max_tokens is not None and s.max_tokens > room:
            field = s.max_tokens_param
            raise ApiError(400, f"the prompt is {len(ids)} tokens + {field} {shown(s.max_tokens)}, more "
                           f"than the model's context of {m.context} tokens: lower {field} to at most "
                           f"{room}, or shorten the prompt.", field, "context_length_exceeded")
    asked = len(prompts) * s.n
    if asked > m.max_queue:
        raise ApiError(400, f"this request is {asked} sequences (prompts x n), more than model "
                       f"'{m.id}' ever queues (serve.max_queue {m.max_queue}): ask for fewer choices.",
                       "n", "invalid_value")
    if m.lane.active + asked > m.max_queue:
        raise ApiError(429, f"the server is busy ({m.lane.active} sequences running or waiting for "
                       f"model '{m.id}', serve.max_queue {m.max_queue}); retry later.", None,
                       "rate_limit_exceeded", "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER)})
    return prompts


async def compile_grammar(s: Sampling, lead: str = "", calls=None) -> Optional[str]:
    """The request's output grammar (None without a constraint; tool calls in the model's call
    format ``calls``, default ours), compiled in a worker thread so
    that a large schema never stalls the streams the event loop serves: 400
    ``schema_too_large`` past MAX_SCHEMA_BYTES of schema JSON (nothing compiled), 400
    ``schema_too_complex`` when compiling takes over COMPILE_SECONDS (llguidance's own fuel
    limits, utils/generation/constrained.py LIMITS, end it soon after), 400 naming what the
    compiler cannot enforce."""
    if s.constraint is None:
        return None
    param = "response_format.json_schema.schema" if s.constraint[0] == "json" else "tools"
    size = constraint_size(s.constraint)
    if size > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"'{param}' is {size:,} bytes of JSON schema; at most {MAX_SCHEMA_BYTES:,} are "
                       "allowed: send a smaller schema.", param, "schema_too_large")
    try:
        return await asyncio.wait_for(asyncio.to_thread(build_grammar, s.constraint, lead, calls), COMPILE_SECONDS)
    except TimeoutError:
        raise ApiError(400, f"'{param}' did not compile into a grammar within {COMPILE_SECONDS:g} s: send a "
                       "simpler schema (fewer alternatives, shorter patterns).", param, "schema_too_complex") from None
