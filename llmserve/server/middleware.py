"""Pure ASGI middleware: API-key auth on /v1/* and the request-body size limit.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass
through untouched.
"""

from __future__ import annotations

import hmac
import json

from llmserve.server.errors import ApiError, error_body


async def _send_error(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": raw})


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <api_key>`` on /v1/*; /health, /metrics and /stats stay open."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            auth = b""
            for k, v in scope["headers"]:
                if k == b"authorization":
                    auth = v
                    break
            scheme, _, token = auth.partition(b" ")
            # compare_digest: the time taken does not reveal how much of the key matched
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                msg = ("missing API key: send 'Authorization: Bearer <key>'" if not auth
                       else "incorrect API key provided")
                await _send_error(send, 401, error_body(msg, "authentication_error", None, "invalid_api_key"),
                                  [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse request bodies over max_bytes with 413, by Content-Length or while streaming in."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _error(self):
        return error_body(f"the request body is larger than the server's limit of {self.max_bytes} bytes",
                          "invalid_request_error", None, "request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    too_big = int(v) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    return await _send_error(send, 413, self._error())
                break
        seen = 0

        async def counting_receive():
            # a chunked body has no Content-Length: count as it arrives; the ApiError is
            # answered by the app's exception handler as a 413
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise ApiError(413, self._error()["error"]["message"], code="request_too_large")
            return msg

        await self.app(scope, counting_receive, send)
