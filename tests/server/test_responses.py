"""POST /v1/responses (OpenAI's Responses API) through the openai SDK and the OpenAI Agents SDK, against real servers.

The echo backend says what the test scripts (text, <think> reasoning, Hermes tool calls), so items, events, the
store and an agent's tool round trip are checked exactly; a tiny random Qwen2 with a Hermes-style template shows
tool_choice required and a named function, and structured output, enforced by the grammar on real weights.
"""

from __future__ import annotations

import itertools
import json
from typing import Literal

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.server.conftest import start_server
from tests.server.tool_helpers import ECHO, TIME, WEATHER, EchoPlugin, script

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]  # the Responses API's flat shape
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    # stored responses in an SQLite file: the store tests below run over the sqlite plugin
    db = tmp_path_factory.mktemp("responses") / "store.sqlite3"
    s = start_server({**ECHO, "server": {"tool_parser": "hermes", "reasoning_parser": "think",
                                         "response_store": "sqlite", "response_store_options": {"path": str(db)}}},
                     extra_plugins=[EchoPlugin()])
    s.db = db
    yield s
    s.stop()


def create(server, said: str, **kw) -> Response:
    return server.client().responses.create(model="echo", input=script(said), **{"max_output_tokens": 400, **kw})


def raw_events(server, body: dict) -> list[dict]:
    """The stream's events as sent, each checked against the SDK's typed event classes (strict validation)."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                e = json.loads(line[6:])
                assert e["type"] == kind
                EVENTS.validate_python(e)
                events.append(e)
    return events


def test_text_input_answers_a_message(echo):
    r = create(echo, "Hello there.", instructions="Be brief.", metadata={"k": "v"}, user="u1")
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == "Hello there."
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert (r.instructions, r.metadata, r.user, r.model) == ("Be brief.", {"k": "v"}, "u1", "echo")
    # the instructions went first, as a system message the template rendered
    assert r.usage.input_tokens > len(script("Hello there.")) + len("Be brief.")
    assert r.usage.output_tokens == len("Hello there.") + 1  # and EOS
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the raw body validates strictly against the SDK's Response model
    raw = httpx.post(echo.url + "/v1/responses", json={"input": script("Hi."), "store": False}, timeout=30).json()
    assert Response.model_validate(raw).output_text == "Hi."
    assert type(raw["created_at"]) is int and type(raw["completed_at"]) is int  # whole seconds, as OpenAI's


def test_item_input_with_message_parts(echo):
    r = echo.client().responses.create(model="echo", input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": script("Two parts")}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "noted", "annotations": []}]},
        {"role": "user", "content": script("Last one.")}])
    assert r.output_text == "Last one."


def test_max_output_tokens_cut_is_incomplete(echo):
    r = create(echo, "A long answer that will be cut.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "A lon" and r.output[0].status == "incomplete" and r.usage.output_tokens == 5
    events = raw_events(echo, {"input": script("A long answer."), "max_output_tokens": 5})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_reasoning_text_and_tool_calls_are_items(echo):
    r = create(echo, "<think>\nweigh it\n</think>\n\nChecking.\n" + CALL, tools=TOOLS)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text.strip() == "weigh it"
    assert r.output[1].content[0].text == "Checking."
    call = r.output[2]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "unit": "c"})
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


def test_stream_events_in_order_and_final_equals_unstreamed(echo):
    said = "<think>\nweigh it\n</think>\n\nChecking the weather.\n" + CALL
    body = {"input": script(said), "tools": TOOLS, "max_output_tokens": 400, "temperature": 0}
    events = raw_events(echo, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    item_events = [k for k in kinds[2:-1] if k.startswith("response.output_item")]
    assert item_events == ["response.output_item.added", "response.output_item.done"] * 3
    # each item's pieces: the reasoning's and the text's in deltas, the arguments in pieces
    assert {"response.reasoning_text.delta", "response.output_text.delta",
            "response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.content_part.added", "response.content_part.done"} <= set(kinds)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert text == "Checking the weather." and json.loads(args) == {"city": "Paris", "unit": "c"}
    # the SDK's stream helper reads the same events into the same answer as the unstreamed request
    client = echo.client()
    with client.responses.stream(model="echo", **body) as stream:
        typed = [e.type for e in stream]
        final = stream.get_final_response()
    # the same sequence of events (how many deltas each piece takes depends on how the engine's steps batch up)
    assert [k for k, _ in itertools.groupby(typed)] == [k for k, _ in itertools.groupby(kinds)]
    whole = client.responses.create(model="echo", **body)

    def shape(r: Response):  # less the ids, the parse helper's fields, and the prefix cache's hits
        out = [o.model_dump(exclude={"id", "call_id", "parsed_arguments"}) for o in r.output]
        for o in out:
            for part in o.get("content") or ():
                part.pop("parsed", None)
        return out, r.status, r.usage.input_tokens, r.usage.output_tokens, r.usage.output_tokens_details
    assert shape(final) == shape(whole)


def test_function_call_output_round_trip(echo):
    """The call and its output sent back as items: the model answers from the tool's result."""
    client = echo.client()
    first = create(echo, CALL, tools=TOOLS, store=False)
    (call,) = first.output
    r = client.responses.create(model="echo", tools=TOOLS, input=[
        {"role": "user", "content": script(CALL)},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": script("21 C and sunny.")}])
    assert r.output_text == "21 C and sunny."


def test_store_retrieve_chain_and_delete(echo):
    client = echo.client()
    first = create(echo, CALL, tools=TOOLS)
    assert client.responses.retrieve(first.id).output[0].arguments == first.output[0].arguments
    items = client.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == script(CALL)
    # previous_response_id: the earlier input and output come first, so only the tool's output is sent now
    second = client.responses.create(model="echo", tools=TOOLS, previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": first.output[0].call_id, "output": script("Sunny.")}])
    assert second.output_text == "Sunny." and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the earlier turn came first
    # kept in the SQLite file, not in memory
    import sqlite3

    with sqlite3.connect(echo.db) as db:
        assert db.execute("SELECT COUNT(*) FROM responses WHERE id IN (?, ?)", (first.id, second.id)).fetchone() == (2,)
    assert client.responses.delete(first.id) is None
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as e:
        create(echo, "again", previous_response_id=first.id)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    # store false: nothing kept
    gone = create(echo, "not kept", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    assert client.responses.retrieve(second.id).output_text == "Sunny."


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    unit: Literal["c", "f"]


def test_parse_with_a_pydantic_model(echo):
    # the echo backend writes what the grammar allows: a scripted key the strict schema lacks cannot be written
    r = echo.client().responses.parse(model="echo", input=script('{"city":"Oslo","unit":"f"}'),
                                      text_format=Weather, max_output_tokens=100)
    assert r.output_parsed == Weather(city="Oslo", unit="f") and r.text.format.type == "json_schema"
    r = echo.client().responses.parse(model="echo", input=script('{"city":"Oslo","unit":"f","x":1}'),
                                      text_format=Weather, max_output_tokens=100)
    assert r.output_text == '{"city":"Oslo","unit":"f"}' and r.output_parsed == Weather(city="Oslo", unit="f")


BAD = [
    ({}, "input"), ({"input": 3}, "input"), ({"input": [{"type": "message", "role": "tool", "content": "x"}]},
                                             "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}, {"type": "function", "name": "f"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "strict": True,
                               "parameters": {"type": "object", "properties": {"a": {}}}}]}, "tools[0].parameters"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "w", "strict": True,
                                        "schema": {"type": "object"}}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "w",  # the grammar engine's refusal
                                        "schema": {"$ref": "#/nowhere"}}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10 ** 30}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"), ({"input": "x", "top_p": "1"}, "top_p"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"input": "x", "background": True}, "background"), ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "x", "stream": "yes"}, "stream"), ({"input": "x", "model": "gpt-5"}, "model"),
    ({"input": "\ud800"}, None), ({"input": [[[[[]]]]]}, "input"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_bodies_are_4xx_in_openais_shape(echo, body, param):
    r = httpx.post(echo.url + "/v1/responses", content=json.dumps(body), timeout=30,
                   headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_bad_requests_leave_the_server_serving(echo):
    for raw in (b"", b"[]", b"{", b'{"input": "x", "tools": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        r = httpx.post(echo.url + "/v1/responses", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
    many = {"input": [{"role": "user", "content": "x"}] * 20_000, "max_output_tokens": 1}
    assert httpx.post(echo.url + "/v1/responses", json=many, timeout=30).status_code == 400  # past the context
    for path, method in (("/v1/responses/resp_nope", "GET"), ("/v1/responses/resp_nope", "DELETE"),
                         ("/v1/responses/resp_nope/input_items", "GET")):
        r = httpx.request(method, echo.url + path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    assert create(echo, "still here").output_text == "still here"
    assert echo.wait_idle()["cache"]["used_blocks"] == 0


def test_agents_sdk_agent_calls_a_tool_and_answers(echo):
    """An OpenAI Agents SDK agent on this server: the model calls get_weather, the agent runs it and sends the
    result back, and the model's answer (the echo of the tool's scripted output) is the final output."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["c", "f"]) -> str:
        """The weather in a city."""
        calls.append((city, unit))
        return script(f"It is 21 {unit.upper()} in {city}.")

    def agent():  # a client per event loop
        model = agents.OpenAIResponsesModel(model="echo", openai_client=openai.AsyncOpenAI(
            base_url=echo.url + "/v1", api_key="x", max_retries=0))
        return agents.Agent(name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather],
                            model_settings=agents.ModelSettings(max_tokens=400))

    result = agents.Runner.run_sync(agent(), script(CALL))
    assert calls == [("Paris", "c")]
    assert result.final_output == "It is 21 C in Paris."
    # streamed the same way (Runner.run_streamed reads the typed events)
    import asyncio

    async def streamed():
        run = agents.Runner.run_streamed(agent(), script(CALL))
        async for _ in run.stream_events():
            pass
        return run.final_output

    assert asyncio.run(streamed()) == "It is 21 C in Paris." and len(calls) == 2


# --- the store hook -------------------------------------------------------------------------------------------------


def test_memory_store_drops_the_least_recently_used():
    from llmserve_responses.memory import MemoryStore

    s = MemoryStore(max_responses=2, max_bytes=10_000)
    s.put("a", {"v": 1})
    s.put("b", {"v": 2})
    assert s.get("a") == {"v": 1}  # a is now the most recently used
    s.put("c", {"v": 3})
    assert (s.get("a"), s.get("b"), s.get("c")) == ({"v": 1}, None, {"v": 3})
    s = MemoryStore(max_responses=100, max_bytes=30)
    s.put("a", {"v": "x" * 10})
    s.put("b", {"v": "y" * 10})
    assert s.get("a") is None and s.get("b") is not None  # two would pass 40 bytes
    s.put("huge", {"v": "z" * 100})
    assert s.get("huge") is None and s.get("b") is not None  # larger than the cap: not kept, nothing dropped
    assert s.delete("b") and not s.delete("b")


def test_hook_register_response_stores():
    from llmserve.hookspecs import hookimpl
    from llmserve.interfaces import ResponseStore

    class Dict(ResponseStore):
        def __init__(self):
            self.d = {}

        def put(self, response_id, record):
            self.d[response_id] = record

        def get(self, response_id):
            return self.d.get(response_id)

        def delete(self, response_id):
            return self.d.pop(response_id, None) is not None

    stores = []

    class Plugin:
        @hookimpl
        def register_response_stores(self, register):
            def build(config, options):
                stores.append((Dict(), options))
                return stores[-1][0]
            register("dict", build)

    s = start_server({**ECHO, "server": {"response_store": "dict", "response_store_options": {"o": 1}}},
                     extra_plugins=[EchoPlugin(), Plugin()])
    try:
        r = create(s, "kept")
        ((store, options),) = stores
        assert options == {"o": 1} and store.d[r.id]["response"]["output"][0]["content"][0]["text"] == "kept"
        assert s.client().responses.retrieve(r.id).output_text == "kept"
    finally:
        s.stop()


# --- enforced by the grammar: a tiny Qwen2 --------------------------------------------------------------------------


def test_required_tool_choice_round_trip_on_a_real_model(qwen):
    client = qwen.client()
    kw = {"model": "tiny-qwen", "tools": TOOLS, "max_output_tokens": 200, "temperature": 0}
    r = client.responses.create(input="What is the weather in Paris?", tool_choice="required", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    for c in calls:
        args = json.loads(c.arguments)
        assert c.name in ("get_weather", "get_time") and set(args) == ({"city", "unit"} if c.name == "get_weather"
                                                                        else {"zone"})
    # the calls' outputs sent back through previous_response_id: the model answers in text now (tool_choice none)
    follow = client.responses.create(previous_response_id=r.id, tool_choice="none", input=[
        {"type": "function_call_output", "call_id": c.call_id, "output": "21 C"} for c in calls], **kw)
    assert follow.output[0].type == "message" and follow.usage.input_tokens > r.usage.input_tokens
    # a named function, streamed: the SDK assembles its arguments from the pieces
    with client.responses.stream(input="Time?", tool_choice={"type": "function", "name": "get_time"}, **kw) as s:
        final = s.get_final_response()
    (call,) = final.output
    assert call.name == "get_time" and set(json.loads(call.arguments)) == {"zone"}


def test_parse_on_a_real_model(qwen):
    r = qwen.client().responses.parse(model="tiny-qwen", input="Weather in Paris?", text_format=Weather,
                                      max_output_tokens=100, temperature=0)
    assert isinstance(r.output_parsed, Weather)
