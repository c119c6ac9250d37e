"""GET /stats/stream: the dashboard's feed, one server-sent event a second, made from the cached /stats body.

Every frame comes from ServerState.stats_snapshot() (recomputed at most every 100 ms however many
dashboards are open), and the rates are differences between two snapshots of running totals, so a
stream costs the engine nothing per token.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from llmserve.server.errors import ApiError, bad_request

_QUANTILES = ("p50", "p90", "p99")


def _rate(now: dict, then: dict | None, key: str, per: float) -> float | None:
    return None if then is None or per <= 0 else (now[key] - then[key]) / per


def frame(snap: dict[str, Any], prev: dict[str, Any] | None, dt: float) -> dict[str, Any]:
    """One dashboard frame: gauges from snap, rates over the dt seconds since prev (None in the first frame)."""
    m, c = snap["metrics"], snap["cache"]
    tok, old = m["step_tokens"], prev["metrics"]["step_tokens"] if prev else None
    steps = m["steps"] - prev["metrics"]["steps"] if prev else 0
    lat = m["latency_seconds"]
    return {
        "model": snap["model"],
        "ready": snap["server"]["ready"],
        "draining": snap["server"]["draining"],
        "running": snap["running"],
        "waiting": snap["waiting"],
        "max_num_seqs": snap["scheduler"]["max_num_seqs"],
        "active_requests": snap["server"]["active_requests"],
        "kv_usage": c["usage"],
        "kv_used_blocks": c["used_blocks"],
        "kv_num_blocks": c["num_blocks"],
        "prefix_caching": c["prefix_caching"],
        "prefix_hit_rate": m["prefix_cache_hit_rate"],  # since start
        "output_tok_s": _rate(tok, old, "output", dt),
        "prefill_tok_s": _rate(tok, old, "prefill", dt),
        "decode_tok_s": _rate(tok, old, "decode", dt),
        "steps_per_s": steps / dt if prev and dt > 0 else None,
        "prefill_per_step": _rate(tok, old, "prefill", steps),  # tokens per step over the interval
        "decode_per_step": _rate(tok, old, "decode", steps),
        "preemptions": m["preemptions"],
        "requests_finished": sum(m["requests_finished"].values()),
        "output_tokens": tok["output"],
        "steps": m["steps"],
        **{k: {q: lat[k][q] for q in _QUANTILES} for k in ("ttft", "itl", "e2e")},
    }


def _interval(request) -> float:
    raw = request.query_params.get("interval", "1")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.1 <= value <= 60:  # also refuses nan
        raise bad_request(f"interval must be a number of seconds from 0.1 to 60, got {raw!r}", "interval")
    return value


async def stats_stream(request):
    """GET /stats/stream[?interval=seconds]: a dashboard frame as an SSE `data:` line every interval (1 s)."""
    from sse_starlette import EventSourceResponse

    st = request.app.state.llm
    interval = _interval(request)
    if st.model is None:
        raise ApiError(503, "the engine is not ready", code="not_ready")

    async def frames():
        prev, t_prev = None, 0.0
        while not st.draining:  # a draining server ends the stream, so it never holds the shutdown up
            snap, t = await st.stats_snapshot(), time.monotonic()
            yield {"data": json.dumps(frame(snap, prev, t - t_prev), separators=(",", ":"))}
            prev, t_prev = snap, t
            end = t + interval
            while not st.draining and (left := end - time.monotonic()) > 0:  # wakes for a drain within 0.25 s
                await asyncio.sleep(min(left, 0.25))

    return EventSourceResponse(frames(), ping=15, headers={"Cache-Control": "no-cache"})
