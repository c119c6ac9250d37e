"""The tool-call and reasoning parsers on text: whole, and streamed in any pieces (the deltas reassembled as the
openai SDK does give the same message)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llmserve_tools import HermesParser, Llama3JsonParser, ThinkParser, auto

from llmserve.errors import InvalidRequestError
from llmserve.server.jsoncalls import JsonCalls
from llmserve.server.tools import ChoiceParser, _Named, _Required


def assemble(deltas: list[dict]) -> dict:
    """The message a client builds from streamed deltas: content and reasoning joined, calls by index."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": []}
    for d in deltas:
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", ()):
            if "id" in c:  # the first piece of a call: index, id, type and name, as OpenAI sends it
                assert c["index"] == len(msg["tool_calls"]) and c["type"] == "function" and c["id"].startswith("call_")
                msg["tool_calls"].append({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                msg["tool_calls"][c["index"]]["arguments"] += c["function"]["arguments"]
    return msg


def run(make, text: str, cuts: list[int] = ()) -> dict:
    """Feed text to a fresh ChoiceParser in the pieces cut at `cuts`; the reassembled message."""
    p = make()
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    deltas = [p.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.feed("", final=True)]
    whole = assemble(deltas)
    # the whole calls the parser kept agree with the streamed pieces
    assert [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in p.calls] == \
        whole["tool_calls"]
    return whole


def hermes():
    return ChoiceParser(None, HermesParser())


CALL = '{"name": "get_weather", "arguments": {"city": "Paris \\"5e\\"", "days": [1, {"x": "}"}]}}'
HERMES = f"I will look.\n\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{\"name\": \"now\", \"arguments\": {{}}}}\n</tool_call>"
EXPECTED = [{"name": "get_weather", "arguments": json.dumps(json.loads(CALL)["arguments"])},
            {"name": "now", "arguments": "{}"}]


def test_hermes_reads_calls_and_keeps_the_text_before_them():
    m = run(hermes, HERMES)
    assert m["content"] == "I will look."
    assert m["tool_calls"] == EXPECTED
    assert [json.loads(c["arguments"]) for c in m["tool_calls"]] == [json.loads(CALL)["arguments"], {}]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(HERMES)), max_size=12))
def test_hermes_streamed_in_any_pieces_gives_the_same_message(cuts):
    assert run(hermes, HERMES, cuts) == run(hermes, HERMES)


def test_hermes_streams_arguments_before_the_call_ends():
    p = hermes()
    first = p.feed('<tool_call>\n{"name": "f", "arguments": {"a": "xy')
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": "xy'}
    assert p.feed('z"}}')["tool_calls"] == [{"index": 0, "function": {"arguments": 'z"}'}}]
    assert p.feed("\n</tool_call>", final=True) == {}


@pytest.mark.parametrize("text", ["plain answer, no calls  \n", "a < b and <tool is not a tag", "", "x <tool_call"])
def test_hermes_passes_text_without_calls_through(text):
    m = run(hermes, text, list(range(len(text))))
    assert m == {"content": text, "reasoning_content": "", "tool_calls": []}


def test_hermes_text_in_tags_that_is_no_call_is_content():
    text = "<tool_call>not json</tool_call> then <tool_call>{\"no_name\": 1}</tool_call>"
    m = run(hermes, text, [3, 15, 40])
    assert m["tool_calls"] == [] and m["content"] == "<tool_call>not json</tool_call>then<tool_call>{\"no_name\": 1}</tool_call>"


def test_hermes_call_cut_by_max_tokens_keeps_what_came():
    m = run(hermes, '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2')
    assert m["tool_calls"] == [{"name": "f", "arguments": '{"a": [1, 2'}]


def test_json_calls_take_arguments_before_the_name_and_as_a_json_string():
    c = JsonCalls()
    out = c.feed('{"arguments": {"q": 1}, "name": "late"} {"name": "s", "arguments": "{\\"k\\": 2}"}')
    assert [(d.index, d.name, d.arguments) for d in out] == [(0, "late", '{"q": 1}'), (1, "s", '{"k": 2}')]


LLAMA = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": "a;b"}}'


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, len(LLAMA)), max_size=10))
def test_llama3_json_calls_in_any_pieces(cuts):
    m = run(lambda: ChoiceParser(None, Llama3JsonParser()), LLAMA, cuts)
    assert m["content"] == "" and m["tool_calls"] == [{"name": "f", "arguments": '{"x": 1}'},
                                                       {"name": "g", "arguments": '{"y": "a;b"}'}]


@pytest.mark.parametrize("text", ["The answer is {x}.", "  <|python", "{not a call"])
def test_llama3_json_output_that_is_no_call_is_content(text):
    m = run(lambda: ChoiceParser(None, Llama3JsonParser()), text, [1, 2, 5])
    assert m == {"content": text, "reasoning_content": "", "tool_calls": []}


def test_parallel_tool_calls_false_keeps_the_first_call():
    m = run(lambda: ChoiceParser(None, HermesParser(), parallel=False), HERMES, [20, 60])
    assert m["tool_calls"] == EXPECTED[:1]


def test_required_and_named_read_the_grammar_output():
    text = '[{"name": "a", "parameters": {"x": [1]}}, {"parameters": {}, "name": "b"}]'
    assert run(lambda: ChoiceParser(None, _Required()), text, [5, 9, 30])["tool_calls"] == \
        [{"name": "a", "arguments": '{"x": [1]}'}, {"name": "b", "arguments": "{}"}]
    # cut by max_tokens: the whole calls stay, and the cut one as far as it came (OpenAI's shape; finish_reason length)
    cut = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": [2'
    assert run(lambda: ChoiceParser(None, _Required()), cut, [3, 20, 50])["tool_calls"] == \
        [{"name": "a", "arguments": '{"x": 1}'}, {"name": "b", "arguments": '{"y": [2'}]
    assert run(lambda: ChoiceParser(None, _Required()), '[{"name": "a", "param', [3])["tool_calls"] == \
        [{"name": "a", "arguments": ""}]
    m = run(lambda: ChoiceParser(None, _Named("f")), '{"q": "w"}', [1, 4])
    assert m == {"content": "", "reasoning_content": "", "tool_calls": [{"name": "f", "arguments": '{"q": "w"}'}]}


REQUIRED = '[{"name": "a", "parameters": {"x": [1, "]}"]}}, {"name": "b", "parameters": {}}]'


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, len(REQUIRED)), max_size=10))
def test_required_streamed_in_any_pieces_gives_the_same_calls(cuts):
    m = run(lambda: ChoiceParser(None, _Required()), REQUIRED, cuts)
    assert m == run(lambda: ChoiceParser(None, _Required()), REQUIRED)
    assert m["tool_calls"] == [{"name": "a", "arguments": '{"x": [1, "]}"]}'}, {"name": "b", "arguments": "{}"}]


THINK = "<think>\nStep 1 < step 2.\n</think>\n\nThe answer."


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, len(THINK)), max_size=10))
def test_think_moves_reasoning_out_in_any_pieces(cuts):
    m = run(lambda: ChoiceParser(ThinkParser(), None), THINK, cuts)
    assert m == {"content": "The answer.", "reasoning_content": "\nStep 1 < step 2.\n", "tool_calls": []}


@pytest.mark.parametrize("prompt,text,reasoning,content", [
    ("<|im_start|>assistant\n<think>\n", "ideas</think>answer", "ideas", "answer"),  # the template opened it
    ("", "no thinking here", "", "no thinking here"),
    ("", "<think>cut by max_tokens", "cut by max_tokens", ""),
    ("", "<thin", "", "<thin"),
])
def test_think_cases(prompt, text, reasoning, content):
    m = run(lambda: ChoiceParser(ThinkParser(prompt), None), text, [2, 5])
    assert (m["reasoning_content"], m["content"]) == (reasoning, content)


def test_reasoning_then_tool_calls():
    text = "<think>the weather, then</think>\n" + HERMES
    m = run(lambda: ChoiceParser(ThinkParser(), HermesParser()), text, [4, 12, 50, 90])
    assert m == {"reasoning_content": "the weather, then", "content": "I will look.", "tool_calls": EXPECTED}


class _Tok:
    def __init__(self, template):
        self.chat_template = template


def test_auto_picks_the_parser_by_the_chat_template():
    assert isinstance(auto(_Tok("...{{ '<tool_call>\\n' }}..."), []), HermesParser)
    assert isinstance(auto(_Tok("... '<|python_tag|>' ..."), []), Llama3JsonParser)
    with pytest.raises(InvalidRequestError) as e:
        auto(_Tok(None), [])
    assert e.value.param == "tool_choice"


PIECES = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>", '{"name": "f"', '"arguments": ',
          "{", "}", "[", "]", '"', "\\", ":", ",", ";", " ", "\n", "x", "<", "name", "1"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=30), st.lists(st.integers(0, 200), max_size=8),
       st.sampled_from(["hermes", "llama3_json"]))
def test_any_text_parses_without_error_and_the_same_in_any_pieces(parts, cuts, kind):
    # a model may write anything: never an exception, and streaming never changes the answer
    text = "".join(parts)

    def make():
        return ChoiceParser(ThinkParser(), HermesParser() if kind == "hermes" else Llama3JsonParser())

    assert run(make, text, cuts) == run(make, text)
