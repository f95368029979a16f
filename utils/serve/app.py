"""The OpenAI-compatible HTTP app of ``serve`` (library: building the app starts nothing; the
stage script runs it with uvicorn).

    app = create_app(models, limits, api_key=None, log=print)

``models``: model id -> :class:`ServedModel` (an opened checkpoint and its
:class:`~utils.generation.loop.Lane` on the server's one engine thread). Endpoints: ``GET /``
(the chat page, ``utils/serve/static``), ``GET /health``, ``GET /v1/models`` (and
``/v1/models/{id}``), each also answering HEAD (GET's headers, no body), ``POST
/v1/completions``, ``POST /v1/chat/completions`` (plain JSON or server-sent events); a 405
names the methods a path takes (``Allow``). Every error is OpenAI's JSON shape with a 4xx/5xx status
(utils/serve/protocol.py), written ASCII-escaped so it encodes whatever client text it quotes;
a client that leaves while sending its body costs one short log line, and a body that does not
all arrive within ``limits.read_timeout`` seconds is answered 408 and its connection closed
(utils/serve/connections.py bounds idle connections and slow headers). A request's sequences
(``n`` of them per prompt, choice i seeded ``seed + i``) join the model's running batch; a
client that disconnects cancels them at the next step. One log line per request: id, model, prompt and
completion tokens, time to first token, tokens/s, finish reasons.
"""
from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import re
import time
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional
from typing import Sequence as Sequence_

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from utils.config import json_error_text
from utils.data.chat import ChatTemplateError, answer_decoding, chat_prompt_ids
from utils.generation.detok import TextDecoder
from utils.generation.engine import UNBOUNDED, Event, SamplingParams, Sequence
from utils.serve.connections import INVALID_HTTP
from utils.serve.protocol import (ApiError, Chat, Limits, Sampling, clip, error_body, new_id, now,
                                  read_chat, read_completion, shown)

STATIC = Path(__file__).resolve().parent / "static"
# the chat page and its files: scripts, styles and requests from this server only, no page of
# another site may frame it (clickjacking), and no browser guesses another type for a file
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                                           "form-action 'none'; object-src 'none'",
                "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"}
RETRY_AFTER = 1                     # seconds a 429 asks the client to wait (Retry-After)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character each byte is written as in a
    byte-level BPE vocabulary (printable Latin-1 bytes as themselves, the other 68 as U+0100
    onwards, in byte order) -> that byte."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


BYTE_ALPHABET = _byte_alphabet()
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")     # a SentencePiece byte-fallback piece


def _has_type(node: dict, name: str) -> bool:
    """Whether a tokenizers component's JSON is of type ``name`` or a sequence holding one."""
    return node.get("type") == name or any(_has_type(d, name) for d in node.get("decoders") or [])


@dataclass
class ServedModel:
    id: str
    tok: object
    kind: str                       # pretrain | sft | hf
    rules: object                   # utils.data.chat.Rules: chat template (None: completions only), BOS, stops
    lane: object                    # a Lane (utils/generation/loop.py) or RemoteLane (remote.py)
    created: int
    quantize: str = "none"
    max_queue: int = 256
    default_max_tokens: int = 256
    stream_interval: float = 0.0    # seconds between two wake-ups of a request's stream (Job)

    @property
    def context(self) -> int:
        return self.lane.capacity

    @property
    def template(self) -> Optional[dict]:
        return self.rules.template

    def completion_ids(self, text: str) -> list[int]:
        return self.rules.prompt_ids(self.tok, text)

    def chat_ids(self, chat: Chat) -> list[int]:
        """The conversation through the model's own chat template (utils/data/chat.py: a public
        model's Jinja template, or ours, where a system message's text opens the first user turn)."""
        if self.template is None:
            raise ApiError(400, f"model '{self.id}' is a pre-trained ({self.kind}) model without a chat "
                           "template: use POST /v1/completions with a plain prompt, or serve an SFT "
                           "checkpoint for chat.", "model", "chat_not_supported")
        try:
            return chat_prompt_ids(self.tok, self.template, chat.system, chat.history, chat.question)
        except ChatTemplateError as e:
            raise ApiError(400, f"{e}.", "messages", "invalid_value") from None

    def sampling(self, s: Sampling) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) of a request: its own fields, else the model's
        generation_config.json defaults, else OpenAI's (1, off, 1)."""
        d = self.rules.defaults
        pick = lambda v, k, off: v if v is not None else d.get(k, off)   # noqa: E731
        return float(pick(s.temperature, "temperature", 1.0)), int(pick(s.top_k, "top_k", 0)), float(pick(s.top_p, "top_p", 1.0))

    def token_text(self, token: int) -> str:
        piece = self.tok.convert_ids_to_tokens(int(token))
        text = self.tok.convert_tokens_to_string([piece])
        if piece.startswith("\u2581") and not text.startswith(" "):    # SentencePiece word start
            text = " " + text
        return text

    @cached_property
    def byte_level(self) -> bool:
        """Whether the tokenizer is a byte-level BPE (GPT-2 style): its backend decoder is, or
        holds, ByteLevel (a slow tokenizer: it has GPT-2's ``byte_decoder``)."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is None or backend.decoder is None:
            return hasattr(self.tok, "byte_decoder")
        return _has_type(json.loads(backend.decoder.__getstate__()), "ByteLevel")  # its tokenizer.json entry

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes (chat logprobs' ``bytes``: a client joins them to rebuild a
        character split over tokens): a byte-level BPE piece read back through GPT-2's byte
        alphabet; a SentencePiece byte-fallback piece ``<0xHH>`` is that one byte; any other
        token (a special or added one included) the UTF-8 of its text."""
        piece = self.tok.convert_ids_to_tokens(int(token))
        if self.byte_level:
            if all(c in BYTE_ALPHABET for c in piece):
                return bytes(BYTE_ALPHABET[c] for c in piece)
        elif (hit := BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(hit[1], 16)])
        return self.token_text(token).encode("utf-8")

    def describe(self) -> dict:
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "llm-pipeline",
                "kind": self.kind, "chat": self.template is not None,
                "context_length": None if self.context >= UNBOUNDED else self.context,  # None: infini
                "quantize": self.quantize}


# --------------------------------------------------------------------------- one request
class Job:
    """One HTTP request's sequences and what came back for them: events from the engine
    thread wait in ``inbox``; :meth:`arrived` hands the asyncio loop all of them at once.

    The engine thread wakes the loop only when no wake-up is pending and at least
    ``m.stream_interval`` seconds passed since the last one (a finishing event always wakes
    it), and a stream writes what one wake-up brought in one write, a choice's tokens in one
    chunk (see :func:`_sse`). So a request's first token goes out at once, and a model faster
    than 1 / stream_interval tokens/s sends its tokens in groups (at serve.stream_interval
    0.02: at most 50 writes a second per request) instead of paying a thread hand-off, an
    event-loop pass, a JSON chunk, a socket write and the client's parse per token, which for a
    small, fast model is a large share of its CPU time."""

    def __init__(self, m: ServedModel, s: Sampling, prompts: list[list[int]], texts: list[str],
                 chat: bool, rid: str):
        self.m, self.s, self.chat, self.id = m, s, chat, rid
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
                                        prompt_logprobs=s.echo and s.logprobs is not None)
                self.seqs.append(Sequence(ids, params, tok=m.tok, sink=sink, tag=p * s.n + i,
                                          continues=continues, lead=lead, text_by_caller=True))
        self.text = [""] * len(self.seqs)
        self.finish: list[Optional[str]] = [None] * len(self.seqs)
        self.logprobs: list[list] = [[] for _ in self.seqs]

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
        return "length" if self.finish[i] == "length" else "stop"

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


# --------------------------------------------------------------------------- the app
def create_app(models: dict[str, ServedModel], limits: Limits, api_key: Optional[str] = None,
               log: Callable[[str], None] = print, cors_origins: Sequence_[str] = ()) -> FastAPI:
    """The API and the chat page. ``cors_origins`` (serve.cors_origins, checked by
    :func:`utils.serve.protocol.check_origins`): pages of these origins may call it from a
    browser; a preflight (OPTIONS, which never carries the key) is answered before the key check."""
    app = FastAPI(title="llm-pipeline serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return ErrorResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        where = clip(request.url.path)
        what = {404: f"no such endpoint: {clip(request.method)} {where} (see GET /v1/models, "
                     "POST /v1/completions, POST /v1/chat/completions)",
                405: f"method {clip(request.method)} is not allowed on {where}"}.get(e.status_code, str(e.detail))
        return ErrorResponse(error_body(what, code=str(e.status_code)), status_code=e.status_code,
                             headers=e.headers)          # a 405's Allow: the methods the path takes

    @app.exception_handler(ClientDisconnect)
    async def _gone(request, e: ClientDisconnect):
        """The client closed the connection before its body arrived, or the connection was
        closed under the request because its body was not valid HTTP (utils/serve/connections.py
        answered 400 invalid_http and marked the scope): nobody to answer."""
        if request.scope.get(INVALID_HTTP):
            log(f"the body of a request to {clip(request.url.path)} was not valid HTTP/1.1 (e.g. a malformed "
                "chunk): answered 400 invalid_http, connection closed; nothing was run")
        else:
            log(f"a client left while sending its request to {clip(request.url.path)}; nothing was run")
        return Response(status_code=499)      # nginx's "client closed request"; never sent

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        what = f"{type(e).__name__}: {clip(str(e))}"
        log(f"internal error on {clip(request.url.path)}: {what}")
        return ErrorResponse(error_body(f"internal error: {what}", "server_error"), status_code=500)

    if api_key:
        app.add_middleware(_BearerAuth, key=api_key)
    app.add_middleware(_AsteriskForm)
    if cors_origins:                                  # added last: the outermost, before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_credentials=False,
                           allow_methods=["GET", "HEAD", "POST"], allow_headers=["Authorization", "Content-Type"],
                           max_age=600)

    def get(path: str):
        """A GET route that answers HEAD too (load balancers and health checkers send HEAD):
        the same status and headers, no body (uvicorn sends none for HEAD; FileResponse
        reads no file)."""
        return app.api_route(path, methods=["GET", "HEAD"])

    @get("/")
    async def _page():
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    @get("/static/{name}")
    async def _static(name: str):
        path = STATIC / name
        if name not in {p.name for p in STATIC.iterdir()}:
            raise StarletteHTTPException(404)
        kind = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}.get(path.suffix)
        return FileResponse(path, media_type=kind, headers=PAGE_HEADERS)

    @get("/health")
    async def _health():
        return {"status": "ok", "models": {k: {"active": m.lane.active, "slots": m.lane.slots,
                                               "running": m.lane.running}
                                           for k, m in models.items()}}

    @get("/v1/models")
    async def _models():
        return {"object": "list", "data": [m.describe() for m in models.values()]}

    @get("/v1/models/{model_id:path}")              # ids may hold a '/' (exp1/checkpoint_x.pt)
    async def _model_info(model_id: str):
        return _model(models, model_id).describe()

    @app.post("/v1/completions")
    async def _completions(request: Request):
        body = await _json(request, limits, log)
        s, texts = read_completion(body, limits)
        m = _model(models, s.model)
        prompts = [m.completion_ids(t) for t in texts]
        return await _run(request, Job(m, s, _fit(m, s, prompts, False), texts, False, new_id("cmpl")), log)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        body = await _json(request, limits, log)
        s, chat = read_chat(body, limits)
        m = _model(models, s.model)
        prompts = [m.chat_ids(chat)]
        return await _run(request, Job(m, s, _fit(m, s, prompts, True), [chat.question], True,
                                       new_id("chatcmpl")), log)

    return app


class ErrorResponse(JSONResponse):
    """An error body as ASCII-escaped JSON: it encodes whatever client text a message quotes
    (JSONResponse writes UTF-8, which a lone surrogate from a JSON escape cannot be)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


class _AsteriskForm:
    """The request target ``*`` (RFC 9112 3.2.4), which asks about the server as a whole:
    ``OPTIONS *`` gets 200 with the methods the server takes (RFC 9110 9.3.7: ``Allow``, and
    ``Content-Length: 0``); any other method a 400 in OpenAI's shape. Starlette routed ``*``
    as a path, a 404."""

    ALLOW = "GET, HEAD, POST, OPTIONS"

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "*":
            return await self.app(scope, receive, send)
        if scope["method"] == "OPTIONS":
            reply = Response(status_code=200, headers={"Allow": self.ALLOW})
        else:
            reply = ErrorResponse(error_body(f"the request target '*' is for OPTIONS only, not "
                                             f"{clip(scope['method'])}: send a path such as /v1/models.",
                                             code="invalid_request_target"), status_code=400)
        await reply(scope, receive, send)


class _BearerAuth:
    """``/v1/`` requests need ``Authorization: Bearer <key>`` (401 otherwise). Plain ASGI: an
    ``@app.middleware("http")`` function relays every streamed chunk through another task."""

    def __init__(self, app, key: str):
        self.app, self.want = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            scheme, _, token = Headers(scope=scope).get("authorization", "").strip().partition(" ")
            # the scheme's name is case-insensitive (RFC 9110 11.1): "bearer KEY" is as good
            if not (hmac.compare_digest(token.strip().encode("latin-1"), self.want)
                    and scheme.lower() == "bearer"):
                reply = ErrorResponse(error_body("missing or incorrect API key: send the header "
                                                 "'Authorization: Bearer <key>'.", code="invalid_api_key"),
                                      status_code=401)
                return await reply(scope, receive, send)
        await self.app(scope, receive, send)


async def _json(request: Request, limits: Limits, log: Callable[[str], None]):
    """The body as JSON: uncompressed (415 otherwise), at most ``limits.max_body_bytes`` (413
    beyond, read no further), UTF-8 (:func:`_utf8`), all here within ``limits.read_timeout``
    seconds of the start of its reading (408 with ``Connection: close`` otherwise, however the
    bytes trickle in, and one log line; utils/serve/connections.py bounds the headers and any body
    nobody reads). A client that leaves before its body is all here raises ClientDisconnect
    (one log line, no answer: see create_app)."""
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


def _model(models: dict, name: Optional[str]) -> ServedModel:
    if name is None:
        if len(models) == 1:
            return next(iter(models.values()))
        raise ApiError(400, f"'model' is required: this server has {', '.join(models)}.", "model",
                       "missing_required")
    if name not in models:
        raise ApiError(404, f"the model '{clip(name, 80)}' does not exist here; GET /v1/models lists "
                       f"{', '.join(models)}.", "model", "model_not_found")
    return models[name]


def _fit(m: ServedModel, s: Sampling, prompts: list[list[int]], chat: bool) -> list[list[int]]:
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


async def _run(request: Request, job: Job, log):
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
        return StreamingResponse(_sse(job, log), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        while not job.done:
            for e in await job.arrived():
                job.take(e)
    finally:
        watcher.cancel()
        job.cancel()
    log(job.log_line())
    if job.error():
        raise ApiError(500, f"generation failed: {job.error()}", None, "engine_error", "server_error")
    return JSONResponse(_full_body(job))


async def _watch_disconnect(request: Request, job: Job) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancel()
            return


def _full_body(job: Job) -> dict:
    s, created, model = job.s, now(), job.m.id
    choices = []
    for i, _ in enumerate(job.seqs):
        if job.chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": job.text[i]},
                            "logprobs": job.lp_chat(i), "finish_reason": job.reason(i)})
        else:
            text = (job.texts[i // s.n] if s.echo else "") + job.text[i]
            lp = job.lp_completion(i)
            if lp is not None and s.echo:
                lp = {k: v + lp[k] for k, v in job.lp_echo(i).items()}
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": job.reason(i)})
    return {"id": job.id, "object": "chat.completion" if job.chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": job.usage()}


async def _sse(job: Job, log):
    """Server-sent events: the role first (chat), text deltas, each choice's finish_reason,
    the usage chunk when asked for, then ``data: [DONE]``. What one wake-up brought (:class:`Job`)
    goes out in one write (the last one with the usage chunk and ``[DONE]``), a choice's new
    tokens in one chunk: their text joined (and their logprobs, one entry per token); with
    ``serve.stream_interval`` 0 every token is a chunk of its own, sent as soon as the event
    loop takes it. A plain text delta is its choice's JSON template with the text filled in."""
    s, created = job.s, now()
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    templates: dict[int, tuple[str, str]] = {}
    merge = job.m.stream_interval > 0

    def chunk(choices, usage=None) -> str:
        body = {"id": job.id, "object": kind, "created": created, "model": job.m.id, "choices": choices}
        if s.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def delta(i: int, text: str, finish=None, lp_from: Optional[int] = None) -> dict:
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

    def text_chunk(i: int, text: str) -> str:
        if i not in templates:
            mark = "\x00text\x00"
            templates[i] = tuple(chunk([delta(i, mark)]).split(json.dumps(mark)))
        head, tail = templates[i]
        return head + json.dumps(text, ensure_ascii=False) + tail

    def piece(i: int, since: tuple[int, int]) -> list[str]:
        """Choice i's chunk of what arrived since ``since`` (its text length and logprob count
        then): text and logprobs, or nothing when neither grew."""
        text = job.text[i][since[0]:]
        if len(job.logprobs[i]) > since[1]:
            return [chunk([delta(i, text, None, since[1])])]
        return [text_chunk(i, text)] if text else []

    # echo with logprobs: a choice's prompt goes out with its scores, which exist once its
    # prompt is prefilled: before the first thing that arrives for it
    unechoed = set(range(len(job.seqs))) if s.echo and s.logprobs is not None else set()

    def echo(i: int) -> list[str]:
        if i not in unechoed:
            return []
        unechoed.discard(i)
        return [chunk([{"index": i, "text": job.texts[i // s.n], "logprobs": job.lp_echo(i),
                        "finish_reason": None}])]

    def wake_up(events: list[Event]) -> tuple[list[str], bool]:
        """The chunks of one wake-up's events, and whether the stream ends with them (an error)."""
        out, open_ = [], {}                       # choice -> (text length, logprobs) before its tokens
        for e in events:
            i = e.seq.tag
            if e.finish not in ("error", "cancelled"):
                out += echo(i)
            if e.finish in ("error", "cancelled"):
                for j, since in open_.items():
                    out += piece(j, since)
                why = (error_body(f"generation failed: {e.seq.error}", "server_error", code="engine_error")
                       if e.finish == "error" else
                       error_body("the server stopped this generation (shutting down).", "server_error",
                                  code="cancelled"))
                job.take(e)
                return out + [f"data: {json.dumps(why)}\n\n"], True
            since = open_.pop(i, None) or (len(job.text[i]), len(job.logprobs[i]))
            job.take(e)
            if e.finish is None and merge:
                open_[i] = since                  # more of choice i may follow in this wake-up
                continue
            out += piece(i, since)
            if e.finish is not None:
                out.append(chunk([delta(i, "", job.reason(i))]))
        for i, since in open_.items():
            out += piece(i, since)
        return out, False

    try:
        if job.chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(job.seqs))])
        elif s.echo and not unechoed:
            yield chunk([delta(i, job.texts[i // s.n]) for i in range(len(job.seqs))])
        ended = False
        while not ended:
            out, broken = wake_up(await job.arrived())
            ended = broken or job.done
            if ended:                                     # the end goes out with the last tokens
                if s.include_usage and job.done:
                    out.append(chunk([], job.usage()))
                out.append("data: [DONE]\n\n")
            if out:
                yield "".join(out)
    finally:
        job.cancel()
        log(job.log_line())
