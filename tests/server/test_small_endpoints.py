"""vLLM's /tokenize and /detokenize, /version, and the usage a stream carries (cached tokens, continuous)."""

from __future__ import annotations

import json

import httpx
import pytest

import llmserve


def post(server, path, body=None, **kw):
    return httpx.post(server.url + path, json=body, timeout=10, **kw)


def test_version(fake_server):
    assert httpx.get(fake_server.url + "/version").json() == {"version": llmserve.__version__}


def test_tokenize_a_prompt_and_chat_messages(fake_server):
    r = post(fake_server, "/tokenize", {"model": "embedded", "prompt": "hello"})
    assert r.status_code == 200
    assert r.json() == {"count": 5, "max_model_len": 512, "tokens": list(b"hello"), "token_strs": None}
    r = post(fake_server, "/tokenize", {"prompt": "hi", "return_token_strs": True}).json()
    assert r["token_strs"] == ["h", "i"]
    # messages are rendered as /v1/chat/completions renders them
    msgs = [{"role": "user", "content": "hi"}]
    r = post(fake_server, "/tokenize", {"messages": msgs}).json()
    assert r["tokens"] == list(b"user: hi\nassistant:")
    chat = fake_server.client().chat.completions.create(model="embedded", messages=msgs, max_tokens=1)
    assert chat.usage.prompt_tokens == r["count"]
    r = post(fake_server, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
    assert r["tokens"] == list(b"user: hi\n")


def test_detokenize(fake_server):
    assert post(fake_server, "/detokenize", {"model": "embedded", "tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert post(fake_server, "/detokenize", {"tokens": [104, 256]}).json() == {"prompt": "h<|endoftext|>"}
    assert post(fake_server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    # an argument of the renderer (the byte tokenizer's too), not a template variable
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs.messages"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 257]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
])
def test_bad_bodies_are_4xx_naming_the_field(fake_server, path, body, status, param):
    r = post(fake_server, path, body)
    assert r.status_code == status and r.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_body_that_is_not_a_json_object_is_a_400(fake_server, path):
    for raw in (b"{bad", b"[1]", b"", b'"messages"', b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000):
        r = httpx.post(fake_server.url + path, content=raw, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def _events(server, body):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=10) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_streamed_usage_carries_cached_tokens_and_continuous_usage_every_chunk(fake_server):
    msgs = [{"role": "user", "content": "a long enough prompt to fill four blocks of sixteen"}]
    body = {"messages": msgs, "max_tokens": 6, "stream": True, "ignore_eos": True}
    _events(fake_server, body)  # the prompt's full blocks are cached now
    chunks = _events(fake_server, body | {"stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 6
    assert usage["prompt_tokens_details"]["cached_tokens"] == 64  # the 4 full blocks of the 68-token prompt
    chunks = _events(fake_server, body | {"stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 6  # the usage so far, on every chunk
    assert all(c["usage"]["prompt_tokens"] == usage["prompt_tokens"] for c in chunks)
    assert chunks[-1]["usage"] == usage
