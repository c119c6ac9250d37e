"""OpenAI's strict mode for JSON schemas (response_format json_schema and function tools with "strict": true).

OpenAI refuses a strict schema unless its root is an object and every object in it is closed
(additionalProperties false) with every property required; so does this server, with OpenAI's messages. A schema
it takes is then enforced as written, so no object can gain a key the schema does not name.
"""

from __future__ import annotations

import json
from typing import Any

from llmserve.json_schema import subschemas
from llmserve.server.errors import bad_request


def check_strict(schema: Any, what: str, param: str, code: str | None = None) -> None:
    """A 400 naming `param` unless OpenAI's strict mode takes `schema` (`what` names it as OpenAI does)."""
    def refuse(message: str):
        return bad_request(f"Invalid schema for {what}: {message}", param, code)

    root = schema.get("type") if isinstance(schema, dict) else None
    if root != "object":
        got = "no type" if root is None else f"'type: {json.dumps(root)}'"
        raise refuse(f"schema must be a JSON Schema of 'type: \"object\"', got {got}.")
    for context, node in subschemas(schema):
        if not _is_object(node):
            continue
        if node.get("additionalProperties") is not False:
            raise refuse(f"In context={context}, 'additionalProperties' is required to be supplied and to be false.")
        props, required = node.get("properties") or {}, node.get("required") or []
        if not isinstance(props, dict):
            raise refuse(f"In context={context}, 'properties' must be an object.")
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise refuse(f"In context={context}, 'required' must be an array of strings.")
        missing = [k for k in props if k not in required]
        if missing:
            raise refuse(f"In context={context}, 'required' is required to be supplied and to be an array including "
                         f"every key in properties. Missing {missing[0]!r}.")


def _is_object(node: dict) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node
