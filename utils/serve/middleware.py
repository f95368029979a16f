"""The ASGI middleware of ``serve`` (library; no side effects): each wraps the app and answers
a request itself only when it refuses it, in OpenAI's error shape.

    app.add_middleware(BearerAuth, key=api_key)     /v1/ and /metrics requests need the key (401)
    has_key(scope, key)                             whether a request carries the key (/health's details)
    app.add_middleware(AsteriskForm)                the request target ``*`` (OPTIONS: 200; else 400)

Plain ASGI: an ``@app.middleware("http")`` function relays every streamed chunk through
another task.
"""
from __future__ import annotations

import hmac

from fastapi.responses import Response
from starlette.datastructures import Headers

from utils.serve.protocol import clip, error_body
from utils.serve.responses import ErrorResponse


class AsteriskForm:
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


def has_key(scope, want: bytes) -> bool:
    """Whether the request carries ``Authorization: Bearer <want>`` (the scheme's name is
    case-insensitive, RFC 9110 11.1: "bearer KEY" is as good; the key is compared in constant time)."""
    scheme, _, token = Headers(scope=scope).get("authorization", "").strip().partition(" ")
    return hmac.compare_digest(token.strip().encode("latin-1"), want) and scheme.lower() == "bearer"


class BearerAuth:
    """``/v1/`` and ``/metrics`` requests need ``Authorization: Bearer <key>`` (401 otherwise)."""

    PROTECTED = ("/v1/", "/metrics")

    def __init__(self, app, key: str):
        self.app, self.want = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.PROTECTED):
            if not has_key(scope, self.want):
                reply = ErrorResponse(error_body("missing or incorrect API key: send the header "
                                                 "'Authorization: Bearer <key>'.", code="invalid_api_key"),
                                      status_code=401)
                return await reply(scope, receive, send)
        await self.app(scope, receive, send)
