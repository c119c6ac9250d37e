"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmserve.interfaces import ResponseStore
from llmserve.server.errors import ApiError, bad_request
from llmserve.server.routes import admit, chat_ids
from llmserve_responses.answer import ResponsesAnswer
from llmserve_responses.request import ResponsesRequest

_MAX_LIMIT = 100  # input_items per page, as OpenAI


class Responses:
    """The endpoints, over one response store."""

    def __init__(self, store: ResponseStore):
        self.store = store

    async def create(self, request: Request) -> Response:
        """POST /v1/responses."""
        st, client, req, sp = await admit(request, ResponsesRequest)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = (await self._record(req.previous_response_id, "previous_response_id"))["items"]
            req.use(history)
        ids, prompt = await chat_ids(st, req.chat, sp)
        return await ResponsesAnswer(st, req, sp, ids, prompt, history, self.store).respond(request, client)

    async def stored(self, request: Request) -> Response:
        """GET /v1/responses/{response_id}: the stored response; DELETE: forget it."""
        rid = request.path_params["response_id"]
        if request.method == "GET":
            return JSONResponse((await self._record(rid))["response"])
        if not await asyncio.to_thread(self.store.delete, rid):
            raise _not_found(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        """GET /v1/responses/{response_id}/input_items: the input items of that request (?limit, order, after)."""
        items = (await self._record(request.path_params["response_id"]))["input"]
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", "order")
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            raise bad_request("limit must be an integer", "limit") from None
        if not 1 <= limit <= _MAX_LIMIT:
            raise bad_request(f"limit must be 1 to {_MAX_LIMIT}", "limit")
        items = items[::-1] if order == "desc" else items
        if "after" in q:
            at = next((i for i, it in enumerate(items) if it.get("id") == q["after"]), None)
            if at is None:
                raise bad_request(f"no input item {q['after']!r} in this response", "after")
            items = items[at + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    async def _record(self, rid: str, param: str | None = None) -> dict[str, Any]:
        rec = await asyncio.to_thread(self.store.get, rid)
        if rec is None:
            raise _not_found(rid, param)
        return rec


def _not_found(rid: str, param: str | None = None) -> ApiError:
    """OpenAI's 404 for a response it does not have (previous_response_not_found for previous_response_id)."""
    if param is not None:
        return ApiError(404, f"Previous response with id '{rid}' not found.", param=param,
                        code="previous_response_not_found")
    return ApiError(404, f"No response found with id '{rid}'. It was not stored (store: false), was deleted, or "
                         "the response store dropped it to stay within its cap.", code="response_not_found")


@functools.cache
def openapi() -> dict[str, Any]:
    """POST /v1/responses' OpenAPI path item and the schemas it refers to (from the body's model)."""
    schema = ResponsesRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    error = {"description": "OpenAI's error body: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"}
    return {"path": {"post": {
        "summary": "Create a model response (OpenAI's Responses API)",
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ResponsesRequest"}}}},
        "responses": {"200": {"description": "a Response object, or its typed server-sent events when stream is "
                                             "true"}, "400": error, "404": error, "429": error, "503": error}}},
        "schemas": {**defs, "ResponsesRequest": schema}}
