"""Issue 36's checks against a running server: a streaming request beside an idle-and-half-head flood, then a burst.

    llmserve serve --config configs/fake.yaml --port 8000 &
    python benchmarks/connection_flood.py --base-url http://127.0.0.1:8000 [--json]

1. Flood: times a streaming request on the idle server, then holds --idle silent connections and
   --half half-sent request heads open from another process (reopening each one the server
   closes, as an attacker would) for --header-timeout + 4 s while it times the same request
   again; prints both medians, their ratio, and how long the server let each half-sent head live.
2. Burst: --burst simultaneous streaming requests with httpx; counts each status (and Retry-After),
   the transport errors, and reads /stats once the server is idle again.
The client needs an open file per socket: it raises its own soft limit to the hard one (`ulimit -Hn`).
Nothing here asserts; tests/server/test_connections.py does, at a small scale.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import resource
import selectors
import socket
import statistics
import time
from urllib.parse import urlparse

import httpx

HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"


def stream_seconds(base: str, body: dict) -> float:
    """One streaming completion on a new connection: seconds until data: [DONE] (raises unless 200)."""
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        last = [ln for ln in r.iter_lines() if ln.startswith("data: ")][-1]
    assert last == "data: [DONE]", last
    return time.perf_counter() - t0


class Attacker:
    """Holds idle silent connections and half half-sent heads open, reopening each one the server closes."""

    def __init__(self, addr: tuple[str, int], idle: int, half: int):
        self.addr, self.want = addr, {"idle": idle, "half": half}
        self.sel = selectors.DefaultSelector()
        self.lived: dict[str, list[float]] = {"idle": [], "half": []}  # seconds from connect / head to the close
        self.answers: collections.Counter[str] = collections.Counter()  # "half 408", "idle (none)", …
        self.connect_failures = 0

    def open(self, kind: str) -> None:
        try:
            s = socket.create_connection(self.addr, timeout=5)
            if kind == "half":
                s.sendall(HALF_HEAD)
        except OSError:
            self.connect_failures += 1
            return
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ, [kind, time.monotonic(), b""])

    def top_up(self) -> None:
        held = collections.Counter(k.data[0] for k in self.sel.get_map().values())
        for kind, n in self.want.items():
            for _ in range(n - held[kind]):
                self.open(kind)

    def hold(self, until: float) -> None:
        """Read what the server sends, note each close, reopen, until the monotonic time until."""
        while time.monotonic() < until:
            for key, _ in self.sel.select(timeout=0.2):
                kind, t0, got = key.data
                try:
                    data = key.fileobj.recv(4096)
                except OSError:
                    data = b""
                if data:
                    key.data[2] = got + data
                    continue
                self.lived[kind].append(time.monotonic() - t0)
                self.answers[f"{kind} {got.split(b' ', 2)[1].decode() if got else '(none)'}"] += 1
                self.sel.unregister(key.fileobj)
                key.fileobj.close()
            self.top_up()


def attack(addr: tuple[str, int], idle: int, half: int, seconds: float, pipe) -> None:
    """The attacker's process (so that its loop takes no GIL from the timed client): open, report, hold, report."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    a = Attacker(addr, idle, half)
    t0 = time.monotonic()
    a.top_up()
    pipe.send({"opened_in_s": round(time.monotonic() - t0, 2), "held": len(a.sel.get_map())})
    a.hold(t0 + seconds)
    pipe.send({"held_at_end": len(a.sel.get_map()), "connect_failures": a.connect_failures,
               "lived": a.lived, "answers": dict(sorted(a.answers.items()))})
    for key in list(a.sel.get_map().values()):
        key.fileobj.close()


def flood(base: str, a) -> dict:
    """A streaming request's latency alone, then beside the flood; what the flood's connections lived."""
    body = {"prompt": "Tell me a story.", "max_tokens": a.max_tokens, "stream": True, "ignore_eos": True}
    alone = [stream_seconds(base, body) for _ in range(a.repeats)]
    u = urlparse(base)
    here, there = multiprocessing.Pipe()
    seconds = a.header_timeout + 4  # every half-sent head is cut while the flood lasts
    proc = multiprocessing.Process(target=attack, args=((u.hostname, u.port), a.idle, a.half, seconds, there))
    proc.start()
    opened = here.recv()
    time.sleep(1.0)
    beside, failed = [], []
    end = time.monotonic() + seconds - 2.5
    while time.monotonic() < end or len(beside) < a.repeats:
        try:
            beside.append(stream_seconds(base, body))
        except (httpx.HTTPError, AssertionError) as e:
            failed.append(f"{type(e).__name__}: {e}"[:120])
        time.sleep(0.5)
    held = here.recv()
    proc.join(30)
    half_lived = held["lived"]["half"]
    return {
        "idle_connections": a.idle, "half_heads": a.half, "opened_in_s": opened["opened_in_s"],
        "held_when_measuring": opened["held"], "held_at_end": held["held_at_end"],
        "connect_failures": held["connect_failures"],
        "stream_alone_s": {"median": round(statistics.median(alone), 4), "max": round(max(alone), 4)},
        "stream_beside_flood_s": {"median": round(statistics.median(beside), 4), "max": round(max(beside), 4),
                                  "n": len(beside), "failed": len(failed), "failures": failed[:3]},
        "latency_ratio_median": round(statistics.median(beside) / statistics.median(alone), 2),
        "latency_ratio_max": round(max(beside) / statistics.median(alone), 2),
        "half_heads_closed": len(half_lived),
        "half_head_lived_s": {"min": round(min(half_lived), 2), "max": round(max(half_lived), 2)} if half_lived
        else None,
        "closed_with": held["answers"],
    }


def burst(base: str, n: int, max_tokens: int) -> dict:
    """n simultaneous streaming requests: each one's status (and Retry-After) or its transport error."""
    body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}

    async def run():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            async def one():
                try:
                    async with client.stream("POST", base + "/v1/completions", json=body) as r:
                        text = (await r.aread()).decode()
                    if r.status_code == 200:
                        return "200" if text.rstrip().endswith("data: [DONE]") else "200 without [DONE]"
                    code = json.loads(text)["error"]["code"]
                    return f"{r.status_code} {code} retry-after={r.headers.get('retry-after')}"
                except httpx.TransportError as e:
                    return f"transport error {type(e).__name__}"

            t0 = time.perf_counter()
            got = await asyncio.gather(*[one() for _ in range(n)])
            return got, time.perf_counter() - t0

    got, took = asyncio.run(run())
    deadline = time.monotonic() + 30
    while True:
        s = httpx.get(base + "/stats", timeout=10).json()
        idle = s["running"] == 0 and s["waiting"] == 0 and s["server"]["active_requests"] == 0
        if (idle and s["cache"]["used_blocks"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {"requests": n, "seconds": round(took, 2), "outcomes": dict(collections.Counter(got).most_common()),
            "transport_errors": sum(g.startswith("transport error") for g in got),
            "after": {"running": s["running"], "waiting": s["waiting"], "used_kv_blocks": s["cache"]["used_blocks"],
                      "active_requests": s["server"]["active_requests"], "connections": s["server"].get("connections")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--idle", type=int, default=1100)
    ap.add_argument("--half", type=int, default=150)
    ap.add_argument("--burst", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7, help="streaming requests timed alone (at least as many beside)")
    ap.add_argument("--header-timeout", type=float, default=10.0, help="the server's server.header_timeout")
    ap.add_argument("--skip", choices=["flood", "burst"], action="append", default=[])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket each, and the burst's too
    base = a.base_url.rstrip("/")
    before = httpx.get(base + "/stats", timeout=10).json()["server"].get("connections") or {}  # {}: an older server
    out = {"server_connections_before": before}
    if "flood" not in a.skip:
        out["flood"] = flood(base, a)
    if "burst" not in a.skip:
        out["burst"] = burst(base, a.burst, a.max_tokens)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"server: max_connections {before.get('limit', '(not reported)')}")
    if "flood" in out:
        f = out["flood"]
        alone, beside = f["stream_alone_s"], f["stream_beside_flood_s"]
        print(f"flood: {f['idle_connections']} idle + {f['half_heads']} half-sent heads "
              f"(held {f['held_when_measuring']} when measuring); stream alone median {alone['median']} s, "
              f"beside the flood {beside['median']} s (max {beside['max']}, {beside['failed']} failed): "
              f"{f['latency_ratio_median']}x, slowest {f['latency_ratio_max']}x")
        print(f"       half-sent heads closed: {f['half_heads_closed']}, lived {f['half_head_lived_s']} s; "
              f"answers {f['closed_with']}")
    if "burst" in out:
        b = out["burst"]
        print(f"burst: {b['requests']} requests in {b['seconds']} s: {b['outcomes']}; "
              f"transport errors {b['transport_errors']}")
        print(f"       after: {b['after']}")


if __name__ == "__main__":
    main()
