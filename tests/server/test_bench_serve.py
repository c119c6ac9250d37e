"""`llmserve bench serve` against a live server, with the offline comparison, through the real CLI."""

from __future__ import annotations

import asyncio
import json

from llmserve.cli import main


def test_bench_serve_reports_latencies_throughput_and_the_offline_ratio(fake_server, capsys):
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--concurrency", "4", "--requests", "12",
               "--prompt-len", "8", "16", "--output-len", "6", "10", "--compare-offline", "--backend", "fake",
               "--rounds", "2", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    r = json.loads(out)
    for run in ("serve", "offline"):
        d = r[run]
        assert d["completed"] == 24 and d["failed"] == 0  # 12 requests × 2 rounds
        assert set(d["latency_ms"]) == {"ttft", "tpot", "itl", "e2e"}
        assert set(d["latency_ms"]["e2e"]) >= {"mean", "p50", "p90", "p99"}
        assert d["output_token_throughput"] > 0
    # the same seeded workload in both runs: max_tokens honoured exactly (EOS is ignored)
    assert r["serve"]["output_tokens"] == r["offline"]["output_tokens"]
    assert 6 * 24 <= r["serve"]["output_tokens"] <= 10 * 24
    assert [x["workload_seed"] for x in r["rounds"]] == [0, 1]
    assert all(x["ratio"] == x["serve_tok_s"] / x["offline_tok_s"] for x in r["rounds"])
    assert r["serve_over_offline"] == r["serve"]["output_token_throughput"] / r["offline"]["output_token_throughput"]
    assert r["server"]["model"] == "embedded" and r["workload"]["vocab_size"] == 257


def test_bench_serve_compares_with_a_torch_backend_offline(fake_server, capsys):
    """The offline side on the torch backend (whose shutdown drops its model): the report still names its threads."""
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--concurrency", "2", "--requests", "3",
               "--prompt-len", "4", "8", "--output-len", "3", "3", "--compare-offline", "--backend", "torch",
               "--model", "embedded", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and r["offline"]["completed"] == 3 and r["offline_threads"]["torch_threads"] >= 1


def test_bench_serve_counts_failures(fake_server, capsys):
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--concurrency", "2", "--requests", "3",
               "--request-model", "no-such-model", "--json", "--output-len", "4", "4"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 1 and r["serve"]["failed"] == 3
    assert any("404" in e for e in r["serve"]["errors"])


def test_bench_serve_text_prompts_without_ignore_eos_for_a_strict_peer(capsys, monkeypatch):
    """`transformers serve` takes only string prompts, rejects unknown fields (ignore_eos) with 422 and
    ends a stream with a choice of empty text carrying usage: that last chunk is not a token arrival."""
    import argparse

    import httpx

    from llmserve_bench.clients import run_http
    from llmserve_bench.serve import add_arguments
    from llmserve_bench.workload import make_workload

    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if not isinstance(body["prompt"], str) or "ignore_eos" in body:
            return httpx.Response(422, json={"detail": "Unexpected fields"})
        n = body["max_tokens"]
        events = ["data: " + json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": f" w{i}"}]})
                  + "\n\n" for i in range(n)]
        events.append("data: " + json.dumps({"object": "text_completion", "choices": [
            {"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}) + "\n\n")
        class Stream(httpx.AsyncByteStream):  # one network read per event, as a real server streams
            async def __aiter__(self):
                for e in events:
                    yield e.encode()

        return httpx.Response(200, stream=Stream(), headers={"content-type": "text/event-stream"})

    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient",
                        lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw))
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--concurrency", "2", "--requests", "4", "--prompt-len", "5", "9", "--output-len", "3", "6",
                         "--text-prompts", "--no-ignore-eos", "--no-progress"])
    assert args.concurrency == [2]
    args.concurrency = 2  # one point of the sweep: what main() sets before run_http
    args.client = "httpx"  # (the mock transport is httpx's)
    items = make_workload(args, 50257)
    assert all(isinstance(it.prompt, str) and 5 <= len(it.prompt.split()) <= 9 for it in items)
    assert items == make_workload(args, 50257)  # seeded
    results, _ = asyncio.run(run_http(args, "http://peer", items, "m"))
    assert all(r.ok for r in results), [r.error for r in results]
    assert sorted(r.output_tokens for r in results) == sorted(it.max_tokens for it in items)
    # one arrival per token: the usage chunk with empty text adds no inter-token latency
    assert sorted(len(r.itl) for r in results) == sorted(it.max_tokens - 1 for it in items)
    assert all("ignore_eos" not in b and isinstance(b["prompt"], str) for b in bodies)
    # the default still sends token ids and ignore_eos
    args = p.parse_args(["--requests", "2"])
    assert args.ignore_eos and all(isinstance(it.prompt, list) for it in make_workload(args, 257))


def test_bench_serve_resends_a_request_the_server_dropped_unanswered(monkeypatch):
    """A pooled keep-alive connection closed by the server as a request goes out on it (llama-server on a loaded
    machine) is answered by no server: the client sends it once more; a second such drop is a failure."""
    import argparse

    import httpx

    from llmserve_bench.clients import run_http
    from llmserve_bench.workload import Item

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content)["max_tokens"])
        if calls.count(calls[-1]) == 1 or calls[-1] == 3:  # every first try; max_tokens 3 always
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        n = calls[-1]
        events = "".join("data: " + json.dumps({"choices": [{"index": 0, "text": f" w{i}"}]}) + "\n\n"
                         for i in range(n))
        events += "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}) + "\n\ndata: [DONE]\n\n"

        class Stream(httpx.AsyncByteStream):
            async def __aiter__(self):
                yield events.encode()

        return httpx.Response(200, stream=Stream(), headers={"content-type": "text/event-stream"})

    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient",
                        lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw))
    args = argparse.Namespace(concurrency=1, timeout=10.0, no_progress=True, json=True, client="httpx",
                              ignore_eos=True)
    results, _ = asyncio.run(run_http(args, "http://peer", [Item([1, 2], 2), Item([1, 2], 3)], None))
    assert calls == [2, 2, 3, 3]
    assert [(r.ok, r.output_tokens) for r in results] == [(True, 2), (False, 0)]
    assert "without sending a response" in results[1].error


def test_the_raw_client_reads_chunked_streams_errors_and_resends_on_a_dropped_keep_alive():
    """The default client (llmserve_bench.raw_http) against a bare asyncio server: chunked SSE with one network write
    per event, a 404 with a Content-Length body, and a kept-alive connection the server closes after an answer (the
    next request on it is sent again on a new one); a connection that drops a fresh request is a failure."""
    import argparse

    from llmserve_bench.clients import run_http
    from llmserve_bench.workload import Item

    seen = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            body = json.loads(await reader.readexactly(length))
            n = body["max_tokens"]
            seen.append(n)
            if n == 7:  # drop every request for 7 unanswered
                writer.close()
                return
            if n == 404:
                msg = b'{"error": {"message": "no such model"}}'
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(msg), msg))
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            events = [b"data: " + json.dumps({"choices": [{"index": 0, "text": f" w{i}"}]}).encode() + b"\n\n"
                      for i in range(n)]
            events.append(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}).encode()
                          + b"\n\ndata: [DONE]\n\n")
            for e in events:
                writer.write(b"%x\r\n%s\r\n" % (len(e), e))
                await writer.drain()
                await asyncio.sleep(0.002)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            if n == 2:  # a keep-alive connection the server then closes: the next request on it goes out again
                writer.close()
                return

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        args = argparse.Namespace(concurrency=1, timeout=10.0, no_progress=True, json=True, client="raw",
                                  ignore_eos=True)
        items = [Item([1], 4), Item([1], 2), Item([1], 5), Item([1], 404), Item([1], 3), Item([1], 7)]
        async with server:
            return await run_http(args, f"http://127.0.0.1:{port}", items, None)

    results, _ = asyncio.run(main())
    assert [(r.ok, r.output_tokens) for r in results[:3]] == [(True, 4), (True, 2), (True, 5)]
    assert [len(r.itl) for r in results[:3]] == [3, 1, 4]  # one arrival per token event, none for the usage
    assert not results[3].ok and results[3].error.startswith("HTTP 404") and "no such model" in results[3].error
    assert results[4].ok and results[4].output_tokens == 3  # the connection after the 404 was reused
    assert not results[5].ok  # dropped on a reused connection, then on a new one: reported, not retried again
    assert seen == [4, 2, 5, 404, 3, 7, 7]
