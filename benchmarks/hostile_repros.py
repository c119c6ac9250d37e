"""Replays issue 12's hostile-input repros against a running server and prints what each got back.

    llmserve serve --config configs/default.yaml --port 8000 &
    python benchmarks/hostile_repros.py --base-url http://127.0.0.1:8000 [--json]

Each line: the repro, the HTTP status, and the error's code/param (or what was measured). Nothing
here asserts; tests/server (test_fuzz, test_transport, test_bounded_work, test_serve_process) do.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from urllib.parse import urlparse

import httpx


def summary(r: httpx.Response) -> dict:
    try:
        err = r.json().get("error")
    except ValueError:
        err = None
    if err:
        return {"status": r.status_code, "code": err.get("code"), "param": err.get("param"),
                "message": err.get("message", "")[:90]}
    return {"status": r.status_code}


def stream_gaps(base: str, stop: threading.Event, out: dict) -> None:
    """Stream a long completion; record its tokens/s and its longest gap between chunks."""
    body = {"prompt": "Tell me a long story.", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    gaps, n, t0, last = [], 0, None, None
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            now = time.perf_counter()
            if line.startswith("data: {"):
                n += 1
                if last is not None:
                    gaps.append(now - last)
                t0 = t0 or now
                last = now
            if stop.is_set():
                break
    out.update(chunks=n, tok_s=round(n / (last - t0), 1) if last and last > t0 else 0,
               max_gap_ms=round(max(gaps) * 1000, 1) if gaps else None)


def with_stream(base: str, work, seconds: float = 3.0) -> dict:
    """Run work() while a stream runs; the stream's figures for that window."""
    stop, out = threading.Event(), {}
    t = threading.Thread(target=stream_gaps, args=(base, stop, out))
    t.start()
    time.sleep(1.0)
    result = work()
    time.sleep(seconds)
    stop.set()
    t.join(60)
    return {"work": result, "stream": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    base = a.base_url.rstrip("/")
    c = httpx.Client(base_url=base, timeout=60)
    def post(path: str, text: str) -> dict:  # the body as written: JSON a client library would refuse to send
        return summary(c.post(path, content=text.encode("utf-8", "surrogatepass"),
                              headers={"content-type": "application/json"}))

    chat = '{"messages": [{"role": %s, "content": %s}], "max_tokens": 4}'
    results = {
        "1. 4,301-digit integer": post("/v1/completions", '{"prompt": "hi", "max_tokens": %s}' % ("1" * 4301)),
        "1. JSON nested 1,000 deep": post("/v1/completions", '{"prompt": ' + "[" * 1000 + "]" * 1000 + "}"),
        "1. 310-digit integer in temperature": post("/v1/completions", '{"prompt": "hi", "temperature": %s}' % ("9" * 310)),
        "1. role is a list": post("/v1/chat/completions", chat % ('["user"]', '"hi"')),
        "1. role is an object": post("/v1/chat/completions", chat % ('{"a": 1}', '"hi"')),
        "1. lone surrogate in a prompt": post("/v1/completions", '{"prompt": "ab\\ud800cd", "max_tokens": 4}'),
        "1. lone surrogate in a message": post("/v1/chat/completions", chat % ('"user"', '"ab\\ud800cd"')),
        "3. 5,000 prompts x n=128": post("/v1/completions", json.dumps({"prompt": ["ab"] * 5000, "n": 128,
                                                                          "max_tokens": 1})),
    }
    # 2: a sampler-breaking top_k beside an unrelated stream
    results["2. top_k 2^63 beside a stream"] = with_stream(base, lambda: post(
        "/v1/completions", '{"prompt": "hi", "top_k": 9223372036854775808, "temperature": 1}'), 1.0)
    # 4: headers
    u = urlparse(base)
    big = "x-big: " + "a" * (30 * 1024 * 1024) + "\r\n"
    with socket.create_connection((u.hostname, u.port)) as s:
        try:
            s.sendall(f"GET /health HTTP/1.1\r\nhost: t\r\n{big}\r\n".encode())
            results["4. a 30 MiB header"] = s.recv(200).split(b"\r\n")[0].decode()
        except ConnectionResetError:  # refused and closed before the rest was sent
            results["4. a 30 MiB header"] = "connection closed by the server before 30 MiB arrived"
    with socket.create_connection((u.hostname, u.port)) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\n")
        first = s.recv(300).split(b"\r\n")[0].decode()
        results["4. a half-sent header"] = f"{first} after {time.monotonic() - t0:.1f} s"
    # 6: big prompts and /stats pollers beside a stream
    huge = json.dumps({"prompt": list(range(1, 550_000)), "max_tokens": 1})  # ~3.8 MB

    def four_huge():
        got = []
        ts = [threading.Thread(target=lambda: got.append(summary(httpx.post(
            base + "/v1/completions", content=huge, headers={"content-type": "application/json"}, timeout=60))))
            for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return {"MB": round(len(huge) / 1e6, 1), "statuses": sorted(g["status"] for g in got)}

    results["6. a stream alone"] = with_stream(base, lambda: None)
    results["6. four 3.8 MB prompts beside a stream"] = with_stream(base, four_huge)
    stop = threading.Event()

    def pollers():
        def poll():
            with httpx.Client(base_url=base) as p:
                while not stop.is_set():
                    p.get("/stats")
                    p.get("/metrics")
        for _ in range(8):
            threading.Thread(target=poll, daemon=True).start()
        return "8 clients polling /stats and /metrics"

    results["6. eight /stats + /metrics pollers beside a stream"] = with_stream(base, pollers)
    stop.set()
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        for k, v in results.items():
            print(f"{k:52s} {v}")
    os._exit(0)


if __name__ == "__main__":
    main()
