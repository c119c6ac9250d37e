"""`llmserve bench serve`: streaming clients against an OpenAI-compatible server.

C clients stream N seeded synthetic completions (token-id prompts, greedy, EOS ignored) from
--base-url and report TTFT, TPOT, ITL and end-to-end latency, request and output-token
throughput, and failures. --launch starts `llmserve serve` with the given config flags on a
free port first; --compare-offline then runs the same workload through an Engine built from
the same config, in this process and without HTTP, with the same C in flight, and prints the
ratio of the two output-token throughputs (the HTTP + SSE overhead).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

from llmserve_bench.offline import drive, thread_layout
from llmserve_bench.report import Result, fmt, format_threads, machine_info, print_run, progress_bar, \
    summarize_results
from llmserve_bench.workload import add_workload_arguments, make_workload, workload_facts
from llmserve.config_args import add_config_arguments, config_from_args, flag_overrides
from llmserve.errors import LLMServeError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Target, workload and output flags (plus the config flags used by --launch / --compare-offline)."""
    p.add_argument("--base-url", default=None,
                   help="server root, e.g. http://127.0.0.1:8000 (default: that, or the --launch'ed server)")
    p.add_argument("--launch", action="store_true",
                   help="start `llmserve serve` with the config flags below on a free port, stop it after")
    p.add_argument("--request-model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--concurrency", type=concurrency_list, default=[64], metavar="C[,C...]",
                   help="streaming clients in flight; a comma list (1,8,32,64) runs the workload at each, in order")
    p.add_argument("--plot", metavar="DIR", default=None,
                   help="write latency CDFs, throughput/latency against concurrency (a sweep) and a timeline of "
                        "running, waiting, KV usage and tok/s sampled from /stats, as PNG + JSON (needs matplotlib)")
    add_workload_arguments(p, requests=256, prompt_len=[16, 128], output_len=[128, 128])
    p.add_argument("--text-prompts", action="store_true",
                   help="send prompts as text (--prompt-len words from a fixed list) instead of token ids, for "
                        "servers that take only strings (e.g. `transformers serve`); not with --compare-offline")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send the non-OpenAI `ignore_eos` field (servers that reject unknown fields); "
                        "check output_tokens to see whether EOS ended requests early")
    p.add_argument("--client", choices=["raw", "httpx", "openai"], default="raw",
                   help="raw: a minimal HTTP/1.1 client reading raw SSE (the default: it leaves the cores to the "
                        "server); httpx: the same reading through httpx; openai: the official SDK's AsyncOpenAI, as "
                        "applications stream")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt token ids below this (default: the server's vocabulary from /stats)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout (s)")
    p.add_argument("--compare-offline", action="store_true",
                   help="also run the workload through an Engine built from the config flags, no HTTP")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the workload (seed+k in round k), alternating HTTP and offline runs, so noise "
                        "from a shared machine hits both sides alike")
    # the config flags describe the engine for --launch and --compare-offline; --api-key is also
    # the Bearer token the clients send (default: env LLMSERVE_API_KEY)
    add_config_arguments(p)


def concurrency_list(text: str) -> list[int]:
    """--concurrency: one count or a comma list of them, each at least 1."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or a comma list of counts, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency must be at least 1, got {text!r}")
    return levels


def _api_key(args: argparse.Namespace) -> str | None:
    return getattr(args, "cfg_server__api_key", None) or os.environ.get("LLMSERVE_API_KEY")


def _launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """Start `llmserve serve` with this command's config flags; wait until /health says ok."""
    flags = ["--config", args.config] if args.config else []
    for key, v in flag_overrides(args).items():
        if key not in ("server.port", "server.host"):
            flags += ["--set", f"{key}={v if isinstance(v, str) else json.dumps(v)}"]
    for s in args.set:
        flags += ["--set", s]
    return launch_server(flags)


def launch_server(flags: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`llmserve serve FLAGS` on a free 127.0.0.1 port; its process and URL once /health says ok."""
    import httpx  # here, not at the top: `llmserve --help` imports this module

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", "--log-level", "warning", "serve", *flags,
                             "--host", "127.0.0.1", "--port", str(port)], env=env)
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


def _check_reachable(base_url: str, api_key: str | None) -> None:
    """One line, not a report of N connection errors, when nothing answers at base_url."""
    import httpx

    try:
        httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10,
                  headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    except httpx.TransportError as e:
        raise LLMServeError(f"no server answers at {base_url} ({type(e).__name__}: {e or 'no answer'}); start one "
                            "(llmserve serve), pass its --base-url, or let --launch start one") from None


def _server_facts(base_url: str, api_key: str | None) -> dict[str, Any]:
    """Backend, model and threads from /stats; the model from /v1/models where there is no /stats (other servers)."""
    import httpx

    def get(path: str) -> dict[str, Any]:
        try:
            return httpx.get(base_url.rstrip("/") + path, timeout=10,
                             headers={"Authorization": f"Bearer {api_key}"} if api_key else {}).json()
        except (httpx.HTTPError, ValueError):
            return {}

    s = get("/stats")
    facts = {"backend": s.get("backend", {}), "model": s.get("model"), "threads": s.get("threads")}
    if not facts["model"]:
        facts["model"] = (get("/v1/models").get("data") or [{}])[0].get("id")
    return facts


def main(args: argparse.Namespace) -> int:
    """Entry point of `llmserve bench serve`; returns 0 when no request failed."""
    if args.compare_offline and args.text_prompts:
        raise LLMServeError("--compare-offline needs token-id prompts (drop --text-prompts)")
    if args.plot:
        from llmserve_bench.plot import require_matplotlib

        require_matplotlib()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    proc = engine = timeline = None
    base_url = args.base_url or "http://127.0.0.1:8000"
    levels, seed0, key = args.concurrency, args.workload_seed, _api_key(args)
    points: list[dict[str, Any]] = []
    try:
        if args.launch:
            proc, base_url = _launch(args)
        _check_reachable(base_url, key)
        facts = _server_facts(base_url, key)
        vocab = int(args.vocab_size or facts.get("backend", {}).get("vocab_size") or 256)
        model = args.request_model or facts.get("model")
        if args.compare_offline:
            from llmserve.engine import Engine

            engine = Engine.from_config(config_from_args(args))
        if args.plot:
            from llmserve_bench.plot import Timeline, stats_reader

            timeline = Timeline(stats_reader(base_url, key)).start()
        for i, c in enumerate(levels):
            if timeline is not None and len(levels) > 1:
                timeline.mark(f"c={c}")
            # fresh seeds per point and round: no prefix-cache hits carried from one to the next
            points.append(_run_point(args, c, seed0 + i * args.rounds, base_url, model, key, engine, vocab))
        if facts.get("threads") is not None:  # read again: which thread stepped is known only now
            facts["threads"] = _server_facts(base_url, key)["threads"]
    finally:
        args.workload_seed, args.concurrency = seed0, levels
        if timeline is not None:
            timeline.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        offline_threads = None
        if engine is not None:
            offline_threads = thread_layout(engine)  # before shutdown: a torch backend drops its model there
            engine.shutdown()
    report: dict[str, Any] = {
        "workload": {**workload_facts(args), "rounds": args.rounds,
                     "concurrency": levels[0] if len(levels) == 1 else levels,
                     "vocab_size": vocab, "greedy": True, "ignore_eos": args.ignore_eos, "client": args.client,
                     "text_prompts": args.text_prompts},
        "server": {"base_url": base_url, "launched": args.launch, **facts},
        "machine": machine_info(),
    }
    if offline_threads is not None:
        report["offline_threads"] = offline_threads
    raw = [p.pop("results") for p in points]
    if len(levels) == 1:
        report.update(points[0])  # one point: its figures at the top, as before sweeps existed
    else:
        report["sweep"] = points
    if args.plot:
        from llmserve_bench.plot import latency_data, write_plots

        title = (f"llmserve bench serve: {report['server'].get('model')} "
                 f"({report['server'].get('backend', {}).get('backend', '?')}), {args.requests} requests"
                 f"{' per point' if len(levels) > 1 else f', concurrency {levels[0]}'}, prompt {args.prompt_len}, "
                 f"output {args.output_len}")
        report["plots"] = write_plots(args.plot, title,
                                      {f"c={c}": latency_data(r) for c, r in zip(levels, raw)},
                                      timeline.data(), points if len(levels) > 1 else None)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    failed = sum(p["serve"]["failed"] + p.get("offline", {}).get("failed", 0) for p in points)
    return 0 if failed == 0 else 1


def _run_point(args: argparse.Namespace, concurrency: int, seed: int, base_url: str, model: str | None,
               key: str | None, engine, vocab: int) -> dict[str, Any]:
    """The workload's rounds at one concurrency (HTTP, and offline with --compare-offline); its report part,
    with the HTTP results under "results" for the plots."""
    from llmserve_bench.clients import run_client, run_http

    args.concurrency = concurrency  # what run_http reads
    rounds: list[dict[str, Any]] = []
    served: list[Result] = []
    offline: list[Result] = []
    t_served = t_offline = 0.0
    for k in range(args.rounds):
        args.workload_seed = seed + k
        items = make_workload(args, vocab)
        res, el = run_client(run_http(args, base_url, items, model, key))
        served += res
        t_served += el
        rnd: dict[str, Any] = {"workload_seed": args.workload_seed,
                               "serve_tok_s": summarize_results(res, el)["output_token_throughput"]}
        if engine is not None:
            res, el = drive(engine, items, concurrency, progress_bar(args, len(items), "offline"))
            offline += res
            t_offline += el
            rnd["offline_tok_s"] = summarize_results(res, el)["output_token_throughput"]
            rnd["ratio"] = rnd["serve_tok_s"] / rnd["offline_tok_s"] if rnd["offline_tok_s"] else None
        rounds.append(rnd)
    http = summarize_results(served, t_served)
    point: dict[str, Any] = {"concurrency": concurrency, "serve": http, "rounds": rounds, "results": served}
    if engine is not None:
        off = summarize_results(offline, t_offline)
        point["offline"] = off
        point["serve_over_offline"] = (http["output_token_throughput"] / off["output_token_throughput"]
                                       if off["output_token_throughput"] else None)
    return point


def print_report(r: dict[str, Any]) -> None:
    """A human-readable table (one per point of a sweep, then a summary row per point)."""
    w, s = r["workload"], r["server"]
    print(f"llmserve bench serve — {w['requests']} requests, concurrency {w['concurrency']}, prompt "
          f"{w['prompt_len']}, output {w['output_len']}, seed {w['workload_seed']}")
    b = s.get("backend", {})
    print(f"  server {s['base_url']} model {s.get('model')} backend {b.get('backend', '?')} "
          f"dtype {b.get('dtype', '-')} threads {b.get('threads', '-')}; machine {r['machine'].get('cpu', '?')}, "
          f"{r['machine']['cpus']} cpus")
    if s.get("threads"):
        print(f"  server {format_threads({**s['threads'], 'torch_threads': b.get('threads')})}")
    if r.get("offline_threads"):
        print(f"  offline {format_threads(r['offline_threads'])}")
    for p in r.get("sweep") or [r]:
        _print_point(p, f" at concurrency {p['concurrency']}" if "sweep" in r else "")
    if r.get("sweep"):
        print("concurrency  req/s  output tok/s  TTFT p50/p99 (ms)  ITL p50/p99 (ms)  e2e p50/p99 (ms)")
        for p in r["sweep"]:
            d, lat = p["serve"], p["serve"]["latency_ms"]
            print(f"{p['concurrency']:>11} {d['request_throughput']:>6.2f} {d['output_token_throughput']:>13.1f}"
                  + "".join(f"  {fmt(lat[k]['p50']):>8}/{fmt(lat[k]['p99']):<8}" for k in ("ttft", "itl", "e2e")))
    for f in r.get("plots", []):
        print(f"plot: {f}")


def _print_point(p: dict[str, Any], where: str) -> None:
    print_run(f"serve (HTTP+SSE){where}", p["serve"])
    if "offline" in p:
        print_run(f"offline (engine){where}", p["offline"])
    if len(p["rounds"]) > 1:
        for i, rnd in enumerate(p["rounds"]):
            extra = (f", offline {rnd['offline_tok_s']:.1f} tok/s, ratio {rnd['ratio']:.3f}"
                     if rnd.get("ratio") is not None else "")
            print(f"  round {i} (seed {rnd['workload_seed']}): serve {rnd['serve_tok_s']:.1f} tok/s{extra}")
    if p.get("serve_over_offline") is not None:
        print(f"serve / offline output-token throughput{where}: {p['serve_over_offline']:.3f}")
