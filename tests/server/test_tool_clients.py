"""Tool calling as agent frameworks use it: LangChain's ChatOpenAI and litellm against a real server.

Against the echo backend, tool_choice auto's parsed calls (whole and streamed); against a tiny random Qwen2 with a
Qwen2.5-style template, tool_choice required and a named function, which the grammar enforces, so even random
weights answer with calls that validate against the tools' schemas.
"""

from __future__ import annotations

import functools
import json
import operator
import os
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from tests.server.conftest import FAKE, start_server
from tests.server.tool_helpers import ECHO, TIME, WEATHER, EchoPlugin, script

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch its price list at import

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}\n</tool_call>'
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def chat(server, model: str, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.url + "/v1", api_key="x", model=model, max_retries=0, timeout=60, **kw)


@pytest.fixture(scope="module")
def echo():
    s = start_server({**ECHO, "server": {"tool_parser": "hermes"}}, extra_plugins=[EchoPlugin()])
    yield s
    s.stop()


def test_langchain_bind_tools_reads_parsed_calls(echo):
    llm = chat(echo, "echo", max_tokens=300).bind_tools([WEATHER, TIME])
    msg = llm.invoke(script("Let me see.\n" + CALL))
    assert msg.content == "Let me see."
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Oslo", "unit": "f"})]
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    # streamed: LangChain adds up the chunks' tool-call pieces into the same call
    whole = functools.reduce(operator.add, llm.stream(script(CALL)))
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [("get_weather", {"city": "Oslo", "unit": "f"})]


def test_litellm_tools(echo):
    import litellm

    r = litellm.completion(model="openai/echo", api_base=echo.url + "/v1", api_key="x", max_tokens=300,
                           messages=[{"role": "user", "content": script(CALL)}], tools=[WEATHER, TIME])
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo", "unit": "f"})
    assert r.choices[0].finish_reason == "tool_calls"


# --- enforced by the grammar: a tiny Qwen2 ---------------------------------------------------------------------

def valid(name: str, arguments: str | dict) -> bool:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, PARAMS[name])
    return True


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_answers_valid_calls(qwen, stream):
    kw = {"model": "tiny-qwen", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
          "max_tokens": 200, "temperature": 0}
    client = qwen.client()
    if stream:
        with client.chat.completions.stream(**kw) as s:
            r = s.get_final_completion()
    else:
        r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    assert all(valid(t.function.name, t.function.arguments) for t in c.message.tool_calls)


def test_named_tool_choice_and_parallel_false(qwen):
    client = qwen.client()
    r = client.chat.completions.create(model="tiny-qwen", messages=ASK, tools=[WEATHER, TIME], max_tokens=100,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and valid("get_time", call.function.arguments)
    r = client.chat.completions.create(model="tiny-qwen", messages=ASK, tools=[WEATHER, TIME], max_tokens=200,
                                       tool_choice="required", parallel_tool_calls=False, n=3)
    assert all(len(c.message.tool_calls) == 1 for c in r.choices)


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    unit: Literal["c", "f"]


def test_langchain_enforced_tool_choice_and_structured_output(qwen):
    llm = chat(qwen, "tiny-qwen", max_tokens=200, temperature=0)
    for choice, names in (("any", {"get_weather", "get_time"}), ("get_weather", {"get_weather"})):
        msg = llm.bind_tools([WEATHER, TIME], tool_choice=choice).invoke("Weather in Paris?")
        assert msg.tool_calls and {c["name"] for c in msg.tool_calls} <= names
        assert all(valid(c["name"], c["args"]) for c in msg.tool_calls)
    out = llm.with_structured_output(Weather, method="function_calling", strict=True).invoke("Weather in Paris?")
    assert isinstance(out, Weather)


def test_litellm_required_tool_choice(qwen):
    import litellm

    r = litellm.completion(model="openai/tiny-qwen", api_base=qwen.url + "/v1", api_key="x", max_tokens=200,
                           messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and valid("get_weather", call.function.arguments)


def test_structured_output_through_the_sdk_langchain_and_litellm(qwen):
    """chat.completions.parse, with_structured_output(method="json_schema") and litellm's json_object."""
    import litellm

    r = qwen.client().chat.completions.parse(model="tiny-qwen", messages=ASK, response_format=Weather,
                                              max_tokens=100, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Weather)
    out = chat(qwen, "tiny-qwen", max_tokens=100, temperature=0).with_structured_output(
        Weather, method="json_schema").invoke("Weather in Paris?")
    assert isinstance(out, Weather)
    # any JSON object: a random model may write one longer than any max_tokens, so this one runs on the fake
    # backend, which picks among the allowed tokens and ends objects soon
    fake = start_server(FAKE | {"model": {"model": "embedded", "max_model_len": 4096}, "cache": {"num_blocks": 512}})
    try:
        r = litellm.completion(model="openai/embedded", api_base=fake.url + "/v1", api_key="x", max_tokens=3000,
                               messages=ASK, response_format={"type": "json_object"}, temperature=0)
    finally:
        fake.stop()
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
