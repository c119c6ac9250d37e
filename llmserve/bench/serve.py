"""`llmserve bench serve`: streaming clients against an OpenAI-compatible server.

C clients stream N seeded synthetic completions (token-id prompts, greedy, EOS ignored) from
--base-url and report TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99), request and
output-token throughput, and failures. --launch starts `llmserve serve` with the given config
flags on a free port first; --compare-offline then runs the same workload through an Engine
built from the same config, in this process and without HTTP, with the same C in flight, and
prints the ratio of the two output-token throughputs (the HTTP + SSE overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.metrics import percentile


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Target, workload and output flags (plus the config flags used by --launch / --compare-offline)."""
    from llmserve.cli import add_config_arguments

    p.add_argument("--base-url", default=None,
                   help="server root, e.g. http://127.0.0.1:8000 (default: that, or the --launch'ed server)")
    p.add_argument("--launch", action="store_true",
                   help="start `llmserve serve` with the config flags below on a free port, stop it after")
    p.add_argument("--request-model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--concurrency", type=int, default=64, help="streaming clients in flight")
    p.add_argument("--requests", type=int, default=256, help="number of requests")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"),
                   help="prompt lengths in tokens, uniform in [MIN, MAX]")
    p.add_argument("--output-len", type=int, nargs=2, default=[128, 128], metavar=("MIN", "MAX"),
                   help="max_tokens (EOS ignored), uniform in [MIN, MAX]")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="every prompt starts with the same TOKENS-token prefix")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the synthetic workload")
    p.add_argument("--text-prompts", action="store_true",
                   help="send prompts as text (--prompt-len words from a fixed list) instead of token ids, for "
                        "servers that take only strings (e.g. `transformers serve`); not with --compare-offline")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send the non-OpenAI `ignore_eos` field (servers that reject unknown fields); "
                        "check output_tokens to see whether EOS ended requests early")
    p.add_argument("--client", choices=["httpx", "openai"], default="httpx",
                   help="httpx: a light raw-SSE client (the default: it leaves the cores to the server); "
                        "openai: the official SDK's AsyncOpenAI, as applications stream")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt token ids below this (default: the server's vocabulary from /stats)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout (s)")
    p.add_argument("--compare-offline", action="store_true",
                   help="also run the workload through an Engine built from the config flags, no HTTP")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the workload (seed+k in round k), alternating HTTP and offline runs, so noise "
                        "from a shared machine hits both sides alike")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # the config flags describe the engine for --launch and --compare-offline; --api-key is also
    # the Bearer token the clients send (default: env LLMSERVE_API_KEY)
    add_config_arguments(p)


def _api_key(args: argparse.Namespace) -> str | None:
    return getattr(args, "cfg_server__api_key", None) or os.environ.get("LLMSERVE_API_KEY")


@dataclass(slots=True)
class Item:
    prompt: list[int] | str
    max_tokens: int


_WORDS = ("the of and to in is that for it as with was on be by at this from or have an are not but all "
          "they which one you were her there been has their if will more when would about into time than two "
          "other could only many then first some these people state may like after over such years").split()


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Item]:
    """The seeded synthetic requests (identical for the HTTP and the offline run)."""
    rng = random.Random(args.workload_seed)
    if getattr(args, "text_prompts", False):  # words, so any tokenizer gets the same text
        prefix = " ".join(rng.choice(_WORDS) for _ in range(args.shared_prefix))
        items = []
        for _ in range(args.requests):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(*args.prompt_len))]
            items.append(Item(" ".join(filter(None, [prefix, *words])), rng.randint(*args.output_len)))
        return items
    top = min(vocab_size, 50000) - 1
    prefix = [rng.randint(0, top) for _ in range(args.shared_prefix)]
    return [Item(prefix + [rng.randint(0, top) for _ in range(rng.randint(*args.prompt_len))],
                 rng.randint(*args.output_len)) for _ in range(args.requests)]


@dataclass(slots=True)
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _stats(values: list[float]) -> dict[str, float | None]:
    s = sorted(values)
    return {"mean": (sum(s) / len(s)) if s else None, "p50": percentile(s, 50), "p90": percentile(s, 90),
            "p99": percentile(s, 99), "count": len(s)}


def summarize_results(results: list[Result], elapsed: float) -> dict[str, Any]:
    """Latency percentiles (ms) and throughputs of a run."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    ms = lambda d: {k: (v * 1e3 if isinstance(v, float) else v) for k, v in d.items()}  # noqa: E731
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:160]] = errors.get(r.error[:160], 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors, "elapsed_s": elapsed,
        "request_throughput": len(ok) / elapsed if elapsed else 0.0,
        "output_token_throughput": out_tokens / elapsed if elapsed else 0.0,
        "output_tokens": out_tokens,
        "latency_ms": {"ttft": ms(_stats([r.ttft for r in ok])), "tpot": ms(_stats(tpot)),
                       "itl": ms(_stats([x for r in ok for x in r.itl])), "e2e": ms(_stats([r.e2e for r in ok]))},
    }


# --- the HTTP run -------------------------------------------------------------------------------


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


async def _one(client, url: str, headers: dict, model: str | None, item: Item, ignore_eos: bool = True) -> Result:
    body: dict[str, Any] = {"prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first = last = None
    itl: list[float] = []
    tokens = 0
    rest = b""
    try:
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
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        return Result(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if first is None:
        return Result(False, error="the stream carried no tokens")
    return Result(True, ttft=first - t0, e2e=end - t0, output_tokens=tokens, itl=itl)


async def _one_openai(client, model: str | None, item: Item, ignore_eos: bool = True) -> Result:
    """One streamed completion through the official SDK; the same timings as _one."""
    t0 = time.perf_counter()
    first = last = None
    itl: list[float] = []
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
            if not chunk.choices:
                continue
            if first is None:
                first = now
            else:
                itl.append(now - last)
            last = now
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        return Result(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if first is None:
        return Result(False, error="the stream carried no tokens")
    return Result(True, ttft=first - t0, e2e=end - t0, output_tokens=tokens, itl=itl)


async def run_http(args: argparse.Namespace, base_url: str, items: list[Item],
                   model: str | None) -> tuple[list[Result], float]:
    """Stream every item through the server with args.concurrency clients in flight."""
    import httpx

    key = _api_key(args)
    ignore_eos = getattr(args, "ignore_eos", True)
    bar = _bar(args, len(items), "bench serve")
    results: list[Result] = []
    queue = list(reversed(items))
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        if getattr(args, "client", "httpx") == "openai":
            import openai

            sdk = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=key or "unused",
                                     max_retries=0, http_client=http)
            one = lambda item: _one_openai(sdk, model, item, ignore_eos)  # noqa: E731
        else:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            url = base_url.rstrip("/") + "/v1/completions"
            one = lambda item: _one(http, url, headers, model, item, ignore_eos)  # noqa: E731

        async def worker():
            while queue:
                res = await one(queue.pop())
                results.append(res)
                if bar is not None:
                    bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, len(items)))))
        elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return results, elapsed


# --- the offline run ----------------------------------------------------------------------------


def run_offline(args: argparse.Namespace, engine, items: list[Item]) -> tuple[list[Result], float]:
    """The same items through `engine` on this thread, args.concurrency in flight, no HTTP.

    Call it on the thread that built `engine`, exactly as `bench offline` and the server's engine
    thread do: stepping a torch engine from any other thread runs at ~0.6x (llmserve/threads.py),
    which made earlier serve/offline ratios compare two slowed paths.
    """
    from llmserve.request import SamplingParams

    bar = _bar(args, len(items), "offline")
    results: list[Result] = []
    live: dict[str, dict[str, Any]] = {}
    queue = list(reversed(items))
    t0 = time.perf_counter()
    try:
        while queue or live:
            while queue and len(live) < args.concurrency:
                it = queue.pop()
                rid = engine.add_request(it.prompt, SamplingParams(max_tokens=it.max_tokens, temperature=0.0,
                                                                   ignore_eos=True))
                live[rid] = {"t0": time.perf_counter(), "first": None, "last": None, "itl": []}
            now_outputs = engine.step().outputs
            now = time.perf_counter()
            for o in now_outputs:
                st = live.get(o.request_id)
                if st is None:
                    continue
                if o.new_token_ids:
                    if st["first"] is None:
                        st["first"] = now
                    else:
                        st["itl"].append(now - st["last"])
                    st["last"] = now
                if o.finished:
                    del live[o.request_id]
                    if o.error or st["first"] is None:
                        results.append(Result(False, error=o.error or "no tokens"))
                    else:
                        results.append(Result(True, ttft=st["first"] - st["t0"], e2e=now - st["t0"],
                                              output_tokens=o.num_output_tokens, itl=st["itl"]))
                    if bar is not None:
                        bar.update(1)
        elapsed = time.perf_counter() - t0
    finally:
        if bar is not None:
            bar.close()
    return results, elapsed


# --- plumbing -----------------------------------------------------------------------------------


def _bar(args, total: int, desc: str):
    if args.no_progress or args.json or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc=desc, file=sys.stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """Start `llmserve serve` with this command's config flags; wait until /health says ok."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "llmserve", "--log-level", "warning", "serve"]
    if args.config:
        cmd += ["--config", args.config]
    for k, v in vars(args).items():
        if k.startswith("cfg_") and v is not None and k not in ("cfg_server__port", "cfg_server__host"):
            cmd += ["--set", f"{k[4:].replace('__', '.')}={json.dumps(v) if not isinstance(v, str) else v}"]
    for s in args.set or []:
        cmd += ["--set", s]
    cmd += ["--set", "server.log_level=warning", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the launched server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the launched server did not become healthy within 300 s")
        time.sleep(0.2)


def _server_facts(base_url: str, api_key: str | None) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    facts: dict[str, Any] = {}
    try:
        s = httpx.get(base_url.rstrip("/") + "/stats", timeout=10, headers=headers).json()
        facts["backend"] = s.get("backend", {})
        facts["model"] = s.get("model")
        facts["threads"] = s.get("threads")
    except Exception:  # noqa: BLE001 - another OpenAI server may have no /stats
        pass
    if not facts.get("model"):
        try:
            m = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10, headers=headers).json()
            facts["model"] = m["data"][0]["id"]
        except Exception:  # noqa: BLE001
            pass
    return facts


def run_serve_bench(args: argparse.Namespace) -> int:
    """Entry point of `llmserve bench serve`; returns 0 when no request failed."""
    import logging

    from llmserve.bench.offline import machine_info

    try:
        import httpx  # noqa: F401 - the client; a dev extra, so say how to get it
    except ImportError:
        from llmserve.errors import LLMServeError

        raise LLMServeError("llmserve bench serve needs httpx: pip install httpx (or the [dev] extra)") from None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    proc = None
    engine = None
    base_url = args.base_url or "http://127.0.0.1:8000"
    rounds: list[dict[str, Any]] = []
    served: list[Result] = []
    offline: list[Result] = []
    t_served = t_offline = 0.0
    try:
        if args.launch:
            proc, base_url = _launch(args)
        facts = _server_facts(base_url, _api_key(args))
        vocab = int(args.vocab_size or facts.get("backend", {}).get("vocab_size") or 256)
        model = args.request_model or facts.get("model")
        if args.compare_offline:
            if args.text_prompts:
                from llmserve.errors import LLMServeError

                raise LLMServeError("--compare-offline needs token-id prompts (drop --text-prompts)")
            from llmserve.cli import config_from_args
            from llmserve.engine import Engine

            engine = Engine.from_config(config_from_args(args))
        seed0 = args.workload_seed
        for k in range(args.rounds):
            # a fresh seed per round: no prefix-cache hits carried from one round to the next
            args.workload_seed = seed0 + k
            items = make_workload(args, vocab)
            res, el = asyncio.run(run_http(args, base_url, items, model))
            served += res
            t_served += el
            rnd: dict[str, Any] = {"workload_seed": args.workload_seed,
                                   "serve_tok_s": summarize_results(res, el)["output_token_throughput"]}
            if engine is not None:
                res, el = run_offline(args, engine, items)
                offline += res
                t_offline += el
                rnd["offline_tok_s"] = summarize_results(res, el)["output_token_throughput"]
                rnd["ratio"] = rnd["serve_tok_s"] / rnd["offline_tok_s"] if rnd["offline_tok_s"] else None
            rounds.append(rnd)
        args.workload_seed = seed0
        if facts.get("threads") is not None:  # read again: which thread stepped is known only now
            facts["threads"] = _server_facts(base_url, _api_key(args)).get("threads")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        if engine is not None:
            engine.shutdown()
    http = summarize_results(served, t_served)
    report: dict[str, Any] = {
        "workload": {"requests": args.requests, "rounds": args.rounds, "concurrency": args.concurrency,
                     "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "shared_prefix": args.shared_prefix, "workload_seed": args.workload_seed, "vocab_size": vocab,
                     "greedy": True, "ignore_eos": args.ignore_eos, "client": args.client,
                     "text_prompts": args.text_prompts},
        "server": {"base_url": base_url, "launched": args.launch, **facts},
        "machine": machine_info(),
        "serve": http,
        "rounds": rounds,
    }
    if engine is not None:
        from llmserve.bench.offline import thread_layout

        off = summarize_results(offline, t_offline)
        report["offline"] = off
        report["offline_threads"] = thread_layout(engine)
        report["serve_over_offline"] = (http["output_token_throughput"] / off["output_token_throughput"]
                                        if off["output_token_throughput"] else None)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    failed = http["failed"] + (report.get("offline", {}).get("failed", 0))
    return 0 if failed == 0 else 1


def _fmt(v: Any) -> str:
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def print_report(r: dict[str, Any]) -> None:
    """A human-readable table."""
    w, s = r["workload"], r["server"]
    print(f"llmserve bench serve — {w['requests']} requests, concurrency {w['concurrency']}, prompt "
          f"{w['prompt_len']}, output {w['output_len']}, seed {w['workload_seed']}")
    b = s.get("backend", {})
    print(f"  server {s['base_url']} model {s.get('model')} backend {b.get('backend', '?')} "
          f"dtype {b.get('dtype', '-')} threads {b.get('threads', '-')}; machine {r['machine'].get('cpu', '?')}, "
          f"{r['machine']['cpus']} cpus")
    from llmserve.bench.offline import format_threads

    if s.get("threads"):
        print(f"  server {format_threads({**s['threads'], 'torch_threads': b.get('threads')})}")
    if r.get("offline_threads"):
        print(f"  offline {format_threads(r['offline_threads'])}")
    runs = [("serve (HTTP+SSE)", r["serve"])] + ([("offline (engine)", r["offline"])] if "offline" in r else [])
    for name, d in runs:
        print(f"{name}: completed {d['completed']} failed {d['failed']} in {d['elapsed_s']:.2f}s — "
              f"{d['request_throughput']:.2f} req/s, {d['output_token_throughput']:.1f} output tok/s")
        print("  latency (ms)   mean      p50      p90      p99")
        for k in ("ttft", "tpot", "itl", "e2e"):
            x = d["latency_ms"][k]
            print(f"    {k:<8} {_fmt(x['mean']):>9} {_fmt(x['p50']):>8} {_fmt(x['p90']):>8} {_fmt(x['p99']):>8}")
        for e, n in d["errors"].items():
            print(f"  error ×{n}: {e}")
    if len(r["rounds"]) > 1:
        for i, rnd in enumerate(r["rounds"]):
            extra = (f", offline {rnd['offline_tok_s']:.1f} tok/s, ratio {rnd['ratio']:.3f}"
                     if rnd.get("ratio") is not None else "")
            print(f"  round {i} (seed {rnd['workload_seed']}): serve {rnd['serve_tok_s']:.1f} tok/s{extra}")
    if r.get("serve_over_offline") is not None:
        print(f"serve / offline output-token throughput: {r['serve_over_offline']:.3f}")


main = run_serve_bench
