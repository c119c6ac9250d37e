"""Structured output through a real server: response_format, structured_outputs, guided_*, token masks.

The fake backend picks among the allowed tokens deterministically, so every test checks what a
client relies on: the text follows the grammar, whatever the model would have preferred.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pydantic
import pytest

from tests.server.conftest import FAKE, start_server
from tests.server.tool_helpers import ECHO, EchoPlugin, script


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=10_000_000)
    capital: bool
    tags: list[str] = pydantic.Field(max_length=2)


@pytest.fixture(scope="module")
def server():
    s = start_server(FAKE | {"model": {"model": "embedded", "max_model_len": 4096}, "cache": {"num_blocks": 1024}})
    yield s
    s.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_sdk_parse_returns_the_pydantic_object(server):
    client = server.client()
    r = client.chat.completions.parse(model="embedded", messages=[{"role": "user", "content": "Paris?"}],
                                      response_format=City, max_tokens=2000)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"
    assert City.model_validate_json(r.choices[0].message.content) == city


def test_json_schema_streamed_with_n_choices_each_validate(server):
    schema = City.model_json_schema() | {"additionalProperties": False}  # strict: closed, as OpenAI wants it
    stream = server.client().chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "two cities"}], n=2, stream=True, max_tokens=2000,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        logprobs=True)
    texts, finish = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert finish == ["stop", "stop"]
    for t in texts:
        jsonschema.validate(json.loads(t), schema)


def test_json_object_on_both_endpoints(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3000,
                                              "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3000, "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["text"]), dict)


@pytest.mark.parametrize("body, check", [
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"guided_json": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
     lambda t: all(0 <= x <= 9 for x in json.loads(t))),
    ({"guided_grammar": 'start: "go " DIR\nDIR: "north" | "south"'}, lambda t: t in ("go north", "go south")),
    ({"structured_outputs": {"regex": "[A-Z]{4}"}}, lambda t: re.fullmatch("[A-Z]{4}", t)),
    ({"structured_outputs": {"choice": ["a b", "c\"d"]}}, lambda t: t in ("a b", 'c"d')),
])
def test_vllm_constraint_fields(server, body, check):
    r = post(server, "/v1/completions", {"prompt": "q", "max_tokens": 200, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_large_choice_lists_and_the_true_schema(server):
    choices = [f"option-{i}" for i in range(20_000)]
    r = post(server, "/v1/completions", {"prompt": "q", "max_tokens": 20, "guided_choice": choices})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in choices
    r = post(server, "/v1/completions", {"prompt": "q", "max_tokens": 3000, "guided_json": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    json.loads(r.json()["choices"][0]["text"])


def test_max_tokens_cuts_a_grammar_with_length(server):
    r = post(server, "/v1/completions", {"prompt": "q", "max_tokens": 4, "guided_regex": "[a-z]{40}"})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and re.fullmatch("[a-z]{4}", c["text"])


def test_allowed_token_ids_and_bad_words(server):
    r = post(server, "/v1/completions", {"prompt": "q", "max_tokens": 12,
                                         "allowed_token_ids": [ord("x"), ord("y"), ord(" ")], "bad_words": ["xx", "yy"]})
    text = r.json()["choices"][0]["text"]
    assert set(text) <= {"x", "y", " "} and "xx" not in text and "yy" not in text, text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body, param", [
    ({"guided_choice": [""], "allowed_token_ids": [ord("0")]}, "allowed_token_ids"),  # only EOS, not allowed
    ({"allowed_token_ids": [ord("x")], "bad_words": ["x"]}, "bad_words"),
    ({"guided_regex": "a+", "bad_words": ["a"]}, "bad_words"),
])
def test_constraints_that_exclude_every_token_are_the_clients_error(server, body, param, stream):
    r = post(server, "/v1/completions", {"prompt": "0", "max_tokens": 5, "stream": stream, **body})
    assert r.status_code == 400, r.text  # found at the first token, before a stream opens: a 400 either way
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and "exclude every token" in err["message"]
    assert server.wait_idle()["cache"]["used_blocks"] == 0


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{oops"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs"),
    ({"allowed_token_ids": [1, 99999]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["1"]}, "allowed_token_ids[0]"),
    ({"bad_words": "xx"}, "bad_words"),
    ({"guided_regex": "a{1000000}"}, "guided_regex"),  # past llguidance's lexer limits
    ({"guided_grammar": "start: a\na: a"}, "guided_grammar"),  # matches no text
    ({"guided_json": False}, "guided_json"),
    ({"structured_outputs": {"json": {"$ref": "#/nowhere"}}}, "structured_outputs.json"),
    ({"guided_json": "[" * 3000 + "]" * 3000}, "guided_json"),  # a string, parsed past the body's depth limit
    ({"structured_outputs": {"json": "[" * 3000 + "]" * 3000}}, "structured_outputs.json"),
    # compiles, then fails on its first token (llguidance's item limit): an object that must hold itself
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
        "$ref": "#/$defs/n"}}}}, "response_format.json_schema.schema"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(server, body, param):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert server.wait_idle()["running"] == 0


# --- strict: OpenAI's rules, and a model that would write a key the schema does not name ----------------------

@pytest.fixture(scope="module")
def echo():
    s = start_server(ECHO, extra_plugins=[EchoPlugin()])
    yield s
    s.stop()


def strict_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pair", "schema": schema, "strict": strict}}


OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_strict_schema_allows_no_key_it_does_not_name(echo):
    def said(fmt):
        r = post(echo, "/v1/chat/completions", {"messages": [{"role": "user", "content": script('{"a":1,"b":2}')}],
                                                "max_tokens": 50, "response_format": fmt})
        return r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.json()["error"]

    # an object that names its properties takes no others unless it says so (llama.cpp's and xgrammar's rule)
    assert said(strict_format(OPEN, strict=False)) == '{"a":1}'
    assert said(strict_format(OPEN | {"additionalProperties": True}, strict=False)) == '{"a":1,"b":2}'
    assert said(strict_format(OPEN | {"additionalProperties": False})) == '{"a":1}'  # the extra key: impossible
    err = said(strict_format(OPEN))  # OpenAI refuses an open object in strict mode, as this server does
    assert err == {"message": "Invalid schema for response_format 'pair': In context=(), 'additionalProperties' is "
                              "required to be supplied and to be false.", "type": "invalid_request_error",
                   "param": "response_format.json_schema.schema", "code": None}


def test_open_objects_follows_json_schemas_rule():
    s = start_server(ECHO | {"structured_output": {"options": {"open_objects": True}}}, extra_plugins=[EchoPlugin()])
    try:
        r = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": script('{"a":1,"b":2}')}],
                                             "max_tokens": 50, "response_format": strict_format(OPEN, strict=False)})
        assert r.json()["choices"][0]["message"]["content"] == '{"a":1,"b":2}'
    finally:
        s.stop()


def test_close_objects_closes_only_objects_that_name_their_properties():
    from llmserve.json_schema import close_objects

    schema = {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {}}},
                                               "any": {"type": "object"}, "pat": {"patternProperties": {"^a": {}}},
                                               "list": {"items": {"properties": {"y": {}}}}},
              "$defs": {"d": {"properties": {"z": {}}, "additionalProperties": True}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["p"]["additionalProperties"] is False
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["any"]  # no named properties: any object
    assert "additionalProperties" not in closed["properties"]["pat"]
    assert closed["$defs"]["d"]["additionalProperties"] is True  # said so: kept


CLOSED = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize("schema, says", [
    ({"type": "array", "items": {"type": "integer"}}, """must be a JSON Schema of 'type: "object"', got 'type: "array"'"""),
    (CLOSED | {"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}, "Missing 'b'"),
    (CLOSED | {"properties": {"a": {"type": "object", "properties": {}}}},
     "context=('properties', 'a'), 'additionalProperties' is required"),
    (CLOSED | {"properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/p"}}},
               "$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
     "context=('$defs', 'p'), 'additionalProperties' is required"),
    (CLOSED | {"properties": {"a": {"anyOf": [{"type": "null"}, {"type": "object", "additionalProperties": True}]}}},
     "context=('properties', 'a', 'anyOf', '1'), 'additionalProperties' is required"),
    (CLOSED | {"required": 5}, "'required' must be an array of strings"),
    (CLOSED | {"properties": [{}], "required": {"a": 1}}, "'properties' must be an object"),
    (CLOSED | {"properties": True}, "'properties' must be an object"),
])
def test_strict_schemas_openai_refuses_are_400(echo, schema, says):
    r = post(echo, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                            "response_format": strict_format(schema)})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"


def test_the_torch_sampler_applies_the_mask_greedy_sampled_and_seeded():
    """The embedded random GPT-2 on the torch backend: greedy, sampled and penalised rows all obey the grammar."""
    s = start_server({"backend": {"kv_cache_memory": "16MiB"}, "model": {"model": "embedded", "max_model_len": 256}})
    try:
        schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "ok": {"type": "boolean"}}, "required": ["id", "ok"],
                  "additionalProperties": False}
        for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "top_p": 0.9},
                      {"temperature": 0.7, "repetition_penalty": 1.3, "logprobs": 2}):
            r = post(s, "/v1/completions", {"prompt": "Once", "max_tokens": 60, "n": 2, "guided_json": schema, **extra})
            assert r.status_code == 200, r.text
            for c in r.json()["choices"]:
                assert c["finish_reason"] == "stop", c
                jsonschema.validate(json.loads(c["text"]), schema)
    finally:
        s.stop()


from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.core.test_constraints import regexes, schemas  # noqa: E402


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=schemas, regex=regexes)
def test_streamed_n_choices_follow_random_schemas_and_regexes(server, schema, regex):
    """The property test of tests/core/test_constraints.py through SSE with n = 2, as clients assemble it."""
    client = server.client()
    for body, check in (({"guided_json": schema}, lambda t: jsonschema.validate(json.loads(t), schema)),
                        ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t) or pytest.fail((regex, t)))):
        texts, finish = ["", ""], [None, None]
        for chunk in client.completions.create(model="embedded", prompt="x", n=2, stream=True, max_tokens=1500,
                                               extra_body=body):
            for c in chunk.choices:
                texts[c.index] += c.text
                finish[c.index] = c.finish_reason or finish[c.index]
        assert finish == ["stop", "stop"], (body, texts)
        for t in texts:
            check(t)
