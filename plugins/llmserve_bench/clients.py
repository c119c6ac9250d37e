"""The HTTP side of `bench serve`: streaming completions, C in flight, timed per token arrival."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any

import httpx

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


async def _one(client: httpx.AsyncClient, url: str, headers: dict, model: str | None, item: Item,
               ignore_eos: bool = True) -> Result:
    """One streamed completion over raw SSE."""
    body: dict[str, Any] = {"prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
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
    tokens = 0
    rest = b""
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            return Result(False, error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        # raw bytes, split into events here, and JSON parsed only for the usage and error
        # events: the client shares the machine with the server, so it should cost little
        async for data in r.aiter_raw():
            now = time.perf_counter()
            payloads, rest = _events(rest + data)
            for p in payloads:
                if p == b"[DONE]":
                    break
                if p.startswith(b'{"error"'):
                    err = json.loads(p)["error"]
                    return Result(False, error=err.get("message", "error event"))
                if b'"completion_tokens"' in p:  # a chunk carrying usage
                    chunk = json.loads(p)
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                    # no choices, or (as `transformers serve` sends it) a last choice with
                    # finish_reason and empty text: not a token arrival
                    if not any(c.get("text") for c in chunk.get("choices") or ()):
                        continue
                timing.token(now)
    return timing.result(time.perf_counter(), tokens)


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
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        if getattr(args, "client", "httpx") == "openai":
            import openai  # the dev extra; imported only when asked for

            sdk = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "unused",
                                     max_retries=0, http_client=http)
            one = lambda item: _one_openai(sdk, model, item, ignore_eos)  # noqa: E731
        else:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            url = base_url.rstrip("/") + "/v1/completions"
            one = lambda item: _one(http, url, headers, model, item, ignore_eos)  # noqa: E731

        async def worker():
            while queue:
                results.append(await one(queue.pop()))
                bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, len(items)))))
        elapsed = time.perf_counter() - t0
    bar.close()
    return results, elapsed
