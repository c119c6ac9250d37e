"""AsyncEngine: a step thread feeding asyncio streams; aborts, failures, idling and shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmserve.async_engine import AsyncEngine, EngineDeadError
from llmserve.engine import Engine
from llmserve.errors import InvalidRequestError
from llmserve.request import FinishReason, SamplingParams


def _engine(step_cost: float = 0.0) -> Engine:
    return Engine.from_config({"backend": {"name": "fake", "options": {"step_cost_s": step_cost}},
                               "cache": {"num_blocks": 256}, "tokenizer": {"name": "byte"}})


async def _collect(stream) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for o in stream:
        out.setdefault(o.index, []).extend(o.new_token_ids)
    return out


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_match_the_offline_engine():
    prompts = [[(i * 7 + j) % 250 for j in range(5 + i)] for i in range(16)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    reference = _engine().generate(prompts, sp)

    async def main():
        ae = AsyncEngine(_engine())
        ae.start()
        try:
            streams = [ae.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts]
            got = await asyncio.gather(*(_collect(s) for s in streams))
            # nothing is left behind: no stream, no engine-side bookkeeping
            assert ae.num_active == 0 and await ae.call(lambda e: ae.core.num_live) == 0
            return got
        finally:
            await ae.shutdown()

    got = run(main())
    assert [g[0] for g in got] == reference


def test_n_sequences_end_the_stream_only_when_all_finish():
    async def main():
        ae = AsyncEngine(_engine())
        ae.start()
        try:
            return await _collect(ae.add_request([1, 2, 3], SamplingParams(max_tokens=7, n=3, ignore_eos=True)))
        finally:
            await ae.shutdown()

    got = run(main())
    assert sorted(got) == [0, 1, 2] and all(len(v) == 7 for v in got.values())


def test_abort_frees_blocks_before_the_next_step():
    async def main():
        ae = AsyncEngine(_engine(step_cost=0.01))
        ae.start()
        try:
            s = ae.add_request(list(range(40)), SamplingParams(max_tokens=500, ignore_eos=True))
            await s.__anext__()
            used = await ae.call(lambda e: e.scheduler_stats().cache.used_blocks)
            assert used >= 3  # 40 prompt tokens in 16-token blocks
            ae.abort(s.request_id)
            # the call is queued behind the abort, so it runs after the abort and before any step
            used, running = await ae.call(lambda e: (e.scheduler_stats().cache.used_blocks, e.num_running))
            assert (used, running) == (0, 0)
            rest = [o async for o in s]  # the stream ends at once
            assert all(not o.finished for o in rest)
        finally:
            await ae.shutdown()

    run(main())


def test_the_event_loop_never_waits_on_a_step():
    async def main():
        ae = AsyncEngine(_engine(step_cost=0.5))  # a slow "forward pass"
        ae.start()
        try:
            s = ae.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
            task = asyncio.ensure_future(_collect(s))
            worst = 0.0
            while not task.done():
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                worst = max(worst, time.perf_counter() - t)
            return worst, task.result()
        finally:
            await ae.shutdown()

    worst, got = run(main())
    assert len(got[0]) == 2
    assert worst < 0.35  # a step on the loop would stall it for 0.5 s


def test_idle_thread_sleeps_instead_of_spinning():
    async def main():
        ae = AsyncEngine(_engine())
        ae.start()
        try:
            await _collect(ae.add_request([1, 2], SamplingParams(max_tokens=3)))
            steps = ae.num_steps
            cpu = time.process_time()
            await asyncio.sleep(0.5)
            return ae.num_steps - steps, time.process_time() - cpu
        finally:
            await ae.shutdown()

    extra_steps, cpu = run(main())
    assert extra_steps == 0 and cpu < 0.1


def test_engine_errors_fail_in_flight_requests_and_the_loop_survives():
    async def main():
        eng = _engine(step_cost=0.005)
        ae = AsyncEngine(eng)
        ae.start()
        try:
            s = ae.add_request([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
            await s.__anext__()
            real_step = eng.step

            def broken_step():
                eng.step = real_step
                raise RuntimeError("scheduler bug")

            eng.step = broken_step
            with pytest.raises(RuntimeError, match="scheduler bug"):
                await _collect(s)
            after = await _collect(ae.add_request([4, 5], SamplingParams(max_tokens=4, ignore_eos=True)))
            used = await ae.call(lambda e: e.scheduler_stats().cache.used_blocks)
            return after, used
        finally:
            await ae.shutdown()

    after, used = run(main())
    assert len(after[0]) == 4 and used == 0


def test_invalid_request_fails_only_its_stream():
    async def main():
        ae = AsyncEngine(_engine())
        ae.start()
        try:
            bad = ae.add_request([1, 999], SamplingParams(max_tokens=2))
            good = ae.add_request([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
            with pytest.raises(InvalidRequestError):
                await _collect(bad)
            return await _collect(good)
        finally:
            await ae.shutdown()

    assert len(run(main())[0]) == 2


def test_a_prompt_the_engine_refuses_fails_only_its_own_stream():
    async def main():
        ae = AsyncEngine(Engine.from_config({"backend": {"name": "fake"}, "model": {"max_model_len": 16},
                                             "tokenizer": {"name": "byte"}}))
        ae.start()
        try:
            good = ae.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
            with pytest.raises(InvalidRequestError, match="20 tokens") as e:
                [o async for o in ae.add_request(list(range(20)), SamplingParams(max_tokens=2))]
            return e.value, await _collect(good)
        finally:
            await ae.shutdown()

    err, good = run(main())
    assert err.code == "context_length_exceeded" and len(good[0]) == 2


def test_shutdown_drains_then_refuses():
    async def main():
        ae = AsyncEngine(_engine(step_cost=0.01))
        ae.start()
        s = ae.add_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
        task = asyncio.ensure_future(_collect(s))
        await asyncio.sleep(0.02)
        await ae.shutdown(drain_timeout=5.0)
        got = await task
        with pytest.raises(EngineDeadError):
            ae.add_request([1], SamplingParams(max_tokens=1))
        return got

    assert len(run(main())[0]) == 20
