"""`llmserve serve --backend grpc` against `llmserve worker` processes: the torch backend's tokens through the worker
contract, streaming and logprobs over the OpenAI SDK, and a worker that is down at start or dies mid-run."""

from __future__ import annotations

import math
import time

import openai
import pytest

from llmserve.engine import Engine
from llmserve.request import SamplingParams
from tests.grpc.conftest import start_worker
from tests.server.conftest import free_port, start_server

PROMPTS = ["The capital of France is", "def fib(n):"]


def _config(model, backend: str, **options) -> dict:
    return {"model": {"model": str(model), "dtype": "float32"},
            "backend": {"name": backend, "kv_cache_memory": "8MiB", "options": options},
            "cache": {"block_size": 4}}


@pytest.fixture(scope="module")
def torch_worker(qwen2_chat):
    """A worker process hosting the torch backend on the tiny checkpoint, and a server using it."""
    proc, address = start_worker("--model", str(qwen2_chat), "--dtype", "float32", "--kv-cache-memory", "8MiB")
    server = start_server(_config(qwen2_chat, "grpc", address=address))
    yield server, address
    server.stop()
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def reference(qwen2_chat):
    """The in-process torch engine's greedy tokens and logprobs for each prompt."""
    eng = Engine.from_config(_config(qwen2_chat, "torch"))
    out = {}
    for p in PROMPTS:
        rid = eng.add_request(eng.tokenizer.encode(p), SamplingParams(max_tokens=12, temperature=0.0, logprobs=2))
        ids, lps = [], []
        while eng.has_unfinished:
            for o in eng.step().outputs:
                if o.request_id == rid:
                    ids += o.new_token_ids
                    lps += o.logprobs or []
        out[p] = (eng.tokenizer.decode(ids), lps)
    eng.shutdown()
    return out


def test_greedy_text_through_the_worker_equals_the_in_process_torch_backend(torch_worker, reference):
    server, _ = torch_worker
    client = server.client(api_key="x")
    texts = [reference[p][0] for p in PROMPTS]
    assert len(set(texts)) == len(texts) and all(len(set(t)) > 2 for t in texts)  # the model's text varies
    for p in PROMPTS:
        r = client.completions.create(model=server.state.config.served_model_name, prompt=p, max_tokens=12,
                                      temperature=0)
        assert r.choices[0].text == reference[p][0]
        assert r.usage.completion_tokens == 12


def test_streaming_through_the_worker_joins_to_the_same_text(torch_worker, reference):
    server, _ = torch_worker
    client = server.client(api_key="x")
    chunks = [c.choices[0].text for c in client.completions.create(
        model=server.state.config.served_model_name, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True)
        if c.choices]
    assert len(chunks) > 3
    assert "".join(chunks) == reference[PROMPTS[1]][0]


def test_logprobs_come_back_from_the_worker(torch_worker, reference):
    server, _ = torch_worker
    r = server.client(api_key="x").completions.create(model=server.state.config.served_model_name,
                                                      prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    ref = reference[PROMPTS[0]][1]
    assert len(lp.token_logprobs) == len(ref) == 12
    for got, want, top in zip(lp.token_logprobs, ref, lp.top_logprobs):
        assert math.isclose(got, want.logprob, abs_tol=1e-4)
        assert max(top.values()) == pytest.approx(got, abs=1e-6)  # greedy: the best token
        # (two tokens may decode to the same text, one key of the SDK's dict)
        assert all(any(math.isclose(v, w, abs_tol=1e-4) for _, w in want.top) for v in top.values())


def test_stats_show_the_worker_and_its_backend(torch_worker):
    server, address = torch_worker
    b = server.stats()["backend"]
    assert b["backend"] == "grpc" and b["address"] == address
    assert b["worker_backend"] == "torch" and b["worker"]["backend"] == "torch"


def test_a_worker_down_at_start_is_named_in_the_error():
    from llmserve_grpc.backend import WorkerError

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=f"no llmserve worker answers at {address}"):
        Engine.from_config({"backend": {"name": "grpc", "options": {"address": address, "connect_timeout_s": 0.5}}})
    assert time.monotonic() - t0 < 10


def test_a_fake_worker_embeds_then_dies_mid_run_and_its_requests_fail_with_503(caplog):
    proc, address = start_worker("--backend", "fake", "--set", "backend.options.step_cost_s=0.05")
    server = start_server({"backend": {"name": "grpc", "options": {"address": address, "timeout_s": 20}},
                           "tokenizer": {"name": "byte"}})
    try:
        client = server.client(api_key="x", max_retries=0, timeout=30)
        model = server.state.config.served_model_name
        assert model == "fake"  # no --model: the worker's model names it
        assert client.completions.create(model=model, prompt="hi", max_tokens=3).usage.completion_tokens == 3
        # embeddings cross the contract too: the worker pools, as the fake backend in process does
        local = start_server({"backend": {"name": "fake"}, "tokenizer": {"name": "byte"}})
        try:
            want = local.client(api_key="x").embeddings.create(model="fake", input=["hello", "a longer input"])
        finally:
            local.stop()
        got = client.embeddings.create(model=model, input=["hello", "a longer input"])
        assert [e.embedding for e in got.data] == [e.embedding for e in want.data] and len(got.data[0].embedding) > 8
        stream = client.completions.create(model=model, prompt="hello", max_tokens=400, stream=True)
        first = next(iter(stream))
        assert first.choices
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as err:  # the stream ends with the engine's error event
            for _ in stream:
                pass
        assert address in str(err.value)
        with pytest.raises(openai.APIStatusError, match=f"llmserve worker at {address} is unreachable") as down:
            client.completions.create(model=model, prompt="again", max_tokens=3)
        # 503, OpenAI's shape, a Retry-After: the worker is away, not the request wrong or the server broken
        assert down.value.status_code == 503 and down.value.response.headers["retry-after"] == "5"
        assert down.value.body["code"] == "backend_unavailable"
        assert time.monotonic() - t0 < 15  # not a hang
        assert any(f"llmserve worker at {address} is unreachable" in r.getMessage() for r in caplog.records)
    finally:
        server.stop()
        proc.kill()


def test_a_worker_that_lost_the_servers_kv_cache_stops_the_engine_with_503s(caplog):
    # another server (or a restart) initialised the worker: the KV blocks this server's scheduler and prefix cache
    # believe computed are gone there. Every request used to fail with a 500 and a traceback while /health said ok
    import grpc
    import httpx

    from llmserve_grpc import worker_pb2 as pb
    from llmserve_grpc import worker_pb2_grpc as pb_grpc

    proc, address = start_worker("--backend", "fake")
    server = start_server({"backend": {"name": "grpc", "options": {"address": address, "timeout_s": 20}},
                           "tokenizer": {"name": "byte"}})
    try:
        body = {"prompt": "hi", "max_tokens": 3}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        with grpc.insecure_channel(address) as channel:
            pb_grpc.ModelWorkerStub(channel).InitKvCache(pb.InitKvCacheRequest(num_blocks=10, block_size=16))
        for _ in range(3):
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "lost this server's KV cache" in health.json()["error"]
        said = [r for r in caplog.records if "lost this server's KV cache" in r.getMessage()]
        assert len(said) == 1 and not [r for r in caplog.records if r.exc_info], caplog.text  # once, no traceback
    finally:
        server.stop()
        proc.kill()


def test_constraints_reach_the_worker_as_its_mask(torch_worker):
    server, _ = torch_worker
    client = server.client(api_key="x")
    for choices in (["yes", "no"], ["blue", "green", "red"]):
        r = client.completions.create(model=server.state.config.served_model_name, prompt="Pick one:", max_tokens=8,
                                      temperature=0, extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].text in choices
    r = client.completions.create(model=server.state.config.served_model_name, prompt="Digits:", max_tokens=6,
                                  temperature=1.0, seed=5, extra_body={"structured_outputs": {"regex": "[0-9]{6}"}})
    assert len(r.choices[0].text) == 6 and r.choices[0].text.isdigit()
