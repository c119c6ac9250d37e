"""`llmserve serve --replicas 2` on a local Ray (num_cpus=2): the ingress, routing, faults, no leaked KV.

One Ray cluster for the module; two replicas of the fake backend (a small simulated step cost, so
streams last long enough to be interrupted) behind the server's own OpenAI app.
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'llmserve[ray]')")
serve = pytest.importorskip("ray.serve")

from llmserve.config import config_from_dict  # noqa: E402
from llmserve_ray.launch import APP_NAME, build_app  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

pytestmark = pytest.mark.slow

BLOCK = 16


def fleet_config(router: str) -> dict:
    return {"backend": {"name": "fake", "options": {"step_cost_s": 0.002}},
            "model": {"model": "embedded", "max_model_len": 1024},
            "cache": {"num_blocks": 256, "block_size": BLOCK},
            "distributed": {"replicas": 2, "router": router, "num_cpus": 0,
                            "options": {"stats_period_s": 0.2, "health_check_period_s": 1.0}}}


class Fleet:
    def __init__(self, url: str):
        self.url = url

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=kw.pop("timeout", 30))

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=30).json()

    def settled_stats(self, timeout: float = 15.0) -> dict:
        """/stats once the replicas' reports (every stats_period_s) have caught up: two reads in a row agree."""
        deadline = time.monotonic() + timeout
        time.sleep(0.3)
        last = self.stats()
        while time.monotonic() < deadline:
            time.sleep(0.3)
            s = self.stats()
            if s["cache"] == last["cache"] and s["running"] == 0 and s["waiting"] == 0:
                return s
            last = s
        return last

    def deploy(self, router: str) -> None:
        serve.run(build_app(config_from_dict(fleet_config(router))), name=APP_NAME, route_prefix="/")
        self.wait_replicas(2)

    def wait_replicas(self, n: int, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            healthy = [r for r in s["replicas"].values() if "error" not in r]
            if len(healthy) == n:
                return s
            assert time.monotonic() < deadline, f"{len(healthy)} of {n} replicas answer: {s['replicas']}"
            time.sleep(0.3)

    def wait_idle(self, timeout: float = 15.0) -> dict:
        """Until no replica runs, queues or holds a KV block; the last /stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            reps = s["replicas"].values()
            if all("error" not in r and r["running"] == 0 and r["waiting"] == 0 and r["cache"]["used_blocks"] == 0
                   for r in reps) and reps:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=APP_NAME)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    f = Fleet(f"http://127.0.0.1:{port}")
    f.deploy("prefix-aware")
    yield f
    serve.shutdown()
    ray.shutdown()


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 255) for _ in range(n)]


def test_openai_sdk_through_the_ingress(fleet):
    c = fleet.client()
    r = c.completions.create(model="embedded", prompt="Hello, fleet", max_tokens=6)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    chunks = list(c.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 5
    assert any(ch.choices and ch.choices[0].finish_reason == "length" for ch in chunks)
    # bad input is still the server's 400 naming the field, from the ingress
    bad = httpx.post(fleet.url + "/v1/completions", json={"model": "embedded", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert httpx.get(fleet.url + "/health").json() == {"status": "ok"}
    # an embedding crosses to a replica and back as a generation does
    e = [c.embeddings.create(model="embedded", input=x).data[0].embedding for x in ("a b", "c", "a b")]
    assert e[0] == e[2] != e[1] and len(e[0]) == 64
    # a request of several prompts is several concurrent replica calls, each routed (Serve indexes pending calls by
    # the internal request id they would share; the second waited forever)
    many = c.embeddings.create(model="embedded", input=["a b", "c", "a b"], timeout=15)
    assert [d.embedding for d in many.data] == e
    r = c.completions.create(model="embedded", prompt=["Hello, fleet", "another prompt", "a third"], max_tokens=4,
                             timeout=15)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 12
    assert all(ch.finish_reason == "length" for ch in r.choices)


def test_fleet_stats_and_metrics_per_replica(fleet):
    s = fleet.stats()
    assert len(s["replicas"]) == 2 and s["router"]["name"] == "prefix-aware"
    assert s["cache"]["num_blocks"] == 2 * 256, s["replicas"]  # summed over the replicas
    text = httpx.get(fleet.url + "/metrics", timeout=30).text
    for rid in s["replicas"]:
        assert f'replica="{rid}"' in text
    assert text.count("# TYPE llmserve_time_to_first_token_seconds histogram") == 1  # one family, both replicas
    assert "llmserve_router_requests_total" in text


def test_shared_prefix_lands_on_one_replica(fleet):
    rng = random.Random(1)
    prefix = ids(rng, 10 * BLOCK)
    before = {r: v["cache"]["prefix_queries"] for r, v in fleet.settled_stats()["replicas"].items()}
    c = fleet.client()
    cached = []
    for _ in range(6):
        r = c.completions.create(model="embedded", prompt=prefix + ids(rng, 8), max_tokens=2)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    after = {r: v["cache"]["prefix_queries"] for r, v in fleet.settled_stats()["replicas"].items()}
    moved = [r for r in after if after[r] != before.get(r, 0)]
    assert len(moved) == 1, f"shared-prefix requests went to {moved}"
    assert cached[0] == 0 and all(x == 10 * BLOCK for x in cached[1:]), cached


def _conversations(seed: int, fleet: Fleet) -> float:
    """Multi-turn chats (each turn's prompt extends the last), one after another; the fleet's prefix hit rate."""
    rng = random.Random(seed)
    before = fleet.settled_stats()["cache"]
    c = fleet.client()
    for _ in range(6):
        prompt = ids(rng, 4 * BLOCK)
        for _turn in range(3):
            prompt = prompt + ids(rng, 4 * BLOCK)
            c.completions.create(model="embedded", prompt=prompt, max_tokens=2)
    after = fleet.settled_stats()["cache"]
    return (after["prefix_hits"] - before["prefix_hits"]) / (after["prefix_queries"] - before["prefix_queries"])


def test_client_disconnect_frees_the_replica_blocks(fleet):
    with httpx.stream("POST", fleet.url + "/v1/completions", timeout=30,
                      json={"model": "embedded", "prompt": "x" * 100, "max_tokens": 900, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    s = fleet.wait_idle(timeout=5)  # a whole answer would take ~2 s of steps; the abort frees it at once
    assert all(v["running"] == 0 and v["cache"]["used_blocks"] == 0 for v in s["replicas"].values()), s["replicas"]


def test_replica_killed_mid_load_ends_streams_and_serving_goes_on(fleet):
    results: list[str] = []

    def client_stream(i: int):
        c = fleet.client(timeout=60)
        try:
            n = 0
            for _chunk in c.completions.create(model="embedded", prompt=f"request {i} " * 4, max_tokens=600,
                                               stream=True, extra_body={"ignore_eos": True}):
                n += 1
            results.append("done")
        except Exception as e:  # noqa: BLE001 - an error event (openai.APIError) is the expected ending
            results.append(f"error: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client_stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                  if "EngineReplica" in a["name"] and a["name"].startswith("SERVE_REPLICA"))
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client hung after its replica died"
    assert len(results) == 6
    errors = [r for r in results if r != "done"]
    assert errors and all("replica" in e for e in errors), results  # the killed replica's clients were told
    # the router stops choosing it, Serve replaces it, and new requests succeed
    c = fleet.client()
    deadline = time.monotonic() + 60
    while True:
        try:
            c.completions.create(model="embedded", prompt="after the fault", max_tokens=2)
            break
        except Exception:  # noqa: BLE001 - until Serve has noticed the dead replica
            assert time.monotonic() < deadline, "no request succeeded after a replica died"
            time.sleep(0.5)
    for i in range(6):
        assert c.completions.create(model="embedded", prompt=f"later {i}", max_tokens=2).usage.completion_tokens == 2
    fleet.wait_replicas(2, timeout=90)


def test_prefix_aware_hit_rate_is_at_least_twice_round_robin(fleet):
    pa = _conversations(7, fleet)
    fleet.deploy("round-robin")
    try:
        rr = _conversations(7, fleet)
    finally:
        fleet.deploy("prefix-aware")
    assert pa >= 2 * rr and pa > 0.4, (pa, rr)


def test_every_replica_ends_with_no_kv_blocks(fleet):
    s = fleet.wait_idle()
    assert len(s["replicas"]) == 2
    for rid, r in s["replicas"].items():
        assert r["cache"]["used_blocks"] == 0 and r["running"] == 0, (rid, r["cache"])
