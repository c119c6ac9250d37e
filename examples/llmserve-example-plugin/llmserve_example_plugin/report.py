"""`llmserve csv-report FILE`: latency percentiles from a CSV the sink wrote."""

from __future__ import annotations

import csv
import json
import sys
from typing import Any

from llmserve.metrics import summarize


def summarize_csv(path: str) -> dict[str, Any]:
    """Request count, finish reasons, token totals and p50/p95/p99 of queue time, TTFT and e2e."""
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    reasons: dict[str, int] = {}
    for r in rows:
        reasons[r["finish_reason"] or "none"] = reasons.get(r["finish_reason"] or "none", 0) + 1

    def col(name: str) -> list[float]:
        return [float(r[name]) for r in rows if r[name] != ""]

    return {
        "path": path,
        "requests": len(rows),
        "finish_reasons": reasons,
        "prompt_tokens": int(sum(col("num_prompt_tokens"))),
        "output_tokens": int(sum(col("num_output_tokens"))),
        "latency_seconds": {name: summarize(col(f"{name}_seconds")) for name in ("queue", "ttft", "e2e")},
    }


def run(args) -> int:
    """Print the summary of args.path as a table, or as JSON with --json."""
    try:
        s = summarize_csv(args.path)
    except (OSError, KeyError, ValueError) as e:
        print(f"csv-report: cannot read {args.path}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    print(f"{s['requests']} requests in {s['path']}: {s['prompt_tokens']} prompt tokens, "
          f"{s['output_tokens']} output tokens; finish reasons {s['finish_reasons']}")
    print(f"{'seconds':<8}{'p50':>10}{'p95':>10}{'p99':>10}{'max':>10}")
    for name, q in s["latency_seconds"].items():
        cells = "".join(f"{'-' if q[k] is None else format(q[k], '.4f'):>10}" for k in ("p50", "p95", "p99", "max"))
        print(f"{name:<8}{cells}")
    return 0
