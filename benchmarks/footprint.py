#!/usr/bin/env python
"""Start-up time and peak memory: llmserve against llama-server on the same GGUF, with the same KV capacity.

For each file, each system is started from a fresh process and timed to a 200 from /health, then driven through
the c = 1, 8 and 64 workloads of vs_llama_cpp.py (shortened: --requests per case, --output-len tokens), and its peak
resident set (VmHWM; for llmserve the server process and, where the engine runs in a process of its own, that one
too) is read before it stops. Both hold room for the same number of KV tokens: `llama-server -c N -np 64` and
`llmserve serve --kv-cache-memory "N tokens" --max-num-seqs 64`.

llmserve is started twice: a first start on an empty cache directory (it builds the file's tokenizer once and finds
no remembered kernel plan; the kernel library is copied in already built, since its one-time compile is not what is
measured), then a later start on that cache. The page cache is warm for every start (the file is read just before),
as it is for llama-server.

    python benchmarks/footprint.py --files q4_1 qwen2.5-0.5b:Q4_K_M
    python benchmarks/footprint.py --files q4_1 --tokens 65536 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_llama_cpp as vs  # noqa: E402  (its build, files, workloads and clients)
from llmserve_torch.kernel_library import cache_dir as kernel_dir  # noqa: E402


def _peak_rss(pids: list[int]) -> int | None:
    """The summed VmHWM of the processes, in bytes (None where /proc cannot say)."""
    total = 0
    for pid in {p for p in pids if p}:
        try:
            line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
        except (OSError, StopIteration):
            return None
        total += int(line.split()[1]) * 1024
    return total


def _wait_healthy(proc: subprocess.Popen, url: str, t0: float, timeout: float = 600) -> float:
    """Seconds from t0 until url/health answers 200."""
    import httpx

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the server did not become healthy within {timeout:.0f} s")
        time.sleep(0.05)


def _start(cmd: list[str], env: dict[str, str], log: Path) -> tuple[subprocess.Popen, float, Any]:
    out = open(log, "w")
    t0 = time.monotonic()
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT), t0, out


def run_system(system: str, gguf: Path, vocab: int, tokens: int, args, cache: Path, logdir: Path) -> dict[str, Any]:
    """One start of system on gguf: seconds to healthy, the workloads, the peak RSS."""
    import httpx

    port = vs.free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if system == "llama-server":
        cmd = [str(args.server_bin), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", "64",
               "-c", str(tokens), "--threads", str(args.threads), "--threads-batch", str(args.threads), "--no-webui"]
    else:
        env["LLMSERVE_CACHE"], env["LLMSERVE_CACHE_DIR"] = str(cache), str(cache / "kernels")
        env["PYTHONPATH"] = os.pathsep.join([str(vs.ROOT), str(vs.ROOT / "plugins")])
        cmd = [sys.executable, "-m", "llmserve", "--log-level", "warning", "serve", "--model", str(gguf), "--threads",
               str(args.threads), "--max-num-seqs", "64", "--kv-cache-memory", f"{tokens} tokens", "--host",
               "127.0.0.1", "--port", str(port)]
    proc, t0, out = _start(cmd, env, logdir / f"{system}-{port}.log")
    try:
        healthy = _wait_healthy(proc, url, t0)
        pids = [proc.pid]
        facts = {}
        if system == "llmserve":
            st = httpx.get(url + "/stats", timeout=30).json()
            pids.append(st.get("server", {}).get("engine_pid"))
            b = st.get("backend", {})
            facts = {"dtype": b.get("dtype"), "kv_cache": b.get("kv_cache"), "memory": b.get("memory")}
        rss_healthy = _peak_rss(pids)
        runs = {}
        for name in ("c1", "c8", "c64"):
            c = vs.CASES[name]
            case = vs.Case(c.name, c.concurrency, args.requests or c.requests, c.prompt_len,
                           (args.output_len, args.output_len) if args.output_len else c.output_len, c.what)
            r = vs.measure(url, case, vocab, args.seed, args)
            runs[name] = {"tok_s": r["output_token_throughput"], "tokens_ok": r["tokens_ok"]}
        return {"seconds_to_healthy": round(healthy, 2), "peak_rss_at_healthy": rss_healthy,
                "peak_rss": _peak_rss(pids), "workloads": runs, "command": cmd, **facts}
    finally:
        vs._terminate(proc)
        out.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", nargs="+", default=["q4_1"], help="as vs_llama_cpp.py's --files (FILE or SHAPE:QTYPE)")
    ap.add_argument("--tokens", type=int, default=65536, help="KV capacity of both, in tokens (default 65536)")
    ap.add_argument("--requests", type=int, default=16, help="requests per workload (default 16)")
    ap.add_argument("--output-len", type=int, default=64, help="new tokens per request (default 64)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-server", type=Path, help="an existing llama-server (default: the cached build)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    args.server_bin = args.llama_server or vs.build_llama_cpp() / "llama-server"
    quantize = args.server_bin.parent / "llama-quantize"
    out: dict[str, Any] = {"machine": vs.machine(args.threads, vs.llama_version(args.server_bin)),
                           "kv_tokens": args.tokens, "files": []}
    with tempfile.TemporaryDirectory(prefix="llmserve-footprint-") as tmp:
        logdir = Path(tmp)
        for name, gguf in vs.resolve_files(args.files, quantize if quantize.exists() else None):
            facts = vs.gguf_facts(gguf, (vs.parse_shaped(name) or (None,))[0] or vs.FILE_SHAPES.get(name))
            gguf.read_bytes()  # a warm page cache for every start
            cache = Path(tmp) / f"cache-{len(out['files'])}"
            (cache / "kernels").mkdir(parents=True)
            for lib in kernel_dir().glob("*.so"):  # built already; no plans, no tokenizer, no GGUF cache
                shutil.copy2(lib, cache / "kernels" / lib.name)
            row = {"file": name, "path": str(gguf), "size_bytes": gguf.stat().st_size}
            for label, system in (("llmserve_first", "llmserve"), ("llmserve_later", "llmserve"),
                                  ("llama-server", "llama-server")):
                vs.log(f"{name}: {label}")
                row[label] = run_system(system, gguf, facts["vocab_size"], args.tokens, args, cache, logdir)
            ls = row["llama-server"]
            row["ratio"] = {k: row[k]["peak_rss"] / ls["peak_rss"] for k in ("llmserve_first", "llmserve_later")
                            if row[k]["peak_rss"] and ls["peak_rss"]}
            out["files"].append(row)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"KV capacity {args.tokens} tokens each; {out['machine'].get('cpu', '')}")
    print(f"{'file':<24}{'system':<16}{'to healthy s':>13}{'peak RSS MiB':>14}{'vs llama':>9}   tok/s c1 / c8 / c64")
    for row in out["files"]:
        for k in ("llmserve_first", "llmserve_later", "llama-server"):
            r = row[k]
            tps = " / ".join(f"{r['workloads'][c]['tok_s']:.0f}" for c in ("c1", "c8", "c64"))
            ratio = row["ratio"].get(k)
            print(f"{row['file']:<24}{k:<16}{r['seconds_to_healthy']:>13.2f}{(r['peak_rss'] or 0) / 2**20:>14.0f}"
                  f"{'' if ratio is None else f'{ratio:.2f}x':>9}   {tps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
