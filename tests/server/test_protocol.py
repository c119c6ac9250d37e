"""Request validation without a server: what each field becomes, and the 400s that name the field."""

from __future__ import annotations

import json
import logging

import pytest

from llmserve.server.errors import ApiError
from llmserve.server.protocol import ChatRequest, CompletionRequest, parse


def parse_completion(body):
    return parse(CompletionRequest, json.dumps(body).encode(), "/v1/completions")


def parse_chat(body):
    return parse(ChatRequest, json.dumps(body).encode(), "/v1/chat/completions")


def test_completion_fields_become_sampling_params():
    r, sp = parse_completion({"prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "n": 2, "stop": "x",
                          "seed": 3, "logit_bias": {"65": -100, "66": 2.5}, "logprobs": 2, "echo": True,
                          "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [5],
                          "ignore_eos": True, "min_tokens": 1, "priority": 4, "stream": True,
                          "stream_options": {"include_usage": True}, "best_of": 2})
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.stop, sp.seed) == (7, 0.0, 0.5, 2, ["x"], 3)
    assert sp.logit_bias == {65: -100.0, 66: 2.5} and sp.logprobs == 2 and sp.prompt_logprobs == 2
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.stop_token_ids) == (0, 0.1, 1.2, [5])
    assert sp.ignore_eos and sp.min_tokens == 1
    assert r.priority == 4 and r.stream and r.include_usage and r.echo


def test_defaults_follow_openai():
    c, sp = parse_completion({"prompt": [1, 2, 3], "temperature": None, "stop": None})  # null: the default
    assert c.prompts == [[1, 2, 3]] and sp.max_tokens == 16 and sp.temperature == 1.0 and sp.stop == []
    chat, sp = parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert sp.max_tokens is None  # up to the context length
    assert chat.model is None and not chat.logprobs and sp.logprobs is None


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
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop_token_ids": [3, -1]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [3, "4"]}, "stop_token_ids[1]"),
    ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
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
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type"),
    ({"messages": []}, "messages"),
])
def test_chat_errors_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.param == param


def test_a_bad_field_inside_a_message_is_named_by_its_path():
    ok = {"role": "user", "content": "x"}
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [ok, ok, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    # content is a string or a list of text parts: the error says what each alternative wanted
    assert e.value.status == 400 and e.value.param == "messages[2].content"
    assert "messages[2].content[0].type: Input should be 'text', got \"image_url\"" in e.value.message
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [ok, {"role": "robot", "content": "x"}]})
    assert e.value.param == "messages[1].role" and "robot" in e.value.message
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [ok, {"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert e.value.param == "messages[1].content" and "messages[1].content[0].text: Input should be a valid " \
        "string, got 5" in e.value.message


def test_a_whole_number_is_an_integer_but_a_string_is_not():
    _, sp = parse_completion({"prompt": "x", "max_tokens": 8.0, "n": 2.0})
    assert (sp.max_tokens, sp.n) == (8, 2) and isinstance(sp.max_tokens, int)
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "x", "max_tokens": "8"})
    assert e.value.param == "max_tokens" and 'got "8"' in e.value.message


def test_chat_messages_are_normalized_for_templates():
    r, sp = parse_chat({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
        {"role": "user", "content": "q"}], "max_completion_tokens": 5, "max_tokens": 9,
        "logprobs": True, "top_logprobs": 3, "response_format": {"type": "text"}, "tool_choice": "none"})
    assert r.template_messages() == [{"role": "system", "content": "ab"}, {"role": "assistant", "content": "", "name": "bot"},
                          {"role": "user", "content": "q"}]
    assert sp.max_tokens == 5 and sp.logprobs == 3


@pytest.mark.parametrize("raw,code", [(b"", None), (b"[1]", None), (b"{bad", "invalid_json"),
                                      (b"\xff\xfe", "invalid_json")])
def test_a_body_that_is_not_a_json_object_is_a_400(raw, code):
    with pytest.raises(ApiError) as e:
        parse(CompletionRequest, raw, "/v1/completions")
    assert e.value.status == 400 and e.value.code == code and e.value.param is None


GEN = {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 9}


def test_the_models_defaults_fill_only_the_fields_the_client_left_out():
    msgs = [{"role": "user", "content": "x"}]
    _, sp = parse(ChatRequest, json.dumps({"messages": msgs}).encode(), "/v1/chat/completions", GEN)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (0.3, 0.8, 20, 0.05, 1.1)
    assert sp.max_tokens is None  # chat's max_tokens default depends on the prompt: the route applies it
    body = {"messages": msgs, "temperature": 1.0, "top_k": -1, "top_p": None, "repetition_penalty": 1.0}
    _, sp = parse(ChatRequest, json.dumps(body).encode(), "/v1/chat/completions", GEN)
    # given (even at OpenAI's default) wins; null means "not given", so the model's default applies
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repetition_penalty) == (1.0, 0, 0.8, 0.05, 1.0)
    _, sp = parse(CompletionRequest, b'{"prompt": "x"}', "/v1/completions", GEN)
    assert sp.temperature == 0.3 and sp.max_tokens == 16  # completions keep OpenAI's max_tokens default


@pytest.mark.parametrize("field,value", [
    ("use_beam_search", True), ("length_penalty", 0.5), ("early_stopping", True), ("prompt_embeds", "AAAA"),
    ("logits_processors", ["pkg.fn"]), ("return_token_ids", True), ("spaces_between_special_tokens", False),
    ("vllm_xargs", {"k": 1}), ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("web_search_options", {}), ("verbosity", "low"), ("echo", True), ("prompt_logprobs", 1),
])
def test_a_field_that_would_change_the_output_and_is_not_implemented_is_a_400(field, value):
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "x"}], field: value})
    assert e.value.status == 400 and e.value.param == field and "not supported" in e.value.message


def test_unsupported_fields_at_their_no_op_value_or_null_are_accepted(caplog):
    body = {"use_beam_search": False, "length_penalty": 1, "logits_processors": [], "modalities": ["text"],
            "spaces_between_special_tokens": True, "echo": False, "prompt_logprobs": None, "audio": None}
    with caplog.at_level(logging.DEBUG, logger="llmserve.server.protocol"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], **body, "request_id": "r1"})
        parse_completion({"prompt": "x", "use_beam_search": False, "echo": True, "prompt_logprobs": 1})
    assert not caplog.records  # known fields, none of them "unknown"


@pytest.mark.parametrize("value,ok", [(None, True), (-1, True), (1, True), (0, False), (-2, False), ("3", False)])
def test_truncate_prompt_tokens_is_minus_one_or_positive(value, ok):
    body = {"prompt": "x", "truncate_prompt_tokens": value}
    if ok:
        parse_completion(body)
    else:
        with pytest.raises(ApiError) as e:
            parse_completion(body)
        assert e.value.param == "truncate_prompt_tokens"
