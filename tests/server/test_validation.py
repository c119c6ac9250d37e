"""Validation once: the shared vocabulary/context rule, SamplingParams.validate once per request, /openapi.json."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import httpx
import pytest

from llmserve.async_engine import EngineDeadError
from llmserve.errors import InvalidRequestError
from llmserve.limits import check_request
from llmserve.request import SamplingParams
from llmserve.server.errors import ApiError
from llmserve.server.generation import Generation


@pytest.mark.parametrize("ids,sp,param,code,words", [
    ([], SamplingParams(), "prompt", None, "empty"),
    ([1, 300, 2], SamplingParams(), "prompt", None, "token id 300"),
    ([1, -1], SamplingParams(), "prompt", None, "token id -1"),
    ([1, 2.0], SamplingParams(), "prompt", None, "token id 2.0"),
    ([1, 2], SamplingParams(logit_bias={257: 1.0}), "logit_bias", None, "logit_bias token 257"),
    (list(range(100)), SamplingParams(max_tokens=None), "prompt", "context_length_exceeded", "100 tokens"),
    ([1] * 90, SamplingParams(max_tokens=11), "max_tokens", "context_length_exceeded", "101 tokens (90 in the prompt"),
])
def test_check_request_refuses_what_the_engine_cannot_run(ids, sp, param, code, words):
    with pytest.raises(InvalidRequestError) as e:
        check_request(ids, sp, vocab_size=257, max_model_len=100)
    assert e.value.param == param and e.value.code == code and words in str(e.value)


def test_check_request_accepts_up_to_the_limits_and_names_the_callers_field():
    check_request([0, 256] * 45, SamplingParams(max_tokens=10, logit_bias={256: 5.0}), 257, 100)  # exactly 100
    check_request([5] * 99, SamplingParams(max_tokens=None), 257, 100)  # room for one token
    with pytest.raises(InvalidRequestError) as e:
        check_request([5] * 100, SamplingParams(max_tokens=None), 257, 100, param="messages")
    assert e.value.param == "messages" and "maximum context length is 100 tokens" in str(e.value)


def test_sampling_params_are_validated_once_per_request(fake_server, monkeypatch):
    callers = []
    validate = SamplingParams.validate

    def counted(self):
        callers.append(sys._getframe(1).f_globals["__name__"])  # the calling module
        return validate(self)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    client = fake_server.client()
    client.completions.create(model="embedded", prompt=["ab", "cd"], n=2, max_tokens=2)
    client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                   stream=True).close()
    # once per HTTP request, in the protocol layer: not per prompt or choice, and not again in the engine
    assert callers == ["llmserve.server.protocol"] * 2


def test_what_only_the_engine_knows_is_a_400_before_any_event(fake_server):
    url = fake_server.url
    with httpx.stream("POST", url + "/v1/completions",
                      json={"prompt": "abc", "max_tokens": 600, "stream": True}) as r:
        err = json.loads(r.read())["error"]
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    # one prompt of several is too long: the whole request is refused, naming that prompt
    r = httpx.post(url + "/v1/completions", json={"prompt": ["ab", "a" * 600], "max_tokens": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 600}],
                                                       "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url + "/v1/completions", json={"prompt": "ab", "logit_bias": {"300": 1}, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert fake_server.wait_idle()["cache"]["used_blocks"] == 0


def test_an_engine_that_stopped_after_admission_is_a_503_and_runs_nothing():
    class StopsAfterOne:  # admission passed; the engine stops while the request is being tokenized
        def __init__(self):
            self.added, self.aborted = [], []

        def add_request(self, ids, sp, request_id, priority, cache_salt=None, pooling=None):
            if self.added:
                raise EngineDeadError("the engine is not running")
            self.added.append(request_id)
            return SimpleNamespace(request_id=request_id)

        def abort(self, request_id):
            self.aborted.append(request_id)

    engine = StopsAfterOne()
    with pytest.raises(ApiError) as e:
        Generation(engine, [[1], [2]], SamplingParams(), 0, None, "r")
    assert e.value.status == 503 and e.value.code == "engine_unavailable"
    assert engine.added == engine.aborted == ["r-0"]


def test_openapi_json_describes_the_request_bodies(fake_server):
    r = httpx.get(fake_server.url + "/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.") and set(doc["paths"]) >= {
        "/v1/completions", "/v1/chat/completions", "/v1/generate",  # (llmserve_generate's)
        "/v1/messages", "/v1/messages/count_tokens"}  # (llmserve_anthropic's; more plugins may add theirs)
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatRequest"]
    assert chat["required"] == ["messages"] and chat["properties"]["temperature"]["type"] == "number"
    assert "user" in schemas["Message"]["properties"]["role"]["enum"]
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatRequest"}
    assert set(schemas["CompletionRequest"]["required"]) == {"prompt"}


def test_a_priority_under_fcfs_is_a_400_naming_priority_streaming_or_not(fake_server):
    for stream in (False, True):
        r = httpx.post(fake_server.url + "/v1/completions",
                       json={"prompt": "x", "max_tokens": 2, "priority": 3, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "priority" and "fcfs" in err["message"]
    assert fake_server.wait_idle()["cache"]["used_blocks"] == 0
