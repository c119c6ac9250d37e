"""OpenAI-shaped error bodies: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

import json
import logging

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from llmserve.errors import EngineDeadError, InvalidRequestError

log = logging.getLogger("llmserve.server")

# status → OpenAI's error `type` for it, where it is not invalid_request_error (4xx, 404 included: an unknown model or
# URL is one there) or server_error (5xx)
_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answered to the client with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 whose `param` names the offending field."""
    return ApiError(400, message, param=param, code=code)


def error_response(err: ApiError, scope: dict | None = None) -> Response:
    """A JSON response for an ApiError, with its headers (e.g. Retry-After), in the error shape of the route the
    request (its ASGI scope) went to: OpenAI's, or the one a route plugin registered for its API."""
    shape = _shape(scope) if scope is not None and "app" in scope else None
    return Response(json.dumps(shape(err) if shape else err.body()), status_code=err.status,
                    media_type="application/json", headers=err.headers)


def _shape(scope: dict):
    """The error-body function registered for the request's path or a path above it (register_routes' errors=)."""
    path, shapes = scope["path"], scope["app"].state.llm.error_bodies
    return next((f for p, f in shapes.items() if path == p or path.startswith(p + "/")), None)


def map_error(exc: BaseException) -> ApiError:
    """A failure of one request (ours, the engine's checks, a stopped engine, any other) as the client's ApiError."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param, exc.code)
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), code="engine_unavailable")
    return ApiError(500, f"{type(exc).__name__}: {exc}", code="engine_error")


async def handle_error(request: Request, exc: ApiError | InvalidRequestError) -> Response:
    return error_response(map_error(exc), request.scope)


async def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    st = request.app.state.llm
    if exc.status_code == 404 and not st.ready and st.load_error is None:  # plugin routes (/, /metrics) come later
        return error_response(ApiError(503, f"no route {request.method} {request.url.path} yet: the model is loading, "
                                            "and plugins add their routes (such as /) once it is ready",
                                       code="not_ready", headers={"Retry-After": "5"}), request.scope)
    msg = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(ApiError(exc.status_code, msg, code=code, headers=dict(exc.headers or {})), request.scope)


async def handle_disconnect(request: Request, exc: ClientDisconnect) -> Response:
    """A client that left while its body was read: nobody to answer, nothing to log (the request log says 499)."""
    return Response(status_code=499)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ApiError(500, f"internal server error: {type(exc).__name__}", code="internal_error"),
                          request.scope)


EXCEPTION_HANDLERS = {
    ApiError: handle_error,
    InvalidRequestError: handle_error,
    EngineDeadError: handle_error,  # any route that needs the engine after it stopped: 503
    HTTPException: handle_http_exception,
    ClientDisconnect: handle_disconnect,
    Exception: handle_unexpected,
}
