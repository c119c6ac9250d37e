"""What the benches measure per request, how a run is summed up, and how it is printed."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

from llmserve.metrics import summarize


@dataclass(slots=True)
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    prompt_tokens: int = 0


@dataclass(slots=True)
class Timing:
    """One request's clock on the client side: its start and each token arrival."""

    t0: float
    first: float | None = None
    last: float = 0.0
    itl: list[float] = field(default_factory=list)

    def token(self, now: float) -> None:
        """A token arrived at `now`."""
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now

    def result(self, end: float, output_tokens: int, prompt_tokens: int = 0) -> Result:
        """The request ended at `end`: its Result (a failure when no token came)."""
        if self.first is None:
            return Result(False, error="the stream carried no tokens")
        return Result(True, ttft=self.first - self.t0, e2e=end - self.t0, output_tokens=output_tokens,
                      itl=self.itl, prompt_tokens=prompt_tokens)


def in_ms(d: dict[str, Any]) -> dict[str, Any]:
    """A summary in seconds, in milliseconds (counts stay as they are)."""
    return {k: (v * 1e3 if isinstance(v, float) else v) for k, v in d.items()}


def summarize_results(results: list[Result], elapsed: float) -> dict[str, Any]:
    """Counts, errors, throughputs and latency percentiles (ms) of a run."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:160]] = errors.get(r.error[:160], 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors, "elapsed_s": elapsed,
        "request_throughput": len(ok) / elapsed if elapsed else 0.0,
        "output_token_throughput": out_tokens / elapsed if elapsed else 0.0,
        "output_tokens": out_tokens,
        "latency_ms": {"ttft": in_ms(summarize([r.ttft for r in ok])), "tpot": in_ms(summarize(tpot)),
                       "itl": in_ms(summarize([x for r in ok for x in r.itl])),
                       "e2e": in_ms(summarize([r.e2e for r in ok]))},
    }


GEMM_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "avx512_fp16")


def machine_info() -> dict[str, Any]:
    """The facts a figure needs next to it: CPU model, the flags that matter for GEMMs, cores, torch and threads."""
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "platform": platform.platform(), "cpu": platform.processor(), "flags": []}
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    for ln in lines:
        key, _, value = ln.partition(":")
        if key.strip() == "model name":
            info["cpu"] = value.strip()
        else:
            info["flags"] = [f for f in GEMM_FLAGS if f in value.split()]
    torch = sys.modules.get("torch")  # reported when the run uses it; never imported just for this
    if torch is not None:
        info.update(torch=torch.__version__, threads=torch.get_num_threads())
    return info


def progress_bar(args: argparse.Namespace, total: int, desc: str):
    """A tqdm bar on stderr; a silent one with --json, --no-progress or no terminal."""
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc=desc, file=sys.stderr,
                disable=args.no_progress or args.json or not sys.stderr.isatty())


def format_threads(t: dict[str, Any]) -> str:
    """One line: load thread, step thread(s), torch threads."""
    return (f"threads: loaded on {t['load_thread']}, stepped on {', '.join(t['step_threads']) or '-'}"
            f"{'' if t['one_thread'] else ' (NOT the loading thread: torch runs slower)'}, "
            f"torch threads {t['torch_threads'] if t['torch_threads'] is not None else '-'}")


def fmt(v: Any) -> str:
    """A figure in a table: '-' for none, floats to 3 decimals."""
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def print_run(name: str, d: dict[str, Any]) -> None:
    """Counts, throughput, the latency table and the errors of one run."""
    print(f"{name}: completed {d['completed']} failed {d['failed']} in {d['elapsed_s']:.2f}s — "
          f"{d['request_throughput']:.2f} req/s, {d['output_token_throughput']:.1f} output tok/s")
    print("  latency (ms)      mean      p50      p90      p95      p99")
    for k, x in d["latency_ms"].items():
        print(f"    {k:<10} {fmt(x['mean']):>9}" + "".join(f" {fmt(x[q]):>8}" for q in ("p50", "p90", "p95", "p99")))
    for e, n in d["errors"].items():
        print(f"  error ×{n}: {e}")
