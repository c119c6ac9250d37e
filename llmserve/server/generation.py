"""One HTTP request's engine work: its streams (one per prompt), deadline, abort and disconnect watch."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence

from llmserve.engine_client import EngineClient
from llmserve.request import FinishReason, PoolingParams, RequestOutput, SamplingParams
from llmserve.server.errors import ApiError, bad_request, map_error


class ClientGone(Exception):
    """The client disconnected before the answer was ready; nothing is sent."""


class Generation:
    """Submits one engine request per prompt (an embedding each, given `pooling`) and yields their deltas as
    (prompt index, batch)."""

    def __init__(self, client: EngineClient, prompts: Sequence[list[int]], sp: SamplingParams, priority: int,
                 timeout: float | None, request_id: str, cache_salt: str | None = None,
                 pooling: PoolingParams | None = None, started: float | None = None):
        """timeout: seconds from `started` (the loop's clock; None: now) until the streams end with a 504."""
        self.client = client
        self.streams = []
        self._pending: dict[asyncio.Future, int] = {}  # several prompts: each stream's next read → its index
        self._timer = None
        try:
            for i, ids in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                self.streams.append(client.add_request(ids, copy.copy(sp), request_id=rid, priority=priority,
                                                   cache_salt=cache_salt, pooling=pooling))
        except Exception as e:  # the engine stopped after admission: no prompt of this request runs
            self.abort()
            raise map_error(e) from None
        if len(self.streams) > 1:
            self._pending = {asyncio.ensure_future(s.next_batch()): i for i, s in enumerate(self.streams)}
        if timeout:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at((loop.time() if started is None else started) + timeout, self._on_timeout,
                                       timeout)

    def _on_timeout(self, timeout: float) -> None:
        err = ApiError(504, f"the request did not finish within the server's request_timeout ({timeout:g} s)",
                       code="timeout")
        for s in self.streams:
            if not s.done:
                s.fail(err)
            self.client.abort(s.request_id)

    def abort(self) -> None:
        """Abort every stream that has not ended (idempotent); stop the deadline timer."""
        if self._timer is not None:
            self._timer.cancel()
        for t in self._pending:
            t.cancel()
        self._pending.clear()
        for s in self.streams:
            self.client.abort(s.request_id)

    async def next(self) -> tuple[int, list[RequestOutput]] | None:
        """The next batch of deltas of some prompt, or None when every stream has ended."""
        if len(self.streams) == 1:
            batch = await self.streams[0].next_batch()
            return (0, _checked(batch)) if batch else None
        while self._pending:
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            t = next(iter(done))
            i = self._pending.pop(t)
            batch = t.result()
            if batch:
                self._pending[asyncio.ensure_future(self.streams[i].next_batch())] = i
                return i, _checked(batch)
        return None


def _checked(batch: list[RequestOutput]) -> list[RequestOutput]:
    for o in batch:
        if o.finish_reason is FinishReason.ERROR:
            if o.error_param is not None:  # the request's own values were why: the client's error
                raise bad_request(o.error, o.error_param)
            if o.unavailable:  # the backend (a remote worker) could not be reached: a retry may succeed
                raise ApiError(503, o.error or "the model backend is unavailable", code="backend_unavailable",
                               headers={"Retry-After": "5"})
            raise ApiError(500, o.error or "the request failed in the engine", code="engine_error")
    return batch


async def wait_disconnect(receive) -> None:
    """Return when the client disconnects (the body has already been read)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


GONE = object()  # until_answered's result when the client left first


async def until_answered(receive, gen: Generation, coro, keep: bool = False):
    """coro's result while the client stays, or GONE when it left first (gen aborted); a failure is raised as the
    client's ApiError (gen aborted). gen is aborted once coro is done too, unless `keep` (a stream reads on)."""
    try:
        result = await guarded(receive, coro, gen.abort)
    except ClientGone:
        return GONE
    except Exception as e:
        gen.abort()
        raise map_error(e) from None
    if not keep:
        gen.abort()
    return result


async def guarded(receive, coro, on_gone):
    """Run coro; if the client disconnects first, call on_gone() and raise ClientGone."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        on_gone()
        raise ClientGone()
    finally:
        for t in (work, watch):
            if not t.done():
                t.cancel()
