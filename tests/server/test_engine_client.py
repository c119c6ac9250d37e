"""A new engine client plugs in behind EngineClient without touching the routes: a test double (no Engine at all)
serves /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages through the real app and uvicorn."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

import anthropic
import httpx
import pytest

from llmserve.config import config_from_dict
from llmserve.engine_client import RequestStream
from llmserve.plugins import load_plugins
from llmserve.request import FinishReason, RequestOutput
from llmserve.serving_model import ServingModel

from tests.server.conftest import FAKE, start_server

# the model the double serves, described as an engine elsewhere describes itself (serving_model.describe_model)
FACTS = {"model": "echo", "served_model_name": "echo", "max_model_len": 64, "vocab_size": 257, "eos_token_id": None,
         "generation_defaults": {"temperature": 0.25, "max_tokens": 5}, "generation_defaults_source": "the test",
         "pooling": None, "embedding_size": None, "generates": True, "backend_info": {"backend": "echo"},
         "tokenizer_path": None, "default_tokenizer": "byte"}


class EchoClient:
    """An EngineClient with no engine: each sequence answers the last max_tokens text tokens of its prompt, one per
    delta, and records the SamplingParams it was given."""

    def __init__(self, config):
        self.serving: concurrent.futures.Future = concurrent.futures.Future()
        self.model = ServingModel.from_facts(config, load_plugins(), FACTS)
        self.dead = None
        self.num_steps = 0
        self.seen: list = []  # (prompt ids, SamplingParams) of every request
        self.metric_sinks: list = []
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False

    running = property(lambda self: self._started)
    pid = property(lambda self: os.getpid())
    num_active = property(lambda self: len(self._streams))
    num_waiting = property(lambda self: 0)

    def add_metric_sink(self, sink) -> None:
        self.metric_sinks.append(sink)

    def start(self, loop=None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._started = True
        if not self.serving.done():
            self.serving.set_result(self.model)

    async def drain(self, timeout: float) -> None:
        pass

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        self._started = False

    def add_request(self, prompt_token_ids, params, request_id=None, priority=0, cache_salt=None, pooling=None):
        self.seen.append((list(prompt_token_ids), params))
        stream = RequestStream(request_id, params.n, self._loop)
        self._streams[request_id] = stream
        self._loop.create_task(self._answer(stream, list(prompt_token_ids), params.max_tokens))
        return stream

    async def _answer(self, stream: RequestStream, prompt: list[int], max_tokens: int) -> None:
        text = [t for t in prompt if t < 256][-max_tokens:]
        tok = self.model.tokenizer
        for i in range(stream.n):
            for k, t in enumerate(text):
                await asyncio.sleep(0)
                if stream.done:
                    return
                last = k == len(text) - 1
                self.num_steps += 1
                stream.put(RequestOutput(stream.request_id, i, [t], tok.decode([t]), finished=last,
                                         finish_reason=FinishReason.LENGTH if last else None,
                                         num_prompt_tokens=len(prompt), num_output_tokens=k + 1))
        self._streams.pop(stream.request_id, None)

    def abort(self, request_id: str) -> None:
        s = self._streams.pop(request_id, None)
        if s is not None:
            s.close()

    async def call(self, fn):
        return fn(self)

    def stats(self) -> dict:
        return {"model": "echo", "waiting": 0, "running": len(self._streams)}


@pytest.fixture(scope="module")
def echo():
    cfg = FAKE | {"model": {"model": "echo", "max_model_len": 64}, "server": {"api_key": "k"}}
    client = EchoClient(config_from_dict(cfg))
    s = start_server(cfg, client=client)
    s.double = client
    yield s
    s.stop()


def test_completions_whole_and_streamed(echo):
    c = echo.client(api_key="k")
    r = c.completions.create(model="echo", prompt="abcdefgh", max_tokens=3)
    assert r.choices[0].text == "fgh" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    pieces = [ch.choices[0].text for ch in c.completions.create(model="echo", prompt="xyz", max_tokens=2, stream=True)
              if ch.choices]
    assert "".join(pieces) == "yz" and len([p for p in pieces if p]) == 2
    _, sp = echo.double.seen[-1]
    assert sp.temperature == 0.25  # the model's default for a field the body left out


def test_chat_whole_and_streamed_with_the_models_defaults(echo):
    c = echo.client(api_key="k")
    msgs = [{"role": "user", "content": "hello there"}]
    r = c.chat.completions.create(model="echo", messages=msgs, temperature=0.5)
    ids, sp = echo.double.seen[-1]
    # max_tokens left out: the model's default (5); the text is the rendered prompt's last 5 tokens
    assert sp.max_tokens == 5 and sp.temperature == 0.5
    assert r.choices[0].message.content == echo.double.model.tokenizer.decode([t for t in ids if t < 256][-5:])
    chunks = list(c.chat.completions.create(model="echo", messages=msgs, max_tokens=4, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content[-4:]
    models = c.models.list().data
    assert models[0].id == "echo" and models[0].model_extra["sampling_defaults"]["source"] == "the test"


def test_responses_and_messages_use_the_same_client(echo):
    before = len(echo.double.seen)
    r = httpx.post(echo.url + "/v1/responses", json={"model": "echo", "input": "hi", "max_output_tokens": 2},
                   headers={"Authorization": "Bearer k"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == echo.double.model.tokenizer.decode(
        [t for t in echo.double.seen[-1][0] if t < 256][-2:])
    m = anthropic.Anthropic(base_url=echo.url, api_key="k", max_retries=0, timeout=30).messages.create(
        model="echo", max_tokens=3, messages=[{"role": "user", "content": "hey"}])
    assert m.content[0].text == echo.double.model.tokenizer.decode([t for t in echo.double.seen[-1][0] if t < 256][-3:])
    assert len(echo.double.seen) == before + 2


def test_a_bad_body_is_refused_by_the_serving_models_limits(echo):
    r = httpx.post(echo.url + "/v1/completions", json={"model": "echo", "prompt": [300], "max_tokens": 1},
                   headers={"Authorization": "Bearer k"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # token 300 is past vocab_size 257
    r = httpx.get(echo.url + "/stats", headers={"Authorization": "Bearer k"}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == "echo"
