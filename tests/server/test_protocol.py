"""Request validation without a server: what each field becomes, and the 400s that name the field."""

from __future__ import annotations

import logging

import pytest

from llmserve.server.errors import ApiError
from llmserve.server.protocol import parse_chat, parse_completion, parse_json


def test_completion_fields_become_sampling_params():
    r = parse_completion({"prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "n": 2, "stop": "x",
                          "seed": 3, "logit_bias": {"65": -100, "66": 2.5}, "logprobs": 2, "echo": True,
                          "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [5],
                          "ignore_eos": True, "min_tokens": 1, "priority": 4, "stream": True,
                          "stream_options": {"include_usage": True}, "best_of": 2})
    sp = r.common.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.stop, sp.seed) == (7, 0.0, 0.5, 2, ["x"], 3)
    assert sp.logit_bias == {65: -100.0, 66: 2.5} and sp.logprobs == 2 and sp.prompt_logprobs == 2
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.stop_token_ids) == (0, 0.1, 1.2, [5])
    assert sp.ignore_eos and sp.min_tokens == 1
    assert r.common.priority == 4 and r.common.stream and r.common.include_usage and r.echo
    sp.validate()


def test_defaults_follow_openai():
    c = parse_completion({"prompt": [1, 2, 3]})
    assert c.prompts == [[1, 2, 3]] and c.common.sampling.max_tokens == 16 and c.common.sampling.temperature == 1.0
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert chat.common.sampling.max_tokens is None  # up to the context length
    assert chat.common.model is None and not chat.logprobs


def test_unknown_fields_are_ignored_with_a_debug_log(caplog):
    with caplog.at_level(logging.DEBUG, logger="llmserve.server.protocol"):
        parse_completion({"prompt": "x", "frobnicate": 1, "user": "u"})
    msgs = [r.getMessage() for r in caplog.records]
    assert any("frobnicate" in m for m in msgs)
    assert not any("user" in m for m in msgs)  # a known OpenAI field with no effect is not "unknown"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "seed": "1"}, "seed"),
])
def test_completion_errors_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}, "oops"]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions"),
])
def test_chat_errors_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.param == param


def test_chat_messages_are_normalized_for_templates():
    r = parse_chat({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
        {"role": "user", "content": "q"}], "max_completion_tokens": 5, "max_tokens": 9,
        "logprobs": True, "top_logprobs": 3, "response_format": {"type": "text"}, "tool_choice": "none"})
    assert r.messages == [{"role": "system", "content": "ab"}, {"role": "assistant", "content": "", "name": "bot"},
                          {"role": "user", "content": "q"}]
    assert r.common.sampling.max_tokens == 5 and r.common.sampling.logprobs == 3


def test_parse_json_rejects_what_is_not_an_object():
    for raw in (b"", b"[1]", b"{bad", b"\xff\xfe"):
        with pytest.raises(ApiError) as e:
            parse_json(raw)
        assert e.value.status == 400
    assert parse_json(b'{"a": 1}') == {"a": 1}
