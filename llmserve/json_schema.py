"""JSON Schema's structure, as the server's checks and the grammar engines walk it: where subschemas sit, and the
objects a schema leaves open."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# where JSON Schema keeps subschemas: a map of them, one, or a list of them
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames", "additionalItems",
        "unevaluatedProperties", "unevaluatedItems")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def subschemas(node: Any, context: tuple = ()) -> Iterator[tuple[tuple, dict]]:
    """Every schema in node (itself first), each with the keys that lead to it: not the values in const, enum or
    default, which are data."""
    if not isinstance(node, dict):
        return
    yield context, node
    for key in _MAPS:
        for name, sub in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
            yield from subschemas(sub, (*context, key, name))
    for key in _ONE:
        yield from subschemas(node.get(key), (*context, key))
    for key in _LISTS:
        for i, sub in enumerate(node[key]) if isinstance(node.get(key), list) else ():
            yield from subschemas(sub, (*context, key, str(i)))


def close_objects(schema: Any) -> Any:
    """schema with every object that names its properties and says nothing of others closed (additionalProperties
    false), in place: what llama.cpp's and xgrammar's converters do by default. An object of no named properties
    stays open (any object)."""
    for _, node in subschemas(schema):
        if isinstance(node.get("properties"), dict) and node["properties"] and not (
                node.keys() & {"additionalProperties", "patternProperties", "unevaluatedProperties"}):
            node["additionalProperties"] = False
    return schema
