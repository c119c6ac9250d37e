"""POST /v1/messages and POST /v1/messages/count_tokens, and their OpenAPI description."""

from __future__ import annotations

import functools
from typing import Any

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmserve.server.protocol import validate
from llmserve.server.routes import admit, chat_ids, chat_prompt_ids
from llmserve.server.state import ServerState
from llmserve_anthropic.answer import MessagesAnswer
from llmserve_anthropic.protocol import CountTokensRequest, MessagesRequest


async def messages(request: Request) -> Response:
    """POST /v1/messages: one assistant message, whole or as Anthropic's events."""
    st, client, req, sp = await admit(request, MessagesRequest)
    ids, prompt = await chat_ids(st, req.chat_request, sp)
    return await MessagesAnswer(st, req, sp, ids, prompt).respond(request, client)


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: {"input_tokens"} of the prompt /v1/messages would render from the body."""
    st: ServerState = request.app.state.llm
    st.admit()
    req = validate(CountTokensRequest, await request.body(), request.url.path)
    st.check_model(req.model)
    chat = req.chat()
    chat.sampling(st.model.generation_defaults)  # the chat request's own rules (tools, tool_choice, structure)
    return JSONResponse({"input_tokens": len(await chat_prompt_ids(st, chat))})


@functools.cache
def openapi() -> dict[str, dict[str, Any]]:
    """Each route's OpenAPI path item and the schemas they refer to (from the body models)."""
    refs, schemas = models_json_schema([(MessagesRequest, "validation"), (CountTokensRequest, "validation")],
                                       ref_template="#/components/schemas/{model}")
    defs = schemas.get("$defs", {})
    error = {"description": "Anthropic's error body: {\"type\": \"error\", \"error\": {\"type\", \"message\"}}"}

    def post(model, summary: str, answer: str) -> dict[str, Any]:
        return {"path": {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": refs[(model, "validation")]}}},
            "responses": {"200": {"description": answer}, "400": error, "401": error, "404": error, "429": error,
                          "503": error}}}, "schemas": defs}

    return {"/v1/messages": post(MessagesRequest, "Create a message (Anthropic's Messages API)",
                                 "the message, or Anthropic's server-sent events when stream is true"),
            "/v1/messages/count_tokens": post(CountTokensRequest, "Count the tokens of a Messages prompt",
                                              "{\"input_tokens\": N}")}
