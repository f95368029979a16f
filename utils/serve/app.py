"""The OpenAI-compatible HTTP app of ``serve`` (library: building the app starts nothing; the
stage script runs it with uvicorn).

    app = create_app(models, limits, api_key=None, log=print)

``models``: model id -> :class:`~utils.serve.served.ServedModel` (an opened checkpoint and its
:class:`~utils.generation.loop.Lane` on the server's one engine thread). Endpoints: ``GET /``
(the chat page, ``utils/serve/static``), ``GET /health`` (its prefix-cache figures behind the key
when one is set), ``GET /v1/models`` (and
``/v1/models/{id}``; a LoRA adapter is listed as ``base:name``), each also answering HEAD (GET's
headers, no body), ``POST /v1/completions``, ``POST /v1/chat/completions`` (plain JSON or
server-sent events; ``model`` ``base:name`` runs the adapter), ``GET /v1/adapters``, ``POST
/v1/adapters``, ``DELETE /v1/adapters/{name}`` and vLLM's ``POST /v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` (utils/serve/adapters.py), ``GET
/metrics`` (Prometheus, utils/serve/metrics.py; behind the key when one is set); a 405
names the methods a path takes (``Allow``). Every error is OpenAI's JSON shape with a 4xx/5xx status
(utils/serve/protocol.py), written ASCII-escaped so it encodes whatever client text it quotes;
a client that leaves while sending its body costs one short log line, and a body that does not
all arrive within ``limits.read_timeout`` seconds is answered 408 and its connection closed
(utils/serve/connections.py bounds idle connections and slow headers). A request's sequences
(``n`` of them per prompt, choice i seeded ``seed + i``) join the model's running batch; a
client that disconnects cancels them at the next step. One log line per request: id, model, prompt and
completion tokens, time to first token, tokens/s, finish reasons.

This module is the routes and what wraps them; a request passes through utils/serve/intake.py
(body, model, room), runs as a utils/serve/job.py Job and is answered by
utils/serve/responses.py (one JSON body) or utils/serve/sse.py (a stream); the key and the
``*`` target are utils/serve/middleware.py's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional
from typing import Sequence as Sequence_

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from utils.serve.adapters import AdapterAdmin, field
from utils.serve.connections import INVALID_HTTP
from utils.serve.intake import compile_grammar, fit, pick_model, read_json
from utils.serve.job import Job
from utils.serve.metrics import ServeMetrics
from utils.serve.middleware import AsteriskForm, BearerAuth, has_key
from utils.serve.protocol import ApiError, Limits, clip, error_body, new_id, read_chat, read_completion
from utils.serve.responses import ErrorResponse, answer
from utils.serve.served import ServedModel

STATIC = Path(__file__).resolve().parent / "static"
# the chat page and its files: scripts, styles and requests from this server only, no page of
# another site may frame it (clickjacking), and no browser guesses another type for a file
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                                           "form-action 'none'; object-src 'none'",
                "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"}


def create_app(models: dict[str, ServedModel], limits: Limits, api_key: Optional[str] = None,
               log: Callable[[str], None] = print, cors_origins: Sequence_[str] = (),
               runtime_adapters: bool = True) -> FastAPI:
    """The API and the chat page. ``cors_origins`` (serve.cors_origins, checked by
    :func:`utils.serve.protocol.check_origins`): pages of these origins may call it from a
    browser; a preflight (OPTIONS, which never carries the key) is answered before the key check.
    ``runtime_adapters`` False: loading and unloading adapters is refused (403; serve: a server
    without an API key that listens beyond loopback)."""
    app = FastAPI(title="llm-pipeline serve", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServeMetrics(models)
    _error_handlers(app, log, metrics)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)
    app.add_middleware(AsteriskForm)
    if cors_origins:                                  # added last: the outermost, before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_credentials=False,
                           allow_methods=["GET", "HEAD", "POST"], allow_headers=["Authorization", "Content-Type"],
                           max_age=600)
    _page_routes(app, models, api_key)
    _generation_routes(app, models, limits, log, metrics)
    _adapter_routes(app, models, limits, log, runtime_adapters)

    @_get(app, "/metrics")
    async def _metrics():
        body, kind = metrics.render()
        return Response(body, media_type=kind)
    return app


def _error_handlers(app: FastAPI, log: Callable[[str], None], metrics: ServeMetrics) -> None:
    """Every error in OpenAI's shape: ours (ApiError, counted in the metrics), Starlette's 404 /
    405, a client gone before its body arrived (no answer), anything unexpected (500, one log line)."""
    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        metrics.refused(e.status, e.code)
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


def _get(app: FastAPI, path: str):
    """A GET route that answers HEAD too (load balancers and health checkers send HEAD):
    the same status and headers, no body (uvicorn sends none for HEAD; FileResponse
    reads no file)."""
    return app.api_route(path, methods=["GET", "HEAD"])


def _page_routes(app: FastAPI, models: dict[str, ServedModel], api_key: Optional[str] = None) -> None:
    """The chat page and its files, the health check and the model list. ``/health`` is public
    (load balancers call it without a key); where a key is set, its live prefix-cache figures
    (hit counts: what others' prompts share with one's own) go only to a request with the key."""
    @_get(app, "/")
    async def _page():
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    @_get(app, "/static/{name}")
    async def _static(name: str):
        path = STATIC / name
        if name not in {p.name for p in STATIC.iterdir()}:
            raise StarletteHTTPException(404)
        kind = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}.get(path.suffix)
        return FileResponse(path, media_type=kind, headers=PAGE_HEADERS)

    want = api_key.encode() if api_key else None

    @_get(app, "/health")
    async def _health(request: Request):
        details = want is None or has_key(request.scope, want)
        return {"status": "ok", "models": {k: {"active": m.lane.active, "slots": m.lane.slots,
                                               "running": m.lane.running,
                                               **({"prefix_cache": m.lane.prefix_cache} if details else {})}
                                           for k, m in models.items()}}

    @_get(app, "/v1/models")
    async def _models():
        return {"object": "list", "data": [v.describe() for m in models.values()
                                           for v in [m, *(m.with_adapter(a) for a in list(m.adapters))]]}

    @_get(app, "/v1/models/{model_id:path}")        # ids may hold a '/' (exp1/checkpoint_x.pt)
    async def _model_info(model_id: str):
        return pick_model(models, model_id).describe()


def _generation_routes(app: FastAPI, models: dict[str, ServedModel], limits: Limits,
                       log: Callable[[str], None], metrics: ServeMetrics) -> None:
    """POST /v1/completions and /v1/chat/completions: the request read and admitted
    (utils/serve/intake.py), then run and answered as a Job."""
    @app.post("/v1/completions")
    async def _completions(request: Request):
        body = await read_json(request, limits, log)
        s, texts = read_completion(body, limits)
        m = pick_model(models, s.model)
        prompts = [m.completion_ids(t) for t in texts]
        s.grammar = await compile_grammar(s)
        return await answer(request, Job(m, s, fit(m, s, prompts, False), texts, False, new_id("cmpl"),
                                         metrics), log)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        body = await read_json(request, limits, log)
        s, chat = read_chat(body, limits)
        m = pick_model(models, s.model)
        prompts = [m.chat_ids(chat)]
        s.grammar = await compile_grammar(s, m.answer_lead, m.call_format if chat.messages is not None else None)
        return await answer(request, Job(m, s, fit(m, s, prompts, True), [chat.question], True,
                                         new_id("chatcmpl"), metrics), log)



def _adapter_routes(app: FastAPI, models: dict[str, ServedModel], limits: Limits,
                    log: Callable[[str], None], runtime: bool) -> None:
    """LoRA adapters listed, loaded and unloaded at runtime (utils/serve/adapters.py): ``GET
    /v1/adapters``, ``POST /v1/adapters`` ``{"name", "path", "model"}``, ``DELETE
    /v1/adapters/{name}``, and vLLM's ``POST /v1/load_lora_adapter`` ``{"lora_name",
    "lora_path"}`` / ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``."""
    admin = AdapterAdmin(models, log, runtime)

    async def body_of(request: Request, fields: str) -> dict:
        body = await read_json(request, limits, log)
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object {{{fields}}}.", None, "invalid_json")
        return body

    @_get(app, "/v1/adapters")
    async def _list():
        return {"object": "list", "data": admin.listed()}

    @app.post("/v1/adapters")
    async def _load(request: Request):
        body = await body_of(request, '"name", "path", "model"')
        return await admin.load(field(body, "name"), field(body, "path"), field(body, "model", False))

    @app.delete("/v1/adapters/{name:path}")
    async def _unload(name: str):
        return await admin.unload(name)

    @app.post("/v1/load_lora_adapter")                  # vLLM's names for the same
    async def _vllm_load(request: Request):
        body = await body_of(request, '"lora_name", "lora_path"')
        return await admin.load(field(body, "lora_name"), field(body, "lora_path"), field(body, "model", False))

    @app.post("/v1/unload_lora_adapter")
    async def _vllm_unload(request: Request):
        return await admin.unload(field(await body_of(request, '"lora_name"'), "lora_name"))
