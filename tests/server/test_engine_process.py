"""server.engine_core=process: the engine steps in a child process; the API, errors, metrics, drain and
the child's death behave as with the engine on a thread."""

from __future__ import annotations

import asyncio
import json
import operator
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from llmserve.config import config_from_dict
from llmserve.engine_process import ProcessEngine
from llmserve.interfaces import MetricSink
from llmserve.request import SamplingParams
from tests.server.conftest import free_port
from tests.server.test_serve_process import ROOT, start_serve, stream_in_background


@pytest.fixture(scope="module")
def served():
    proc, url = start_serve("server.engine_core=process", "backend.options.step_cost_s=0.002")
    yield proc, url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.stdout.read()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_the_engine_steps_in_another_process(served):
    proc, url = served
    server = httpx.get(url + "/stats").json()["server"]
    assert server["engine_pid"] not in (None, proc.pid)
    os.kill(server["engine_pid"], 0)  # it exists


def test_completions_chat_and_streams_through_the_child(served):
    _, url = served
    c = sdk(url)
    r = c.completions.create(model="fake", prompt="hello", max_tokens=12,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    # the same request streamed, n = 2: each choice's text equals the unstreamed answer (the fake is deterministic)
    chunks = list(c.completions.create(model="fake", prompt="hello", max_tokens=12, n=2, stream=True,
                                       extra_body={"ignore_eos": True}))
    texts = ["", ""]
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == [r.choices[0].text] * 2
    chat = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5


def test_embeddings_cross_the_pipe_and_their_rules_are_checked_here(served):
    _, url = served
    r = sdk(url).embeddings.create(model="fake", input=["hello", "world", "hello"])
    vecs = [d.embedding for d in r.data]
    assert [len(v) for v in vecs] == [64] * 3 and vecs[0] == vecs[2] != vecs[1]
    bad = httpx.post(url + "/v1/embeddings", json={"input": "x", "dimensions": 8}, timeout=30)  # not Matryoshka
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"


def test_structured_output_is_checked_here_and_enforced_in_the_child(served):
    _, url = served
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    r = sdk(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=500,
                                         response_format=fmt, n=2)
    for choice in r.choices:
        value = json.loads(choice.message.content)
        assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)
    # a schema the grammar engine refuses is a 400 from this process, before the child sees it
    bad = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "no-such-type"}}}
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text


def test_errors_raised_in_the_child_reach_the_client_as_400(served):
    _, url = served
    # the continuous scheduler's FCFS policy refuses a priority: raised in the child's scheduler.add
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "priority": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and set(err) == {"message", "type", "param", "code"}
    # and the server goes on serving
    assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_metrics_and_stats_come_from_the_child_engine(served):
    _, url = served
    before = httpx.get(url + "/stats").json()
    sdk(url).completions.create(model="fake", prompt="count me", max_tokens=7, extra_body={"ignore_eos": True})
    time.sleep(0.15)  # /stats is a snapshot of at most 0.1 s ago
    after = httpx.get(url + "/stats").json()
    assert after["server"]["steps"] >= before["server"]["steps"] + 7
    assert after["metrics"]["generation_tokens"] >= before["metrics"]["generation_tokens"] + 7
    text = httpx.get(url + "/metrics").text
    gen = next(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("llmserve_generation_tokens_total"))
    assert gen >= 7
    running = next(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("llmserve_num_requests_running"))
    assert running == 0  # the gauges show the idle present, not the last step


def test_a_client_that_leaves_frees_its_blocks_in_the_child(served):
    _, url = served
    body = {"prompt": "leave early", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 10
    while (s := httpx.get(url + "/stats").json())["running"] or s["cache"]["used_blocks"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def test_sigterm_to_the_whole_group_still_drains():
    # systemd's default KillMode and `timeout` signal every process of the group: the engine must outlive the drain
    proc, url = start_serve("server.engine_core=process", "server.drain_timeout=20", start_new_session=True)
    try:
        t, lines = stream_in_background(url, "drain me", 200)
        os.killpg(proc.pid, signal.SIGTERM)
        t.join(30)
        assert proc.wait(30) == 0, proc.stdout.read()
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2], lines[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dead_engine_process_fails_its_requests_and_health_says_so():
    proc, url = start_serve("server.engine_core=process")
    try:
        pid = httpx.get(url + "/stats").json()["server"]["engine_pid"]
        t, lines = stream_in_background(url, "doomed", 3000)
        os.kill(pid, signal.SIGKILL)
        t.join(15)
        assert not t.is_alive()
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "engine process exited" in err["message"] and set(err) == {"message", "type", "param", "code"}
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "stopped"
        r = httpx.post(url + "/v1/completions", json={"prompt": "after", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(url + "/stats").status_code == 503
    finally:
        proc.kill()
        proc.wait()


def test_a_child_that_cannot_build_fails_the_command_with_its_reason():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    r = subprocess.run([sys.executable, "-m", "llmserve", "--log-level", "warning", "serve", "--backend", "fake",
                        "--port", str(free_port()), "--set", "server.engine_core=process",
                        "--set", "backend.options.no_such_option=1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "no_such_option" in r.stderr and "llmserve: error:" in r.stderr


def test_engine_core_is_validated():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    r = subprocess.run([sys.executable, "-m", "llmserve", "serve", "--backend", "fake",
                        "--set", "server.engine_core=elsewhere"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "server.engine_core" in r.stderr, r.stderr


def _a_lock(engine):
    """A call whose result cannot cross back to the server (a lock does not pickle)."""
    return threading.Lock()


class _FlakySink(MetricSink):
    """Raises on its third step event."""

    def __init__(self):
        self.steps = 0

    def on_step(self, metrics) -> None:
        self.steps += 1
        if self.steps == 3:
            raise ValueError("a sink bug")


def _with_process_engine(body):
    """Run body(engine) against a started ProcessEngine (fake backend) on a fresh event loop, then shut it down."""
    async def run():
        pe = ProcessEngine(config_from_dict({"backend": {"name": "fake", "options": {"step_cost_s": 0.002}}}))
        pe.start(asyncio.get_running_loop())
        await asyncio.wait_for(asyncio.wrap_future(pe.built), 60)
        try:
            return await body(pe)
        finally:
            await pe.shutdown(0)
    return asyncio.run(run())


async def _tokens(pe, n: int) -> int:
    stream = pe.add_request([1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True))
    got = 0
    while batch := await asyncio.wait_for(stream.next_batch(), 10):
        got += sum(len(o.new_token_ids) for o in batch)
    assert stream.error is None
    return got


def test_calls_that_cannot_cross_the_pipe_fail_alone():
    async def body(pe):
        with pytest.raises(TypeError, match="must pickle"):
            await pe.call(lambda e: e.num_waiting)  # a lambda never reaches the child
        with pytest.raises(RuntimeError, match="does not pickle"):
            await asyncio.wait_for(pe.call(_a_lock), 10)  # its result cannot come back
        assert pe.running
        assert await _tokens(pe, 12) == 12  # and the engine serves on
        stats = await pe.call(operator.methodcaller("stats"))
        assert stats["running"] == 0
    _with_process_engine(body)


def test_a_failing_metric_sink_costs_no_request_its_tokens():
    async def body(pe):
        sink = _FlakySink()
        pe.add_metric_sink(sink)
        assert await _tokens(pe, 10) == 10
        assert sink.steps >= 10  # it kept getting events after it raised
    _with_process_engine(body)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return False


def test_the_engine_process_ends_when_the_server_is_killed():
    proc, url = start_serve("server.engine_core=process")
    pid = httpx.get(url + "/stats").json()["server"]["engine_pid"]
    assert _alive(pid)
    proc.kill()  # no drain, no atexit: only the closed command pipe tells the child
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.1)
