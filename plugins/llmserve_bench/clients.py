"""The HTTP side of `bench serve`: streaming completions, C in flight, timed per token arrival."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any

import httpx

from llmserve_bench.raw_http import RawConnection
from llmserve_bench.report import Result, Timing, progress_bar
from llmserve_bench.workload import Item

log = logging.getLogger("llmserve.bench")


def _events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events' data payloads in buf, and the unfinished rest."""
    if b"\r" in buf:
        buf = buf.replace(b"\r\n", b"\n")
    out = []
    while True:
        i = buf.find(b"\n\n")
        if i < 0:
            return out, buf
        ev, buf = buf[:i], buf[i + 2:]
        for line in ev.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].lstrip())


def run_client(coro):
    """Run a client coroutine to its end on uvloop where installed (uvicorn[standard] brings it): its C event loop
    costs the client less per SSE event than asyncio's, CPU the measured server would otherwise lose."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def completion_body(item: Item, model: str | None, ignore_eos: bool) -> dict[str, Any]:
    """One streamed, greedy completion request for item."""
    body: dict[str, Any] = {"prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    return body


class _Arrivals:
    """A streamed completion's SSE bytes read into token arrivals: raw bytes, split into events here, and JSON parsed
    only for the usage and error events (the client shares the machine with the server, so it should cost little)."""

    def __init__(self, timing: Timing):
        self.timing, self.rest, self.tokens = timing, b"", 0
        self.error: str | None = None

    def feed(self, data: bytes, now: float) -> bool:
        """Bytes that arrived at `now`; False once the stream is over ([DONE] or an error event)."""
        payloads, self.rest = _events(self.rest + data)
        for p in payloads:
            if p == b"[DONE]":
                return False
            if p.startswith(b'{"error"'):
                self.error = json.loads(p)["error"].get("message", "error event")
                return False
            if b'"completion_tokens"' in p:  # a chunk carrying usage
                chunk = json.loads(p)
                self.tokens = (chunk.get("usage") or {}).get("completion_tokens", self.tokens)
                # no choices, or (as `transformers serve` sends it) a last choice with
                # finish_reason and empty text: not a token arrival
                if not any(c.get("text") for c in chunk.get("choices") or ()):
                    continue
            self.timing.token(now)
        return True

    def result(self) -> Result:
        """The request's Result, now that its stream ended."""
        if self.error is not None:
            return Result(False, error=self.error)
        return self.timing.result(time.perf_counter(), self.tokens)


async def stream_raw(conn: RawConnection, headers: dict, body: dict[str, Any], timeout: float) -> Result:
    """One streamed completion on the worker's own connection (raw_http: the lightest client)."""
    arrivals = _Arrivals(Timing(time.perf_counter()))
    try:
        async with asyncio.timeout(timeout):
            status, error_body = await conn.post("/v1/completions", json.dumps(body).encode(), headers,
                                                 arrivals.feed)
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        conn.close()  # (whatever it was in the middle of is unreadable now)
        return Result(False, error=f"{type(e).__name__}: {e}")
    if status != 200:
        return Result(False, error=f"HTTP {status}: {error_body.decode(errors='replace')[:200]}")
    return arrivals.result()


async def _one(client: httpx.AsyncClient, url: str, headers: dict, body: dict[str, Any]) -> Result:
    """One streamed completion through httpx."""
    for attempt in range(2):
        timing = Timing(time.perf_counter())
        try:
            return await _stream(client, url, headers, body, timing)
        except httpx.RemoteProtocolError as e:
            # the server closed a pooled keep-alive connection as the request went out on it (seen with
            # llama-server on a loaded machine): nothing reached the server, so send it once more on a new one
            if attempt == 0 and "without sending a response" in str(e):
                log.warning("%s dropped a request unanswered (%s); sending it again", url, e)
                continue
            return Result(False, error=f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported
            return Result(False, error=f"{type(e).__name__}: {e}")
    raise AssertionError("unreachable")


async def _stream(client: httpx.AsyncClient, url: str, headers: dict, body: dict[str, Any], timing: Timing) -> Result:
    """Send one streamed completion and time its token arrivals; transport errors propagate."""
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            return Result(False, error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        arrivals = _Arrivals(timing)
        async for data in r.aiter_raw():
            if not arrivals.feed(data, time.perf_counter()):
                break
    return arrivals.result()


async def _one_openai(client, model: str | None, item: Item, ignore_eos: bool = True) -> Result:
    """One streamed completion through the official SDK; the same timings as _one."""
    timing = Timing(time.perf_counter())
    tokens = 0
    try:
        stream = await client.completions.create(
            model=model or "default", prompt=item.prompt, max_tokens=item.max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if ignore_eos else None)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
                if not any(c.text for c in chunk.choices):
                    continue  # the usage chunk: not a token arrival (as in _one)
            if chunk.choices:
                timing.token(now)
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        return Result(False, error=f"{type(e).__name__}: {e}")
    return timing.result(time.perf_counter(), tokens)


async def run_http(args: argparse.Namespace, base_url: str, items: list[Item], model: str | None,
                   api_key: str | None = None) -> tuple[list[Result], float]:
    """Stream every item through the server with args.concurrency clients in flight."""
    ignore_eos = getattr(args, "ignore_eos", True)
    bar = progress_bar(args, len(items), "bench serve")
    results: list[Result] = []
    queue = list(reversed(items))
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = getattr(args, "client", "raw")
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        if client == "openai":
            import openai  # the dev extra; imported only when asked for

            sdk = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "unused",
                                     max_retries=0, http_client=http)

        async def worker():
            conn = RawConnection(base_url) if client == "raw" else None
            try:
                while queue:
                    item = queue.pop()
                    if client == "openai":
                        results.append(await _one_openai(sdk, model, item, ignore_eos))
                    elif conn is not None:
                        body = completion_body(item, model, ignore_eos)
                        results.append(await stream_raw(conn, headers, body, args.timeout))
                    else:
                        results.append(await _one(http, base_url.rstrip("/") + "/v1/completions", headers,
                                                  completion_body(item, model, ignore_eos)))
                    bar.update(1)
            finally:
                if conn is not None:
                    conn.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, len(items)))))
        elapsed = time.perf_counter() - t0
    bar.close()
    return results, elapsed
