"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), driven by the anthropic SDK.

One server: a tiny random Qwen2 with a Qwen2.5-style (Hermes) tools template and the byte tokenizer (a token a
byte), the hermes tool parser, the think reasoning parser and an API key. Its text is noise, but the same noise at
temperature 0; tool_choice any and a named tool are enforced by the grammar, so even random weights answer with a
tool_use whose input fits the tool's schema.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import FAKE, start_server
from tests.server.tool_helpers import TIME, WEATHER, start_tiny_qwen

KEY = "sesame"
MODEL = "tiny-qwen"
TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
          "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
SCHEMA = TOOLS[0]["input_schema"]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# greedy, so an answer can be asked for twice; the SDK has dropped temperature (newer Claude models fix it), older
# clients still send it, and so does extra_body
T0 = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    pytest.importorskip("torch")
    s = start_tiny_qwen(tmp_path_factory.mktemp("qwen"), {"tool_parser": "hermes", "reasoning_parser": "think",
                                                          "api_key": KEY, "max_body_bytes": 1 << 20})
    yield s
    s.stop()


def client(server, **kw) -> anthropic.Anthropic:
    """The SDK pointed at the server (it sends the key as x-api-key); no retries, so each error surfaces once."""
    return anthropic.Anthropic(base_url=server.url, **({"api_key": KEY} | kw), max_retries=0, timeout=60)


def events(server, body: dict, key: str = KEY) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed /v1/messages, as the server sent them."""
    out, name = [], None
    body = {k: v for k, v in body.items() if k != "extra_body"} | body.get("extra_body", {}) | {"stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": key},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name  # each event's data says its own type, as Anthropic's do
                out.append((name, data))
    return out


def deltas(evs: list[tuple[str, dict]], kind: str, field: str) -> list[str]:
    return [d["delta"][field] for n, d in evs if n == "content_block_delta" and d["delta"]["type"] == kind]


def test_text_whole_and_streamed(qwen):
    c = client(qwen)
    kw = {"model": MODEL, "max_tokens": 12, **T0, "system": "Answer briefly.", "messages": ASK}
    m = c.messages.create(**kw)
    assert (m.type, m.role, m.model) == ("message", "assistant", MODEL) and m.id.startswith("msg_")
    (block,) = m.content
    assert block.type == "text" and block.text
    assert (m.stop_reason, m.usage.output_tokens) in {("max_tokens", 12), ("end_turn", m.usage.output_tokens)}
    # the same prompt again: its blocks come from the prefix cache, counted apart as Anthropic counts them
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.content[0].text == block.text and final.stop_reason == m.stop_reason
    whole = c.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=ASK).input_tokens
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == whole
    assert final.usage.cache_read_input_tokens > 0 and final.usage.input_tokens + final.usage.cache_read_input_tokens \
        == whole
    evs = events(qwen, kw)
    names = [n for n, _ in evs]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert evs[0][1]["message"]["content"] == [] and evs[2][1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(deltas(evs, "text_delta", "text")) == block.text
    assert evs[-2][1]["delta"] == {"stop_reason": m.stop_reason, "stop_sequence": None}
    assert evs[-2][1]["usage"]["output_tokens"] == m.usage.output_tokens


def test_stop_sequences_and_max_tokens(qwen):
    c = client(qwen)
    kw = {"model": MODEL, "max_tokens": 12, **T0, "messages": ASK}
    text = c.messages.create(**kw).content[0].text
    # a character of the answer seen there first (not a byte the detokenizer could not read alone)
    k = next(i for i in range(1, len(text)) if text[i] != "\ufffd" and text[i] not in text[:i])
    m = c.messages.create(**kw, stop_sequences=["never", text[k]])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", text[k], text[:k])
    evs = events(qwen, kw | {"stop_sequences": [text[k]]})
    assert evs[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": text[k]}
    m = c.messages.create(**kw | {"max_tokens": 3})
    assert (m.stop_reason, m.stop_sequence, m.usage.output_tokens) == ("max_tokens", None, 3)


def test_tool_round_trip(qwen):
    c = client(qwen)
    kw = {"model": MODEL, "max_tokens": 100, **T0, "tools": TOOLS, "messages": ASK,
          "tool_choice": {"type": "tool", "name": "get_weather"}}
    m = c.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMA)
    # streamed: the block opens with the name and an empty input, the arguments follow as they are written
    evs = events(qwen, kw)
    (start,) = [d["content_block"] for n, d in evs if n == "content_block_start"]
    assert (start["type"], start["name"], start["input"]) == ("tool_use", "get_weather", {})
    fragments = deltas(evs, "input_json_delta", "partial_json")
    assert len(fragments) > 1 and json.loads("".join(fragments)) == use.input
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", use.input)]

    # the result goes back in a user turn; the model answers in text
    def turn(result: str, **extra) -> list[dict]:
        return ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result,
                                                    **extra}]}]

    r = c.messages.create(model=MODEL, max_tokens=8, **T0, tools=TOOLS, messages=turn("sunny, 21 C"))
    assert r.content[0].type == "text" and r.stop_reason in ("end_turn", "max_tokens")

    def count(result: str, **extra) -> int:
        return c.messages.count_tokens(model=MODEL, tools=TOOLS, messages=turn(result, **extra)).input_tokens

    # the result (and its error flag) reached the prompt the template rendered: a token a byte
    assert count("sunny, 21 C and dry") - count("sunny, 21 C") == len(" and dry")
    assert count("sunny", is_error=True) - count("sunny") == len("Error: ")
    blocks = [{"type": "text", "text": "sunny"}, {"type": "text", "text": "dry"}]
    assert count(blocks) == count("sunny\n\ndry")


def test_any_tool_without_parallel_calls(qwen):
    m = client(qwen).messages.create(model=MODEL, max_tokens=150, **T0, tools=TOOLS, messages=ASK,
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (use,) = m.content
    assert use.type == "tool_use" and m.stop_reason == "tool_use"
    jsonschema.validate(use.input, TOOLS[[t["name"] for t in TOOLS].index(use.name)]["input_schema"])


def test_thinking_blocks(qwen):
    # the prefill opens a <think> block, so the reasoning parser reads the whole answer as thinking
    c = client(qwen)
    kw = {"model": MODEL, "max_tokens": 20, **T0, "thinking": {"type": "enabled", "budget_tokens": 16},
          "messages": ASK + [{"role": "assistant", "content": "<think>\n"}]}
    m = c.messages.create(**kw)
    (block,) = m.content
    assert block.type == "thinking" and block.thinking and m.stop_reason == "max_tokens"
    evs = events(qwen, kw)
    assert [d["content_block"]["type"] for n, d in evs if n == "content_block_start"] == ["thinking"]
    assert "".join(deltas(evs, "thinking_delta", "thinking")) == block.thinking
    # thinking blocks passed back in an assistant turn are taken
    again = ASK + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                     {"type": "text", "text": "Sunny."}]},
                   {"role": "user", "content": "And Oslo?"}]
    assert c.messages.create(model=MODEL, max_tokens=4, messages=again).usage.output_tokens > 0


def test_structured_output(qwen):
    m = client(qwen).messages.create(model=MODEL, max_tokens=100, **T0, messages=ASK,
                                     output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    jsonschema.validate(json.loads(m.content[0].text), SCHEMA)


def test_count_tokens_is_the_chat_prompt(qwen):
    n = client(qwen).messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "Be brief."}],
                                           messages=ASK).input_tokens
    r = httpx.post(qwen.url + "/tokenize", headers={"x-api-key": KEY},
                   json={"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, *ASK]})
    assert n == r.json()["count"] > 0


def test_api_key_as_x_api_key_or_bearer(qwen):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(qwen, api_key="wrong").messages.create(model=MODEL, max_tokens=1, messages=ASK)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "incorrect API key provided"}}
    bearer = client(qwen, api_key=None, auth_token=KEY)  # Authorization: Bearer KEY
    assert bearer.messages.create(model=MODEL, max_tokens=1, messages=ASK).usage.output_tokens == 1
    # every /v1 route takes either header; the OpenAI routes keep OpenAI's error shape
    assert httpx.get(qwen.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = httpx.get(qwen.url + "/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(qwen.url + "/v1/messages/count_tokens", json={"messages": ASK})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in r.json()["error"]["message"]


def test_sdk_error_classes(qwen):
    c = client(qwen)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        with c.messages.stream(model=MODEL, max_tokens=0, messages=ASK) as s:
            s.get_final_message()


TEXT = {"model": MODEL, "max_tokens": 4, "messages": ASK}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}
DEEP = '{"type": "object", "properties": {"a": ' * 300 + "{}" + "}}" * 300
# (raw body or body, what the message names); every one a 400 in Anthropic's shape
BAD = [
    (b"", "empty"), (b"[]", "JSON object"), (b"{", "not valid JSON"), (b"null", "JSON object"),
    # a lone surrogate, and nesting deeper than the parser follows
    (b'{"max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}', "not valid JSON"),
    (('{"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": '
      + DEEP + "}]}").encode(), "not valid JSON"),
    ({"model": MODEL, "messages": ASK}, "max_tokens"),
    (TEXT | {"max_tokens": "16"}, "max_tokens"), (TEXT | {"max_tokens": 0}, "max_tokens"),
    (TEXT | {"max_tokens": 10 ** 30}, "max_tokens"), (TEXT | {"max_tokens": 4000}, "context length"),
    (TEXT | {"messages": []}, "messages"), (TEXT | {"messages": "hi"}, "messages"),
    (TEXT | {"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    (TEXT | {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (TEXT | {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0].type"),
    (TEXT | {"messages": [{"role": "user", "content": [{"type": "text", "text": ["x"]}]}]},
     "messages[0].content[0].text"),
    (TEXT | {"messages": [{"role": "user", "content": [IMAGE]}]}, "image blocks are not supported"),
    (TEXT | {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    (TEXT | {"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, "'search_result'"),
    (TEXT | {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}]}]}, "messages[0].content[0].content[0]"),
    (TEXT | {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
    (TEXT | {"messages": [{"role": "user", "content": [USE]}]}, "belongs in an assistant message"),
    (TEXT | {"messages": [*ASK, {"role": "assistant", "content": [USE | {"input": "x"}]}]},
     "messages[1].content[0].input"),
    (TEXT | {"messages": [*ASK, {"role": "assistant", "content": [USE]}]}, "send its tool_result"),
    (TEXT | {"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "belongs in a user message"),
    (TEXT | {"messages": [{"role": "user", "content": "x"}] * 3000}, "context length"),
    (TEXT | {"system": 5}, "system"), (TEXT | {"system": [{"type": "text"}]}, "system[0].text"),
    (TEXT | {"tools": [{"name": "has space", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    (TEXT | {"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    (TEXT | {"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    (TEXT | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    (TEXT | {"messages": [{"role": "user", "content": []}]}, "messages[0].content must hold at least one block"),
    (TEXT | {"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    (TEXT | {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name: tool_choice names the tool 'nope'"),  # Anthropic's field, not the chat's
    (TEXT | {"tool_choice": {"type": "any"}}, "tool_choice any needs tools"),
    (TEXT | {"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    (TEXT | {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    (TEXT | {"thinking": {"type": "enabled"}}, "budget_tokens"),
    (TEXT | {"thinking": {"type": "enabled", "budget_tokens": 4}}, "budget_tokens"),
    (TEXT | {"thinking": {"type": "on"}}, "thinking.type"),
    (TEXT | {"temperature": "hot"}, "temperature"), (TEXT | {"temperature": 1e308}, "temperature"),
    (TEXT | {"top_p": -1}, "top_p"), (TEXT | {"top_k": -5}, "top_k"),
    (TEXT | {"stop_sequences": "END"}, "stop_sequences"), (TEXT | {"stop_sequences": [1]}, "stop_sequences[0]"),
    (TEXT | {"stream": "yes"}, "stream"), (TEXT | {"metadata": "x"}, "metadata"),
    (TEXT | {"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
    (TEXT | {"output_config": {"format": {"type": "json_schema", "schema": "x"}}}, "output_config.format.schema"),
    (TEXT | {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}, "tools": TOOLS,
             "tool_choice": {"type": "any"}}, "cannot be combined"),
]


@pytest.mark.parametrize("body, says", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_bodies_are_400s_in_anthropics_shape(qwen, body, says):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        if path.endswith("count_tokens") and isinstance(body, dict) and says in (
                "max_tokens", "context length", "budget_tokens", "temperature", "top_p", "top_k", "stop_sequences",
                "stream", "metadata", "stop_sequences[0]"):
            continue  # a field /v1/messages takes and counting needs not
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(qwen.url + path, headers={"x-api-key": KEY}, timeout=60, **kw)
        assert r.status_code == 400, (path, r.text)
        err = r.json()
        assert set(err) == {"type", "error"} and err["type"] == "error", err
        assert err["error"]["type"] == "invalid_request_error" and says in err["error"]["message"], err


def test_a_schema_the_grammar_engine_refuses_is_named_in_anthropics_fields(qwen):
    body = TEXT | {"output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#/nowhere"}}}}
    r = httpx.post(qwen.url + "/v1/messages", headers={"x-api-key": KEY}, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("output_config.format.schema: "), r.text


def test_other_errors_in_anthropics_shape(qwen):
    r = httpx.post(qwen.url + "/v1/messages", headers={"x-api-key": KEY}, content=b"x" * ((1 << 20) + 1))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.get(qwen.url + "/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = httpx.post(qwen.url + "/v1/messages/batches", headers={"x-api-key": KEY}, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # the OpenAI routes keep OpenAI's shape; /openapi.json lists the Messages routes
    r = httpx.post(qwen.url + "/v1/chat/completions", headers={"x-api-key": KEY}, json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    paths = httpx.get(qwen.url + "/openapi.json").json()["paths"]
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= set(paths)
    # none of it harmed the server: the next message is answered
    assert client(qwen).messages.create(**TEXT).usage.output_tokens > 0


def test_a_failure_mid_stream_is_an_error_event():
    # the fake backend at 20 ms a step runs past a 0.3 s request_timeout after the stream has started
    s = start_server(FAKE | {"backend": {"name": "fake", "options": {"step_cost_s": 0.02}},
                             "server": {"request_timeout": 0.3}})
    try:
        evs = events(s, {"model": "embedded", "max_tokens": 200, "messages": ASK})
        names = [n for n, _ in evs]
        assert names[0] == "message_start" and "content_block_delta" in names and "message_stop" not in names
        assert evs[-1] == ("error", {"type": "error", "error": {
            "type": "timeout_error", "message": "the request did not finish within the server's request_timeout "
                                                "(0.3 s)"}})
        with pytest.raises(anthropic.APIStatusError) as e:
            with client(s).messages.stream(model="embedded", max_tokens=200, messages=ASK) as stream:
                stream.get_final_message()
        assert e.value.body["error"]["type"] == "timeout_error"
    finally:
        s.stop()
