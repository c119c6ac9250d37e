"""The official openai SDK against a real uvicorn server running the fake backend.

The fake backend's next token is a pure function of the tokens so far (llmserve_fake.next_token),
so each expected answer is computed here independently of the server.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from llmserve_fake import next_token
from llmserve_tokenizers.byte import ByteTokenizer, render_simple_chat

TOK = ByteTokenizer()


def expected_ids(prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> tuple[list[int], str]:
    """The fake backend's continuation and its finish reason."""
    ids, out = list(prompt_ids), []
    for _ in range(max_tokens):
        t = next_token(ids, len(ids), 257, 256)
        if t == 256 and ignore_eos:
            t = 0
        ids.append(t)
        out.append(t)
        if t == 256:
            return out, "stop"
    return out, "length"


def expected_text(prompt: str, max_tokens: int) -> tuple[str, str, int]:
    out, reason = expected_ids(TOK.encode(prompt), max_tokens)
    return TOK.decode(out), reason, len(out)


@pytest.fixture(scope="module")
def client(fake_server):
    return fake_server.client()


def test_completion_matches_the_fake_model(client):
    r = client.completions.create(model="embedded", prompt="Hello, world", max_tokens=12)
    text, reason, n = expected_text("Hello, world", 12)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "embedded"
    assert r.created > 0
    (c,) = r.choices
    assert (c.index, c.text, c.finish_reason, c.logprobs) == (0, text, reason, None)
    assert r.usage.prompt_tokens == len("Hello, world")
    assert r.usage.completion_tokens == n
    assert r.usage.total_tokens == n + len("Hello, world")


def test_completion_prompt_forms(client):
    prompts = ["abc", "defgh"]
    r = client.completions.create(model="embedded", prompt=prompts, max_tokens=5, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text == expected_text(prompts[c.index // 2], 5)[0]
    assert r.usage.prompt_tokens == 8
    ids = TOK.encode("abc")
    r1 = client.completions.create(model="embedded", prompt=ids, max_tokens=5)
    assert r1.choices[0].text == expected_text("abc", 5)[0]
    r2 = client.completions.create(model="embedded", prompt=[ids, TOK.encode("defgh")], max_tokens=5)
    assert [c.text for c in r2.choices] == [expected_text(p, 5)[0] for p in prompts]


def test_chat_completion_uses_the_chat_template(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    r = client.chat.completions.create(model="embedded", messages=msgs, max_tokens=9)
    prompt = render_simple_chat(msgs)
    text, reason, n = expected_text(prompt, 9)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (c,) = r.choices
    assert c.message.role == "assistant" and c.message.content == text and c.finish_reason == reason
    assert r.usage.prompt_tokens == len(prompt.encode()) and r.usage.completion_tokens == n
    # max_completion_tokens wins over max_tokens
    r2 = client.chat.completions.create(model="embedded", messages=msgs, max_tokens=9, max_completion_tokens=3)
    assert r2.usage.completion_tokens == 3 and r2.choices[0].message.content == expected_text(prompt, 3)[0]


def test_streaming_completion_with_usage(client):
    full = client.completions.create(model="embedded", prompt="stream me", max_tokens=20)
    chunks = list(client.completions.create(model="embedded", prompt="stream me", max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == len("stream me")
    assert all(c.usage is None for c in content)
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    # without include_usage there is no usage chunk
    plain = list(client.completions.create(model="embedded", prompt="stream me", max_tokens=20, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


def test_chat_streaming_sends_role_then_content(client):
    msgs = [{"role": "user", "content": "count"}]
    full = client.chat.completions.create(model="embedded", messages=msgs, max_tokens=15)
    chunks = list(client.chat.completions.create(model="embedded", messages=msgs, max_tokens=15, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    body, last = chunks[1:-1], chunks[-1]
    assert all(c.choices[0].delta.role is None for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == full.choices[0].message.content
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert last.usage.total_tokens == full.usage.total_tokens and last.choices == []


def test_n_completions_each_finish(client):
    r = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=6, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    # the fake model ignores sampling, so every choice is the same known continuation
    text, reason, n = expected_text(render_simple_chat([{"role": "user", "content": "x"}]), 6)
    assert all(c.message.content == text and c.finish_reason == reason for c in r.choices)
    assert r.usage.completion_tokens == 3 * n
    stream = list(client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=6, n=3, stream=True))
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1, 2}
    texts = {i: "".join(c.choices[0].delta.content or "" for c in stream if c.choices[0].index == i) for i in range(3)}
    assert texts == {c.index: c.message.content for c in r.choices}


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model="embedded", prompt="abcd", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 and lp.tokens[i] in t for i, t in enumerate(lp.top_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # echo: the prompt's tokens come first; the first has no logprob
    e = client.completions.create(model="embedded", prompt="abcd", max_tokens=4, logprobs=1, echo=True)
    c = e.choices[0]
    assert c.text == "abcd" + r.choices[0].text
    assert c.logprobs.tokens[:4] == ["a", "b", "c", "d"]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(x is not None for x in c.logprobs.token_logprobs[1:])
    assert len(c.logprobs.tokens) == 4 + n


def test_echo_with_zero_max_tokens_scores_the_prompt(client):
    r = client.completions.create(model="embedded", prompt="scored", max_tokens=0, echo=True, logprobs=0)
    c = r.choices[0]
    assert c.text == "scored" and r.usage.completion_tokens == 0
    assert c.logprobs.tokens == list("scored") and c.logprobs.token_logprobs[0] is None
    assert len([x for x in c.logprobs.token_logprobs if x is not None]) == 5
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="embedded", prompt="x", max_tokens=0)


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3 and isinstance(e.bytes, list)
        assert e.top_logprobs[0].token == e.token
    # streamed, the same entries arrive spread over the chunks
    chunks = list(client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_stop_string_ends_the_text(client):
    prompt = "Tell me a story about"
    out, _ = expected_ids(TOK.encode(prompt), 60)
    # pick a printable ASCII byte the fake model will produce, after at least one token
    k = next(i for i, t in enumerate(out) if i > 0 and 33 <= t < 127)
    stop = chr(out[k])
    r = client.completions.create(model="embedded", prompt=prompt, max_tokens=60, stop=[stop, "\x00never"])
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.text == TOK.decode(out[:k]).split(stop)[0]
    assert stop not in c.text
    # stop_token_ids (vLLM's extension) end at the token itself
    r2 = client.completions.create(model="embedded", prompt=prompt, max_tokens=60,
                                   extra_body={"stop_token_ids": [out[k]]})
    assert r2.choices[0].finish_reason == "stop" and r2.usage.completion_tokens == k + 1


def test_seed_and_extension_fields_are_accepted(client):
    kw = dict(model="embedded", prompt="seeded", max_tokens=10, temperature=0.8, seed=123, top_p=0.9,
              presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"65": 1}, user="u1",
              extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True,
                          "min_tokens": 2, "priority": 0, "some_unknown_field": {"x": 1}})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens == 10  # ignore_eos: always max_tokens


def test_models(client, fake_server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["embedded"]
    assert client.models.retrieve("embedded").id == "embedded"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_p": 1.5}, "top_p"),
    ({"logprobs": 21}, "logprobs"),  # vLLM's limit, 20 (OpenAI's is 5)
    ({"max_tokens": -3}, "max_tokens"),
    ({"suffix": "tail"}, "suffix"),
    ({"stop": 5}, "stop"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"extra_body": {"stop_token_ids": "x"}}, "stop_token_ids"),
])
def test_bad_completion_fields_are_400_naming_the_field(client, kwargs, param):
    args = {"model": "embedded", "prompt": "x", "max_tokens": 3, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("kwargs,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces", "parameters": {}}}]}, "tools[0].function.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_chat_fields_are_400_naming_the_field(client, kwargs, param):
    args = {"model": "embedded", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.body["param"] == param


def test_context_length_error_names_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="embedded", prompt="abcdefghij", max_tokens=600)
    msg = e.value.body["message"]
    assert "512" in msg and "610" in msg and "10 in the prompt" in msg and "600" in msg
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e2:
        client.completions.create(model="embedded", prompt="a" * 600, max_tokens=1)
    assert "600" in e2.value.body["message"] and e2.value.body["param"] == "prompt"
    # a long text is tokenized off the event loop; the check is the same
    with pytest.raises(openai.BadRequestError) as e3:
        client.completions.create(model="embedded", prompt="é" * 20_000, max_tokens=1)
    assert "40000 tokens" in e3.value.body["message"]


def test_every_answer_carries_a_request_id(client, fake_server):
    # as OpenAI's: the SDK reads it as _request_id; a client's own usable X-Request-Id comes back
    r = client.completions.create(model="embedded", prompt="x", max_tokens=2)
    assert r._request_id.startswith("req_") and len(r._request_id) == 36
    mine = {"x-request-id": "trace-42:a.b_c"}
    for method, path, body in (("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
                               ("POST", "/v1/completions", {"prompt": 5}), ("GET", "/health", None)):
        r = httpx.request(method, fake_server.url + path, json=body, headers=mine, timeout=30)
        assert r.headers["x-request-id"] == "trace-42:a.b_c", (path, r.status_code)
    r = httpx.get(fake_server.url + "/health", headers={"x-request-id": "no spaces or\x7f"}, timeout=30)
    assert r.headers["x-request-id"].startswith("req_")  # not echoed: a new one


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert e.value.body["type"] == "invalid_request_error"  # OpenAI's type for an unknown model


def test_invalid_json_and_error_body_shape(fake_server):
    r = httpx.post(fake_server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "JSON" in err["message"]
    r = httpx.post(fake_server.url + "/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "object" in r.json()["error"]["message"]
    r = httpx.get(fake_server.url + "/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(fake_server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_body_over_the_limit_is_413(fake_server):
    limit = fake_server.state.config.server.max_body_bytes
    big = b'{"prompt": "' + b"a" * (limit + 10) + b'"}'
    r = httpx.post(fake_server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while it streams in
        yield b'{"prompt": "'
        for _ in range(limit // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(fake_server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_backend_failure_is_500_for_that_request_only(client, fake_server):
    fake_server.engine.backend.fail_next = RuntimeError("injected fault")  # the next step fails
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="embedded", prompt="doomed", max_tokens=5)
    finally:
        fake_server.engine.backend.fail_next = None
    assert e.value.status_code == 500 and "injected fault" in e.value.body["message"]
    # the server keeps serving
    r = client.completions.create(model="embedded", prompt="fine", max_tokens=5)
    assert r.choices[0].text == expected_text("fine", 5)[0]
    assert httpx.get(fake_server.url + "/health").status_code == 200


def test_backend_failure_mid_stream_is_an_error_event(fake_server, monkeypatch):
    backend = fake_server.engine.backend
    real_execute = backend.execute
    armed = {"on": False, "failed": False}

    def failing_once_armed(batch):
        if armed["on"] and not armed["failed"]:
            armed["failed"] = True
            raise RuntimeError("injected mid-stream")
        return real_execute(batch)

    monkeypatch.setattr(backend, "execute", failing_once_armed)
    # a slow step, so the stream is still running when the client arms the failure
    monkeypatch.setattr(backend, "step_cost_s", 0.005)
    client = fake_server.client()
    got = []
    with pytest.raises(openai.APIError, match="injected mid-stream"):
        for chunk in client.completions.create(model="embedded", prompt="s", max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True}):
            got.append(chunk)
            armed["on"] = True
    assert got and armed["failed"]
    assert fake_server.wait_idle()["cache"]["used_blocks"] == 0


def test_draining_server_answers_503(client, fake_server):
    fake_server.state.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="embedded", prompt="x", max_tokens=2)
        assert e.value.status_code == 503
        assert httpx.get(fake_server.url + "/health").status_code == 503
    finally:
        fake_server.state.draining = False
    assert httpx.get(fake_server.url + "/health").json() == {"status": "ok"}


def test_sse_framing(fake_server):
    with httpx.stream("POST", fake_server.url + "/v1/completions",
                      json={"prompt": "frame", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])



def test_sse_chunks_are_ascii_so_no_client_splits_them(fake_server):
    # the fake model writes arbitrary bytes; U+0085 or U+2028 left raw would be a line break to
    # clients that split lines like str.splitlines()
    with httpx.stream("POST", fake_server.url + "/v1/completions",
                      json={"prompt": "bytes", "max_tokens": 300, "stream": True, "ignore_eos": True}) as r:
        raw = r.read()
    assert raw.isascii() and b"\\u" in raw
    text = raw.decode()
    assert all(line.startswith("data: ") for line in text.splitlines() if line)
