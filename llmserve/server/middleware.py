"""Pure ASGI middleware: API-key auth on /v1/* (Bearer or x-api-key), the request's size limits (head and body),
the answer's x-request-id, the per-request log line.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass
through untouched.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from starlette.datastructures import Headers

from llmserve.server.errors import ApiError, error_response


class ApiKeyMiddleware:
    """Require the API key on /v1/*, as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>``
    (Anthropic's); /health, /metrics and /stats stay open."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            headers = Headers(scope=scope)
            auth = headers.get("authorization", "").encode("latin-1")
            scheme, _, token = auth.partition(b" ")
            given = [token.strip()] if scheme.lower() == b"bearer" else []
            if "x-api-key" in headers:
                given.append(headers["x-api-key"].encode("latin-1").strip())
            # compare_digest: the time taken does not reveal how much of the key matched
            if not any([hmac.compare_digest(k, self._key) for k in given]):
                msg = ("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
                       if not auth and "x-api-key" not in headers else "incorrect API key provided")
                err = ApiError(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await error_response(err, scope)(scope, receive, send)
        await self.app(scope, receive, send)


def head_too_large(limit: int) -> ApiError:
    """The 431 for a request line + headers over server.max_header_bytes."""
    return ApiError(431, f"the request head is larger than the server's limit of {limit} bytes",
                    code="headers_too_large")


class SizeLimitMiddleware:
    """Refuse a head over max_header_bytes with 431, a body over max_bytes with 413 (by Content-Length or as it arrives).

    The transport (llmserve/server/transport.py) stops buffering a head past the limit; a complete
    head that arrived in one read is measured here.
    """

    def __init__(self, app, max_bytes: int, max_header_bytes: int):
        self.app = app
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes

    def _error(self) -> ApiError:
        return ApiError(413, f"the request body is larger than the server's limit of {self.max_bytes} bytes",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        head = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + sum(
            len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > self.max_header_bytes:
            return await error_response(head_too_large(self.max_header_bytes), scope)(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await error_response(self._error(), scope)(scope, receive, send)
        seen = 0

        async def counting_receive():
            # a chunked body has no Content-Length: count as it arrives; the ApiError is
            # answered by the app's exception handler as a 413
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()
            return msg

        await self.app(scope, counting_receive, send)


class RequestIdMiddleware:
    """Every answer carries `x-request-id`, as OpenAI's do (the openai SDK reads it as `_request_id`): the client's
    own X-Request-Id where it sent a usable one (1-128 of [A-Za-z0-9._:-]), else a new one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        header = (b"x-request-id", given if _ID.fullmatch(given) else f"req_{uuid.uuid4().hex}".encode())

        async def with_id(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", ()), header]}
            await send(msg)

        await self.app(scope, receive, with_id)


_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


class RequestLogMiddleware:
    """server.log_requests: one line per request once its response ends: id, route, status, tokens, latency.

    The generation routes leave their Answer in request.state (its id and usage); never the prompt or the key.
    A stream the client left, or a response the app failed, still gets its line, when the app returns.
    """

    def __init__(self, app):
        self.app = app
        self.log = logging.getLogger("llmserve.requests")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, logged = time.perf_counter(), 0, False

        def line() -> None:
            nonlocal logged
            logged = True
            answer = scope.get("state", {}).get("answer")
            u = answer.usage() if answer is not None else {}
            self.log.info("%s %s %s %d prompt_tokens=%s completion_tokens=%s latency_ms=%.1f",
                          answer.id if answer is not None else "-", scope["method"], scope["path"], status,
                          u.get("prompt_tokens", "-"), u.get("completion_tokens", "-"), (time.perf_counter() - t0) * 1e3)

        async def logging_send(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                line()

        try:
            await self.app(scope, receive, logging_send)
        finally:
            if not logged:
                line()
