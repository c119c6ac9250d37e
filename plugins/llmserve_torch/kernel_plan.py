"""Which kernel a quantized linear runs, measured on this CPU when the model loads.

torch's weight-only kernels read 1/2 (int8) or 1/4 (int4) of bf16's bytes, so they win at a few rows;
they run each row almost as a separate pass, so a dense GEMM wins at many rows. Where the crossover
lies depends on the CPU (AVX512_BF16, AMX, cache sizes) and on the activation dtype (with float32
activations both kernels took a slow path, 7-50x slower, on an AMD EPYC with AVX512_BF16): both are
measured over the model's own linears, so the weights come from memory as in serving.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from llmserve_torch import kernel_library

log = logging.getLogger("llmserve.torch")

NEVER = 1 << 30  # a row limit no batch reaches: the quantized kernel always runs
_PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(slots=True)
class KindPlan:
    """One quantized kind's choice: activation dtype, and the most rows it runs before the dense copy takes over."""

    act: torch.dtype
    max_rows: int
    how: str  # "measured", "asked for", "no dense copy"
    timings: dict = field(default_factory=dict)  # rows → {"quantized_ms", "dense_ms"} over all linears of the kind
    kernel: str = ""  # the quantized matmul (QuantLinear.kernel)
    bits_read: float = 0.0  # a weight's bits the kernel reads, scales and offsets included (over the kind's linears)
    sources: dict = field(default_factory=dict)  # GGUF type (or rtn) → linears of the kind made from it


class KernelPlan:
    """The per-kind choices every QuantLinear of one model consults on each call."""

    def __init__(self):
        self.kinds: dict[str, KindPlan] = {}

    def choice(self, kind: str) -> tuple[torch.dtype, int]:
        """(activation dtype, row limit) for a kind."""
        p = self.kinds[kind]
        return p.act, p.max_rows

    def describe(self) -> dict:
        """For /stats and the start-up log."""
        return {k: {"kernel": p.kernel, "bits_read": round(p.bits_read, 3), "sources": p.sources,
                    "activations": _dtype_name(p.act),
                    "quantized_up_to_rows": None if p.max_rows >= NEVER else p.max_rows, "how": p.how,
                    "timings_ms": p.timings} for k, p in self.kinds.items()}


def _time(fn, reps: int = 2) -> float:
    """Best of reps wall times in ms, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _pick_act(group: list, serving: torch.dtype) -> torch.dtype:
    """bf16 or the serving dtype, whichever runs the kernel faster at one row (on a few linears); kept per machine."""
    if serving == torch.bfloat16:
        return serving
    few = group[:4]
    # remembered like the crossovers: timed afresh at each load, two calls flipped under CPU contention, and two
    # loads of one model on one machine then ran different kernels
    key = _key(few, serving, "activations")
    known = _recall(key)
    if known is not None and known.get("act") in _ACTS:
        return _ACTS[known["act"]]
    x = {lin.in_features: torch.randn(1, lin.in_features) for lin in few}
    t = {dt: _time(lambda dt=dt: [lin.quantized(x[lin.in_features].to(dt), dt) for lin in few], reps=2)
         for dt in (torch.bfloat16, serving)}
    act = min(t, key=t.get)
    _remember(key, {"act": _dtype_name(act), "timings_ms": {_dtype_name(dt): round(v, 3) for dt, v in t.items()}})
    return act


def _dtype_name(dt: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: how the plans file, /stats and the log name a dtype."""
    return str(dt).replace("torch.", "")


_ACTS = {_dtype_name(dt): dt for dt in (torch.bfloat16, torch.float32, torch.float16)}


def plan_kernels(plan: KernelPlan, linears: list, serving: torch.dtype, max_batch_rows: int,
                 limit: int | str = "auto") -> None:
    """Fill plan: each kind's activation dtype and dense-copy crossover, measured (or taken: limit a number).

    max_batch_rows: the most rows a step can hand a linear; when the quantized kernel still wins there, the
    dense copies are dropped (they would never run).
    """
    for kind in sorted({lin.kind for lin in linears}):
        group = [lin for lin in linears if lin.kind == kind]
        with torch.inference_mode():
            act = _pick_act(group, serving)
            if not all(lin.dense is not None for lin in group):
                kp = KindPlan(act, NEVER, "no dense copy")
            elif limit != "auto":
                kp = KindPlan(act, int(limit), "asked for")
            else:
                key = _key(group, serving, _dtype_name(act), max_batch_rows)
                kp = _recalled_plan(key, act)
                if kp is None:
                    kp = KindPlan(act, NEVER, "measured")
                    _measure_crossover(group, kp, serving, max_batch_rows)
                    _remember(key, {"max_rows": kp.max_rows, "timings": kp.timings})
        kp.kernel = group[0].kernel
        kp.bits_read = 8 * sum(lin.nbytes for lin in group) / sum(lin.params for lin in group)
        kp.sources = dict(sorted(Counter(lin.source for lin in group).items()))
        plan.kinds[kind] = kp
        if kp.max_rows >= max_batch_rows:
            for lin in group:
                lin.dense = None  # never used: free its memory
        log.info("quantized %s linears (%d: %s): %s, %.2f bits a weight read, %s activations, quantized kernel up to "
                 "%s rows (%s)", kind, len(group), ", ".join(f"{n} {s}" for s, n in kp.sources.items()), kp.kernel,
                 kp.bits_read, _dtype_name(act), "all" if kp.max_rows >= max_batch_rows else kp.max_rows, kp.how)


def _measure_crossover(group: list, kp: KindPlan, serving: torch.dtype, max_batch_rows: int) -> None:
    """Double the rows until the dense copies beat the quantized kernel twice in a row."""
    last_win, losses = 0, 0
    for rows in _PROBE_ROWS:
        if rows > max_batch_rows:
            break
        x = {n: torch.randn(rows, n).to(serving) for n in {lin.in_features for lin in group}}
        q = _time(lambda: [lin.quantized(x[lin.in_features], kp.act) for lin in group])
        d = _time(lambda: [lin.dense(x[lin.in_features]) for lin in group])
        kp.timings[rows] = {"quantized_ms": round(q, 3), "dense_ms": round(d, 3)}
        if q <= d:
            last_win, losses = rows, 0
            continue
        losses += 1
        if losses == 2:
            break
    kp.max_rows = last_win if losses else NEVER  # no loss at any size probed: the quantized kernel always runs


# --- measured crossovers, remembered per CPU, torch build, threads and weight shapes ------------------------

def _plans_file():
    """Beside the built kernels (the one rule for where they live: kernel_library.cache_dir)."""
    return kernel_library.cache_dir() / "quant-plans.json"


def _key(group: list, serving: torch.dtype, *what) -> str:
    """What a measurement depends on: the CPU, torch and its threads, the serving dtype, the linears' shapes, our
    kernels, and what was measured (what)."""
    # the CPU and our kernel library's build (our int8 kernel is part of what was measured)
    shapes = sorted(Counter((lin.kind, lin.out_features, lin.in_features) for lin in group).items())
    facts = [kernel_library.cpu_id(), torch.__version__, torch.get_num_threads(), str(serving), shapes,
             kernel_library.library_id(), *what]
    return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()[:24]


def _recall(key: str) -> dict | None:
    """What was measured earlier for the same key (None: measure now)."""
    try:
        entry = json.loads(_plans_file().read_text())[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return entry if isinstance(entry, dict) else None


def _recalled_plan(key: str, act: torch.dtype) -> KindPlan | None:
    """A crossover measured earlier for the same key."""
    entry = _recall(key)
    try:
        return KindPlan(act, int(entry["max_rows"]), "measured earlier on this machine",
                        {int(r): t for r, t in entry["timings"].items()})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _remember(key: str, entry: dict) -> None:
    """Add a measurement to the plans file (best effort: an unwritable cache only costs a re-measure)."""
    path = _plans_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if not isinstance(known, dict):
            known = {}
        known[key] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".quant-plans-")
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        log.info("could not remember the kernel measurement in %s (%s)", path, e)
