"""One thread owns torch: the served engine is loaded and stepped on one thread, and breaking that shows."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx

from llmserve.async_engine import AsyncEngine
from llmserve.engine import Engine
from llmserve.request import SamplingParams
from llmserve.threads import ENGINE_THREAD_NAME
from tests.server.conftest import start_server

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = {"backend": {"kv_cache_memory": "16MiB"}, "model": {"model": "embedded", "max_model_len": 256}}


async def _run_requests(ae: AsyncEngine, n: int = 4) -> None:
    streams = [ae.add_request([1, 2, 3 + i], SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(n)]
    for s in streams:
        async for _ in s:
            pass


def test_the_server_loads_and_steps_the_torch_engine_on_its_engine_thread():
    s = start_server(EMBEDDED, build_engine=False)
    try:
        deadline = time.monotonic() + 60
        while httpx.get(s.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = s.client().completions.create(model="embedded", prompt="hello", max_tokens=8)
        assert r.usage.completion_tokens >= 1
        t = s.stats()["threads"]
        assert t == {"load_thread": ENGINE_THREAD_NAME, "step_threads": [ENGINE_THREAD_NAME], "one_thread": True}
        assert s.state.client.engine.threads.ident != threading.main_thread().ident
    finally:
        s.stop()


def test_the_guard_reports_an_engine_stepped_off_the_thread_that_built_it(caplog):
    eng = Engine.from_config({"backend": {"name": "fake"}, "tokenizer": {"name": "none"}})  # built here

    async def main():
        ae = AsyncEngine(eng)  # a built engine: stepped on the engine thread, not this one
        ae.start()
        try:
            await _run_requests(ae)
        finally:
            await ae.shutdown()

    with caplog.at_level(logging.WARNING, logger="llmserve.threads"):
        asyncio.run(main())
    layout = eng.threads.layout()
    assert layout["one_thread"] is False
    assert layout["load_thread"] == threading.current_thread().name
    assert layout["step_threads"] == [ENGINE_THREAD_NAME]
    warned = [r for r in caplog.records if "stepped on" in r.getMessage()]
    assert len(warned) == 1  # once, not once a step


def test_a_factory_builds_the_engine_on_the_thread_that_steps_it():
    async def main():
        ae = AsyncEngine(lambda: Engine.from_config({"backend": {"name": "fake"}, "tokenizer": {"name": "none"}}))
        ae.start()
        try:
            await asyncio.wrap_future(ae.built)
            await _run_requests(ae)
            return ae.engine.threads.layout()
        finally:
            await ae.shutdown()

    layout = asyncio.run(main())
    assert layout == {"load_thread": ENGINE_THREAD_NAME, "step_threads": [ENGINE_THREAD_NAME], "one_thread": True}


def test_a_factory_error_reaches_the_waiter():
    def broken():
        raise RuntimeError("no such model")

    ae = AsyncEngine(broken)
    ae.start()
    try:
        ae.wait_built(10)
        raise AssertionError("wait_built returned")
    except RuntimeError as e:
        assert "no such model" in str(e)
    assert not ae.running


_POOL_SCRIPT = textwrap.dedent("""
    import logging, sys, torch
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2)
    if sys.argv[1] == "main-ran-torch":
        torch.randn(1500, 1500) @ torch.randn(1500, 1500)  # a parallel region: the main thread's pool
    if sys.argv[1] == "library-threads":  # native threads a library started and named (a Ray worker's gRPC, io)
        import _thread, time
        from llmserve.threads import name_os_thread
        def named(i):
            name_os_thread(f"grpc_worker_{i}")
            time.sleep(600)
        for i in range(8):
            _thread.start_new_thread(named, (i,))  # (not a threading.Thread: native, as the library's are)
        time.sleep(0.5)
    from llmserve.async_engine import AsyncEngine
    from llmserve.engine import Engine
    ae = AsyncEngine(lambda: Engine.from_config({"backend": {"kv_cache_memory": "16MiB"},
                                                 "model": {"model": "embedded", "max_model_len": 128}}))
    ae.start()
    ae.wait_built(120)
    print("built")
""")


def _pool_run(mode: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    p = subprocess.run([sys.executable, "-c", _POOL_SCRIPT, mode], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0 and "built" in p.stdout, p.stderr
    return p.stderr


def test_start_up_warns_when_another_thread_already_has_an_openmp_pool():
    assert "holds an OpenMP pool" in _pool_run("main-ran-torch")
    assert "holds an OpenMP pool" not in _pool_run("clean")
    assert "holds an OpenMP pool" not in _pool_run("library-threads")
