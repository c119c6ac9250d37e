"""EngineLoop with an outbox of a test's own: what any engine client composes (the thread, the pipe) gets every
output, each refusal and each failed step's requests through the Outbox protocol alone."""

from __future__ import annotations

import threading

import pytest

from llmserve.engine import Engine
from llmserve.engine_loop import EngineLoop
from llmserve.errors import InvalidRequestError
from llmserve.request import SamplingParams


class Recorder:
    """An Outbox that keeps what the loop hands it, and wakes a waiter when a request ends."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.failed: dict[str, BaseException] = {}
        self.idles = 0
        self.ended = threading.Condition()

    def deliver(self, outputs) -> None:
        for o in outputs:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                with self.ended:
                    self.ended.notify_all()

    def fail(self, request_id, exc) -> None:
        self.failed[request_id] = exc
        with self.ended:
            self.ended.notify_all()

    def fail_all(self, exc) -> None:
        raise AssertionError(f"the loop died: {exc}")

    def idle(self) -> None:
        self.idles += 1


def _loop(step_cost: float = 0.0) -> tuple[EngineLoop, Recorder]:
    out = Recorder()
    loop = EngineLoop(lambda: Engine.from_config({"backend": {"name": "fake", "options": {"step_cost_s": step_cost}},
                                                  "cache": {"num_blocks": 64}, "tokenizer": {"name": "byte"}}), out)
    loop.start_thread()
    loop.built.result(60)
    return loop, out


def test_outputs_refusals_and_calls_cross_the_outbox_and_stop_ends_the_loop():
    loop, out = _loop()
    try:
        loop.add("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
        loop.add("bad", [1, 999], SamplingParams(max_tokens=2))  # a byte vocabulary has no token 999
        assert loop.call(lambda e: e.num_waiting + e.num_running).result(10) >= 0
        with out.ended:
            assert out.ended.wait_for(lambda: len(out.tokens.get("a", [])) == 6 and "bad" in out.failed, 10)
        assert isinstance(out.failed["bad"], InvalidRequestError)
        assert loop.call(lambda e: loop.num_live).result(10) == 0  # "a" finished: nothing left to recover
        assert loop.seqs_added == 2 and loop.num_steps >= 6 and out.idles >= 1 and loop.running
    finally:
        loop.stop()
        loop.join(10)
    assert not loop.running and loop.stopped


def test_a_failed_step_fails_its_requests_through_the_outbox_and_the_loop_serves_on():
    loop, out = _loop(step_cost=0.005)
    try:
        loop.add("a", [1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
        eng = loop.call(lambda e: e).result(10)
        real_step = eng.step

        def broken_step():
            eng.step = real_step
            raise RuntimeError("scheduler bug")

        loop.call(lambda e: setattr(e, "step", broken_step)).result(10)
        with out.ended:
            assert out.ended.wait_for(lambda: "a" in out.failed, 10)
        assert "scheduler bug" in str(out.failed["a"])
        loop.add("b", [4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
        with out.ended:
            assert out.ended.wait_for(lambda: len(out.tokens.get("b", [])) == 4, 10)
        assert loop.call(lambda e: e.scheduler_stats().cache.used_blocks).result(10) == 0
    finally:
        loop.stop()
        loop.join(10)


def test_a_factory_that_raises_resolves_built_with_its_error():
    loop = EngineLoop(lambda: (_ for _ in ()).throw(ValueError("no model")), Recorder())
    loop.start_thread()
    with pytest.raises(ValueError, match="no model"):
        loop.built.result(10)
    loop.join(10)
    assert loop.stopped and not loop.running and isinstance(loop.dead, ValueError)
