"""Tool calls, reasoning and chat-template controls through a real server.

The echo backend answers with text the test puts in the prompt, so tool_choice auto's parsing, reasoning and the
client libraries' assembly of streamed calls are checked end to end; a whole-prompt echo with an HF tokenizer shows
what the chat template received.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from llmserve.hookspecs import hookimpl
from llmserve.interfaces import ReasoningParser, ToolCallDelta, ToolParser
from tests.server.conftest import start_server
from tests.server.tool_helpers import ECHO, TIME, WEATHER, EchoPlugin, save_byte_tokenizer, script

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TWO = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'


@pytest.fixture(scope="module")
def echo():
    s = start_server({**ECHO, "server": {"tool_parser": "hermes", "reasoning_parser": "think"}},
                     extra_plugins=[EchoPlugin()])
    yield s
    s.stop()


def ask(server, said: str, **kw):
    return server.client().chat.completions.create(model="echo", messages=[{"role": "user", "content": script(said)}],
                                                   max_tokens=400, **kw)


def test_auto_tool_calls_come_back_as_tool_calls(echo):
    r = ask(echo, "Checking.\n" + TWO, tools=[WEATHER, TIME])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    assert [(t.type, t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("function", "get_weather", {"city": "Paris", "unit": "c"}), ("function", "get_time", {"zone": "utc"})]
    assert all(t.id.startswith("call_") for t in c.message.tool_calls)
    assert len({t.id for t in c.message.tool_calls}) == 2


def test_only_calls_means_null_content(echo):
    c = ask(echo, CALL, tools=[WEATHER]).choices[0]
    assert c.message.content is None and c.message.tool_calls[0].function.name == "get_weather"


def test_streamed_calls_assemble_in_the_sdk(echo):
    with echo.client().chat.completions.stream(model="echo", messages=[{"role": "user", "content": script(TWO)}],
                                               tools=[WEATHER, TIME], max_tokens=400) as stream:
        chunks = list(stream)
        final = stream.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", '{"zone": "utc"}')]
    # OpenAI's shape: the first piece of a call names it, later pieces only extend the arguments
    pieces = [t for e in chunks if e.type == "chunk" for t in e.chunk.choices[0].delta.tool_calls or ()]
    assert len(pieces) >= 2  # how many depends on how the engine's steps batch up
    for t in pieces:
        assert (t.id is None) == (t.function.name is None)


# tool_choice required: the grammar's array, written as the grammar allows it (compact JSON)
REQUIRED = ('[{"name":"get_weather","parameters":{"city":"Paris","unit":"c"}},'
            '{"name":"get_time","parameters":{"zone":"utc"}}]')
# each way of calling: the model's text and the request fields that make the server read calls out of it
WAYS = {"auto": (TWO, {}), "required": (REQUIRED, {"tool_choice": "required"})}


@pytest.fixture(scope="module")
def paced():
    # a step takes 2 ms, so a stream's deliveries each hold a few tokens, as with a real model
    s = start_server({**ECHO, "backend": {"name": "echo", "options": {"step_cost_s": 0.002}},
                      "server": {"tool_parser": "hermes"}}, extra_plugins=[EchoPlugin()])
    yield s
    s.stop()


def answer(server, said: str, **kw) -> tuple[dict, list[dict]]:
    """The whole answer's choice, and the streamed answer's tool-call pieces as the server sent them; the streamed
    choice's finish_reason and content are checked against the whole one's here."""
    body = {"model": "echo", "messages": [{"role": "user", "content": script(said)}], "max_tokens": 400, **kw}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    pieces, content, finish = [], "", None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                (c,) = json.loads(line[6:])["choices"]
                pieces += c["delta"].get("tool_calls", [])
                content += c["delta"].get("content") or ""
                finish = c["finish_reason"] or finish
    assert finish == whole["finish_reason"] and content == (whole["message"]["content"] or "")
    return whole, pieces


def assembled(pieces: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) of each call, put together as a client does: the first piece names it, the rest extend."""
    calls: dict[int, list] = {}
    for p in pieces:
        if p["index"] not in calls:
            assert p["id"].startswith("call_") and p["type"] == "function" and p["function"]["name"], p
            calls[p["index"]] = [p["function"]["name"], p["function"]["arguments"]]
        else:
            assert set(p) == {"index", "function"} and set(p["function"]) == {"arguments"}, p
            calls[p["index"]][1] += p["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]


def calls_of(choice: dict) -> list[tuple[str, str]]:
    return [(t["function"]["name"], t["function"]["arguments"]) for t in choice["message"].get("tool_calls") or ()]


@pytest.mark.parametrize("way", WAYS)
def test_streamed_calls_come_name_first_then_arguments_in_pieces(paced, way):
    said, kw = WAYS[way]
    whole, pieces = answer(paced, said, tools=[WEATHER, TIME], **kw)
    assert whole["finish_reason"] == "tool_calls"
    assert [name for name, _ in calls_of(whole)] == ["get_weather", "get_time"]
    assert assembled(pieces) == calls_of(whole)  # the streamed calls are the whole answer's, to the character
    for i in (0, 1):
        mine = [p for p in pieces if p["index"] == i]
        assert "name" in mine[0]["function"]  # the name comes with the call's first piece, before more arguments
        assert sum(bool(p["function"]["arguments"]) for p in mine) > 1  # the arguments as they were written


@pytest.mark.parametrize("way", WAYS)
def test_calls_whole_before_a_length_cut_are_answered(paced, way):
    said, kw = WAYS[way]
    cut = said.index("zone") + 2  # inside the second call's arguments (the byte tokenizer: a token a character)
    whole, pieces = answer(paced, said, tools=[WEATHER, TIME], max_tokens=cut, **kw)
    assert whole["finish_reason"] == "length"
    first, second = calls_of(whole)
    assert first[0] == "get_weather" and json.loads(first[1]) == {"city": "Paris", "unit": "c"}
    assert second[0] == "get_time" and second[1].endswith('"zo')  # the cut call as far as it came, as OpenAI does
    assert assembled(pieces) == calls_of(whole)


@pytest.mark.parametrize("way", WAYS)
def test_parallel_tool_calls_false_answers_one_call(paced, way):
    # auto: the calls after the first are dropped; required: the grammar ends the array after one call
    said, kw = WAYS[way]
    whole, pieces = answer(paced, said, tools=[WEATHER, TIME], parallel_tool_calls=False, **kw)
    assert [name for name, _ in calls_of(whole)] == ["get_weather"] and whole["finish_reason"] == "tool_calls"
    assert assembled(pieces) == calls_of(whole)


def _nested_tool(name: str, key: str, value: str) -> dict:
    """A tool whose parameters hold a {"place": Place} with Place under $defs (as pydantic writes a nested model), and
    an optional "next" of the same parameters again (a ref to the root, "#")."""
    place = {"type": "object", "properties": {key: {"enum": [value]}}, "required": [key], "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}, "next": {"$ref": "#"}},
        "required": ["place"], "additionalProperties": False, "$defs": {"Place": place}}}}


NESTED = [_nested_tool("visit", "city", "Paris"), _nested_tool("clock", "zone", "utc")]


def test_required_takes_tools_whose_parameters_use_defs(paced):
    # each tool's "#/$defs/Place" is its own: both named Place, of different shapes
    said = ('[{"name":"visit","parameters":{"place":{"city":"Paris"},"next":{"place":{"city":"Paris"}}}},'
            '{"name":"clock","parameters":{"place":{"zone":"utc"}}}]')
    whole, pieces = answer(paced, said, tools=NESTED, tool_choice="required")
    assert whole["finish_reason"] == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls_of(whole)] == [
        ("visit", {"place": {"city": "Paris"}, "next": {"place": {"city": "Paris"}}}),
        ("clock", {"place": {"zone": "utc"}})]
    assert assembled(pieces) == calls_of(whole)
    # clock's Place is not visit's: the grammar stops the echo at "city"
    whole, _ = answer(paced, '[{"name":"clock","parameters":{"place":{"city":"Paris"}}}]', tools=NESTED,
                      tool_choice="required")
    assert "Paris" not in calls_of(whole)[0][1]


def test_tool_choice_none_leaves_the_text_alone(echo):
    c = ask(echo, CALL, tools=[WEATHER], tool_choice="none").choices[0]
    assert c.message.content == CALL and not c.message.tool_calls and c.finish_reason == "stop"


def test_reasoning_content_whole_and_streamed(echo):
    said = "<think>\nweigh it\n</think>\n\nParis."
    m = ask(echo, said).choices[0].message
    assert (m.reasoning_content, m.content) == ("\nweigh it\n", "Paris.")
    stream = echo.client().chat.completions.create(model="echo", messages=[{"role": "user", "content": script(said)}],
                                                   max_tokens=400, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "\nweigh it\n"
    assert "".join(d.content or "" for d in deltas) == "Paris."


def test_tool_history_is_accepted(echo):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "user", "content": script("It is sunny.")}]
    r = echo.client().chat.completions.create(model="echo", messages=msgs, tools=[WEATHER], max_tokens=50)
    assert r.choices[0].message.content == "It is sunny."


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    # strict: OpenAI's rules (every object closed, every property required)
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}]},
     "tools[0].function.parameters"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_bad_tool_fields_are_400_naming_the_field(echo, extra, param):
    body = {"model": "echo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, **extra}
    r = httpx.post(echo.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_auto_without_a_parser_for_the_template_is_400():
    s = start_server({**ECHO, "server": {"tool_parser": "auto"}}, extra_plugins=[EchoPlugin()])
    try:
        with pytest.raises(openai.BadRequestError) as e:
            ask(s, CALL, tools=[WEATHER])
        assert e.value.body["param"] == "tool_choice"
        assert ask(s, "hi", tools=[WEATHER], tool_choice="none").choices[0].message.content == "hi"
    finally:
        s.stop()


def test_an_unknown_parser_name_fails_at_start_up():
    s = start_server({**ECHO, "server": {"reasoning_parser": "nope"}}, extra_plugins=[EchoPlugin()])
    try:
        h = httpx.get(s.url + "/health", timeout=10)
        assert h.status_code == 503 and "no reasoning parser named 'nope'" in h.json()["error"]
    finally:
        s.stop()


# --- the hooks: a third-party parser of each kind ---------------------------------------------------------------


class LineCalls(ToolParser):
    """Calls written one per line as `CALL name {json}`; anything else is content (it waits for whole lines)."""

    def __init__(self):
        self.buf, self.n = "", 0

    def feed(self, text, final=False):
        self.buf += text
        lines = self.buf.split("\n")
        self.buf = "" if final else lines.pop()
        content, calls = [], []
        for line in lines:
            if line.startswith("CALL "):
                name, _, args = line[5:].partition(" ")
                calls.append(ToolCallDelta(self.n, name, args or "{}"))
                self.n += 1
            elif line:
                content.append(line)
        return "\n".join(content), calls


class Shouting(ReasoningParser):
    """Reasoning is the text in capitals before the first lower-case letter."""

    def __init__(self):
        self.done = False

    def feed(self, text, final=False):
        if self.done:
            return "", text
        i = next((k for k, ch in enumerate(text) if ch.islower()), None)
        if i is None:
            return text, ""
        self.done = True
        return text[:i], text[i:]


class ParserPlugin:
    @hookimpl
    def register_tool_parsers(self, register):
        register("lines", lambda tokenizer, tools: LineCalls())

    @hookimpl
    def register_reasoning_parsers(self, register):
        register("shouting", lambda tokenizer, prompt: Shouting())


@pytest.fixture(scope="module")
def custom():
    s = start_server({**ECHO, "server": {"tool_parser": "lines", "reasoning_parser": "shouting"}},
                     extra_plugins=[EchoPlugin(), ParserPlugin()])
    yield s
    s.stop()


def test_hook_register_tool_parsers(custom):
    # a parser registered through register_tool_parsers and picked by server.tool_parser reads the calls
    said = 'lead\nCALL get_weather {"city": "Oslo", "unit": "f"}\n'
    c = ask(custom, said, tools=[WEATHER]).choices[0]
    assert c.message.content == "lead" and c.finish_reason == "tool_calls"
    assert (c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments) == (
        "get_weather", '{"city": "Oslo", "unit": "f"}')


def test_hook_register_reasoning_parsers(custom):
    # a parser registered through register_reasoning_parsers and picked by server.reasoning_parser
    m = ask(custom, "HMM OK. fine").choices[0].message
    assert (m.reasoning_content, m.content) == ("HMM OK. ", "fine")


# --- what the chat template receives (an HF tokenizer; the echo backend repeats the whole prompt) -----------------


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(d, template=None)  # no template of its own: --chat-template supplies it
    from tests.server.tool_helpers import QWEN_TEMPLATE

    (d / "qwen.jinja").write_text(QWEN_TEMPLATE)
    s = start_server({**ECHO, "model": {"model": str(d), "served_model_name": "echo", "chat_template": str(d / "qwen.jinja")},
                      "tokenizer": {"name": "hf"},
                      # the echo ends with byte 0 (never in a prompt) as EOS, so it repeats <|im_end|> too
                      "backend": {"name": "echo", "options": {"start": -1, "end": -1, "vocab_size": 260,
                                                              "eos_token_id": NUL}}},
                     extra_plugins=[EchoPlugin()])
    yield s
    s.stop()


NUL = 93  # byte 0's id in the byte-level vocabulary (its character, U+0100, sorts after the printable ones)


def rendered(server, messages, **kw) -> str:
    r = server.client().chat.completions.create(model="echo", messages=messages, max_tokens=1500,
                                                extra_body={"skip_special_tokens": False, **kw.pop("extra", {})}, **kw)
    return r.choices[0].message.content


def test_tools_and_the_tool_history_reach_the_template(templated):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "18 C"}]
    text = rendered(templated, msgs, tools=[WEATHER], tool_choice="none")
    assert json.dumps(WEATHER["function"]["parameters"]["properties"]["city"]) in text  # the tool's schema
    # the call's arguments reached the template as an object (its tojson writes them back as JSON, not a string)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_auto_keeps_special_tokens_for_the_parser(templated):
    # tool_parser auto picked hermes from the template; special tokens stay in the text it reads
    r = templated.client().chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}],
                                                   tools=[WEATHER], max_tokens=1500)
    m = r.choices[0].message
    # the template's own example tag holds no JSON call: it comes back as content
    assert m.content.startswith("<|im_start|>system") and "<tool_call>" in m.content and not m.tool_calls


def test_chat_template_kwargs_reach_the_template(templated):
    msgs = [{"role": "user", "content": "hi"}]
    assert rendered(templated, msgs).endswith("assistant\n")
    assert rendered(templated, msgs, extra={"chat_template_kwargs": {"enable_thinking": False}}).endswith(
        "assistant\n<think>\n\n</think>\n\n")


def test_continue_final_message(templated):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    text = rendered(templated, msgs, extra={"continue_final_message": True, "add_generation_prompt": False})
    assert text.endswith("<|im_start|>assistant\nThe answer is")


@pytest.mark.parametrize("key", ["tokenize", "tools", "add_generation_prompt", "continue_final_message"])
def test_chat_template_kwargs_may_not_set_the_renderers_arguments(templated, key):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {key: True}}
    r = httpx.post(templated.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}", r.text


def test_a_template_error_is_400(templated):
    body = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    r = httpx.post(templated.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "developer messages are not supported" in r.json()["error"]["message"]
