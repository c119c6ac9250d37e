"""Which kernel a quantized linear runs, measured on this CPU when the model loads.

torch's weight-only kernels read 1/2 (int8) or 1/4 (int4) of bf16's bytes, so they win at a few rows;
they run each row almost as a separate pass, so a dense GEMM wins at many rows. Where the crossover
lies depends on the CPU (AVX512_BF16, AMX, cache sizes) and on the activation dtype (with float32
activations both kernels took a slow path, many times slower, on an AMD EPYC with AVX512_BF16): both are
measured over the model's own linears, so the weights come from memory as in serving.

A plan timed beside a compiler is noise (docs/backend-torch.md, "Plans that cannot go stale"), and one remembered
would steer every later start. So each figure is the best of several repeats, and the timing is judged: repeats that spread, or
threads that waited for a CPU while it ran (another program had it), make it noisy. A noisy plan serves the start
that timed it and is never remembered (plan_store.py); a remembered one is checked at each start by timing its
decisive row counts again, and timed afresh where they now disagree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from llmserve_torch import kernel_library, plan_store

log = logging.getLogger("llmserve.torch")

NEVER = 1 << 30  # a row limit no batch reaches: the quantized kernel always runs
_PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REPEATS = 5  # samples a timing takes: the best is the figure, the median against the best its spread
CHECK_REPEATS = 3  # the check at start: fewer
SAMPLE_S = 0.005  # a sample calls the timed function as often as fills this (tiny shapes stay above the clock's noise)
# a timing whose median repeat is this much above its best was disturbed (quiet timings spread well under this, beside
# a compiler several times over: docs/backend-torch.md): a gross check, where waiting for a CPU is the fine one
MAX_SPREAD = 1.0
MAX_WAITED = 0.2  # the share of our threads' runnable time spent waiting for a CPU, above which another program had it
MARGIN = 0.2  # a difference within this is no difference: a remembered pick disagrees only when it loses by more


@dataclass(slots=True)
class Noise:
    """How busy the machine was while something was timed."""

    spread: float = 0.0  # the largest (median − best) / best over one timing's repeats
    waited: float | None = None  # share of this process's runnable time spent waiting for a CPU (None: not known)
    load: float | None = None  # the 1-minute load average per CPU as the timing ended

    def busy(self) -> str:
        """Why a timing taken in this noise is not to be trusted ("" where the machine was quiet)."""
        why = []
        if self.spread > MAX_SPREAD:
            why.append(f"repeats {self.spread:.0%} apart")
        if self.waited is not None and self.waited > MAX_WAITED:
            why.append(f"threads waited for a CPU {self.waited:.0%} of the time")
        if self.waited is None and self.load is not None and self.load > 1:  # no scheduler figures here: the load
            why.append(f"load average {self.load:.2f} a CPU")
        return ", ".join(why)

    def as_dict(self) -> dict:
        return {k: None if v is None else round(v, 3) for k, v in asdict(self).items()}


def _scheduled() -> tuple[int, int] | None:
    """ns this process's threads have run and waited runnable for a CPU (Linux schedstat), or None."""
    run = wait = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            r, w, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # (a thread that ended meanwhile)
        run, wait = run + int(r), wait + int(w)
    return (run, wait) if run else None


class Meter:
    """Times functions by repeats and tells how busy the machine was meanwhile."""

    def __init__(self, repeats: int = REPEATS):
        self.repeats = repeats
        self.spread = 0.0
        self._since = _scheduled()

    def time(self, fn) -> float:
        """Best of the repeats in ms a call, after one warm-up call; the repeats taken once more where they spread
        (a moment's disturbance, another program's burst, is not a busy machine)."""
        t = time.perf_counter()
        fn()
        calls = min(1000, max(1, math.ceil(SAMPLE_S / max(time.perf_counter() - t, 1e-9))))
        best = float("inf")
        for _ in range(2):
            samples = []
            for _ in range(self.repeats):
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples.append((time.perf_counter() - t) / calls)
            best = min(best, *samples)
            spread = statistics.median(samples) / min(samples) - 1 if min(samples) > 0 else 0.0
            if spread <= MAX_SPREAD:
                break
        self.spread = max(self.spread, spread)
        return best * 1e3

    def noise(self) -> Noise:
        """The noise since this meter was made."""
        now, waited = _scheduled(), None
        if now is not None and self._since is not None:
            run, wait = max(0, now[0] - self._since[0]), max(0, now[1] - self._since[1])
            waited = wait / (run + wait) if run + wait else 0.0
        try:
            load = os.getloadavg()[0] / (os.cpu_count() or 1)
        except OSError:
            load = None
        return Noise(self.spread, waited, load)


@dataclass(slots=True)
class Timed:
    """When a plan's figures were timed and how quietly, whether they are remembered, what this start's check found."""

    at: float  # when they were timed (time.time())
    noise: Noise
    remembered: bool  # in the plans file (a noisy timing never is)
    recalled: bool = False  # timed at an earlier start, and checked at this one
    check: str = ""  # what the check at this start found, or why it re-timed

    def describe(self) -> dict:
        """For /stats (under each kind of the plan)."""
        return {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at)), "age_s": round(time.time() - self.at),
                "recalled": self.recalled, "noisy": self.noise.busy() or False, "remembered": self.remembered,
                "noise": self.noise.as_dict(), "check": self.check}


@dataclass(slots=True)
class KindPlan:
    """One quantized kind's choice: activation dtype, and the most rows it runs before the dense copy takes over."""

    act: torch.dtype
    max_rows: int
    how: str  # "measured", "measured earlier on this machine", "asked for", "no dense copy"
    timings: dict = field(default_factory=dict)  # rows → {"quantized_ms", "dense_ms"} over all linears of the kind
    kernel: str = ""  # the quantized matmul (QuantLinear.kernel)
    bits_read: float = 0.0  # a weight's bits the kernel reads, scales and offsets included (over the kind's linears)
    sources: dict = field(default_factory=dict)  # GGUF type (or rtn) → linears of the kind made from it
    timed: Timed | None = None  # the crossover's timing (None: not timed)
    act_timed: Timed | None = None  # the activation dtype's timing (None: bf16 serving, nothing to pick)
    deferred: bool = False  # the safe plan of a start that found nothing remembered: timed later (tune_deferred)


class KernelPlan:
    """The per-kind choices every QuantLinear of one model consults on each call."""

    def __init__(self):
        self.kinds: dict[str, KindPlan] = {}
        self.pending: dict[str, tuple] = {}  # deferred kind → what tune_deferred times it with (group, facts, ...)

    def choice(self, kind: str) -> tuple[torch.dtype, int]:
        """(activation dtype, row limit) for a kind."""
        p = self.kinds[kind]
        return p.act, p.max_rows

    def describe(self) -> dict:
        """For /stats and the start-up log."""
        out = {}
        for k, p in self.kinds.items():
            d = {"kernel": p.kernel, "bits_read": round(p.bits_read, 3), "sources": p.sources,
                 "activations": _dtype_name(p.act), "quantized_up_to_rows": None if p.max_rows >= NEVER else p.max_rows,
                 "how": p.how, "timings_ms": p.timings, "timed": p.timed.describe() if p.timed else None,
                 "deferred": p.deferred}
            if p.act_timed is not None:
                d["activations_timed"] = p.act_timed.describe()
            out[k] = d
        return out


def _dtype_name(dt: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: how the plans file, /stats and the log name a dtype."""
    return str(dt).replace("torch.", "")


_ACTS = {_dtype_name(dt): dt for dt in (torch.bfloat16, torch.float32, torch.float16)}


def plan_kernels(plan: KernelPlan, linears: list, serving: torch.dtype, max_batch_rows: int,
                 limit: int | str = "auto", model: str = "", defer: bool = False) -> None:
    """Fill plan: each kind's activation dtype and dense-copy crossover, timed (or taken: limit a number).

    limit: auto (a remembered plan checked, else timed), retime (timed afresh), or the row limit itself.
    max_batch_rows: the most rows a step can hand a linear; when the quantized kernel still wins there, the
    dense copies are dropped (they would never run). model: what the plans file names the plan after.
    defer: serve first, tune later: a kind that nothing remembered and that our kernels run at any row count starts
    on that safe plan (no dense copy) and is timed by tune_deferred once the server is up.
    """
    retime = limit == "retime"
    for kind in sorted({lin.kind for lin in linears}):
        group = [lin for lin in linears if lin.kind == kind]
        # what `llmserve plan show` says of an entry (the key holds the same facts, hashed)
        facts = {"model": model, "kind": kind, "serving": _dtype_name(serving), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "library": kernel_library.library_id()}
        with torch.inference_mode():
            act, act_timed = _pick_act(group, serving, facts, retime)
            if not all(lin.dense is not None or lin.densify is not None for lin in group):
                kp = KindPlan(act, NEVER, "no dense copy")
            elif limit not in ("auto", "retime"):
                kp = KindPlan(act, int(limit), "asked for")
            else:
                key = _key(group, serving, _dtype_name(act), max_batch_rows)
                facts.update(what="crossover", linears=len(group), activations=_dtype_name(act),
                             max_batch_rows=max_batch_rows)
                measure = lambda m: _measure_crossover(m, group, act, serving, max_batch_rows)  # noqa: E731
                check = lambda m, e: _check_crossover(m, group, act, serving, e)  # noqa: E731
                if defer and not retime and plan_store.recall(key) is None and all(lin.fmt is not None
                                                                                  for lin in group):
                    kp = KindPlan(act, NEVER, "not timed yet: the quantized kernel at every row count until a "
                                  "timing in the background says otherwise", deferred=True)
                    # the plans file as it is now: a later timing remembers there, wherever LLMSERVE_CACHE_DIR points then
                    plan.pending[kind] = (key, facts, measure, check, group, max_batch_rows, plan_store.path())
                else:
                    entry, timed = _timed(key, facts, measure, check, retime)
                    kp = KindPlan(act, int(entry["max_rows"]), "measured earlier on this machine" if timed.recalled
                                  else "measured", {int(r): t for r, t in entry["timings"].items()}, timed=timed)
        kp.act_timed = act_timed
        kp.kernel = group[0].kernel
        kp.bits_read = 8 * sum(lin.nbytes for lin in group) / sum(lin.params for lin in group)
        kp.sources = dict(sorted(Counter(lin.source for lin in group).items()))
        _apply(kp, group, max_batch_rows, serving)
        plan.kinds[kind] = kp
        log.info("quantized %s linears (%d: %s): %s, %.2f bits a weight read, %s activations, quantized kernel up to "
                 "%s rows (%s)", kind, len(group), ", ".join(f"{n} {s}" for s, n in kp.sources.items()), kp.kernel,
                 kp.bits_read, _dtype_name(act), "all" if kp.max_rows >= max_batch_rows else kp.max_rows,
                 _how(kp))


def _apply(kp: KindPlan, group: list, max_batch_rows: int, serving: torch.dtype) -> None:
    """A dense copy exists only where the plan runs it (a timing made some to compare)."""
    for lin in group:
        if kp.max_rows >= max_batch_rows:
            lin.dense = None
        else:
            lin.ensure_dense(serving)


def tune_deferred(plan: KernelPlan, steps=contextlib.nullcontext()) -> list[str]:
    """Time the kinds a start deferred (plan_kernels(defer=True)), judged and remembered as at a start; what each
    found, in words. A kind whose timing confirms the safe plan keeps running it; one where the dense copies win
    from some row count keeps the safe plan for this run (a running fused stack was sized by it) and the next start
    reads the remembered crossover. A timing on a busy machine is dropped and the kind stays pending. steps: held
    while a kind is timed (the backend's lock around its steps: our kernels' thread team runs one call at a time)."""
    said = []
    for kind, (key, facts, measure, check, group, max_batch_rows, file) in list(plan.pending.items()):
        kp = plan.kinds[kind]
        with steps, torch.inference_mode():
            entry, timed = _timed(key, facts, measure, check, retime=False, file=file)
        for lin in group:  # the timing's dense copies: the safe plan never runs them
            lin.dense = None
        busy = timed.noise.busy()
        if busy:
            said.append(f"{kind}: timed on a busy machine ({busy}); not kept, timed again later")
            continue
        del plan.pending[kind]
        rows = int(entry["max_rows"])
        if rows >= max_batch_rows:
            plan.kinds[kind] = KindPlan(kp.act, NEVER, "measured", {int(r): t for r, t in entry["timings"].items()},
                                        kp.kernel, kp.bits_read, kp.sources, timed, kp.act_timed)
            said.append(f"{kind}: the quantized kernel wins at every row count timed; remembered")
        else:
            kp.how = f"the safe plan for this run; timed later: dense copies win past {rows} rows (the next start uses that)"
            kp.timings, kp.timed, kp.deferred = {int(r): t for r, t in entry["timings"].items()}, timed, False
            said.append(f"{kind}: dense copies win past {rows} rows; remembered for the next start")
    return said


def _how(kp: KindPlan) -> str:
    """How a kind's row limit was had, for the start-up log: asked for, timed (quietly or not), or recalled."""
    t = kp.timed
    if t is None:
        return kp.how
    if t.recalled:
        return f"timed {plan_store.age(time.time() - t.at)} ago on this machine; the check at start {t.check}"
    busy, why = t.noise.busy(), t.check.removeprefix("re-timed: ")
    said = "timed now" + ("" if not why else ", as asked" if why == "asked for" else f" because {why}")
    if busy:
        return f"{said}, on a busy machine ({busy}): used for this run, not remembered"
    return f"{said}, {'remembered' if t.remembered else 'not remembered (the plans file could not be written)'}"


# --- timing, judged, and remembered when quiet -------------------------------------------------------------------

def _timed(key: str, facts: dict, measure, check, retime: bool, file: Path | None = None) -> tuple[dict, Timed]:
    """A remembered entry that a quick check at this start agrees with, else one timed now (remembered when quiet).

    measure(meter) → the entry's figures; check(meter, entry) → (agrees, what it timed); file: the plans file (default:
    plan_store.path() now).
    """
    entry = None if retime else plan_store.recall(key, file)
    why = "asked for" if retime else ""
    if entry is not None:
        try:
            noise, at = Noise(**entry["noise"]), float(entry["timed_at"])
            agrees, seen, busy = _checked(entry, check)
        except (KeyError, TypeError, ValueError):
            why = "the remembered entry was made before timings were judged, or is unreadable"
        else:
            if busy or agrees:
                entry.update(checked_at=time.time(), check=f"was not judged ({busy}): it stands" if busy else
                             f"agreed ({seen})")
                plan_store.remember(key, entry, file)
                return entry, Timed(at, noise, True, True, entry["check"])
            why = f"the check at start disagreed ({seen})"
    m = Meter()
    entry = {**facts, **measure(m)}
    noise = m.noise()
    entry.update(timed_at=time.time(), noise=noise.as_dict(), check=why)
    remembered = not noise.busy() and plan_store.remember(key, entry, file)
    return entry, Timed(entry["timed_at"], noise, remembered, False, f"re-timed: {why}" if why else "")


def _checked(entry: dict, check) -> tuple[bool, str, str]:
    """check(meter, entry) at this start, a disagreement confirmed once more (a near tie wobbles): whether it agrees,
    what it timed, and why the machine was busy ("" where quiet: then it judged)."""
    for _ in range(2):
        m = Meter(CHECK_REPEATS)
        agrees, seen = check(m, entry)
        busy = m.noise().busy()
        if agrees or busy:
            break
    return agrees, seen, busy


DENSE_TIMING_BYTES = 128 * 2**20  # the dense copies a timing makes at most: a 0.5B model's all took ~1 GB at once


def _timed_set(group: list, serving: torch.dtype) -> list:
    """The linears a timing runs: every one whose dense copies fit DENSE_TIMING_BYTES, else an even spread of the
    group that does (at least one). Still far more than the CPU's caches hold, so the weights come from memory as in
    serving; the same set every time for the same group, so a check compares like with like."""
    size = torch.empty((), dtype=serving).element_size()
    each = [lin.out_features * lin.in_features * size for lin in group]
    if sum(each) <= DENSE_TIMING_BYTES:
        return group
    keep = max(1, int(len(group) * DENSE_TIMING_BYTES / sum(each)))
    return group[::-(-len(group) // keep)]


def _time_quantized(m: Meter, group: list, rows: int, act: torch.dtype, serving: torch.dtype) -> float:
    """ms for the group's timed linears (_timed_set) at rows in the quantized kernel."""
    group = _timed_set(group, serving)
    x = {n: torch.randn(rows, n).to(serving) for n in {lin.in_features for lin in group}}
    return m.time(lambda: [lin.quantized(x[lin.in_features], act) for lin in group])


def _time_rows(m: Meter, group: list, rows: int, act: torch.dtype, serving: torch.dtype) -> tuple[float, float]:
    """ms for the group's timed linears (_timed_set) at rows: the quantized kernel, then their dense copies (made now
    if missing)."""
    q = _time_quantized(m, group, rows, act, serving)
    group = _timed_set(group, serving)
    for lin in group:
        lin.ensure_dense(serving)
    x = {n: torch.randn(rows, n).to(serving) for n in {lin.in_features for lin in group}}
    return q, m.time(lambda: [lin.dense(x[lin.in_features]) for lin in group])


def _measure_crossover(m: Meter, group: list, act: torch.dtype, serving: torch.dtype, max_batch_rows: int) -> dict:
    """Double the rows until the dense copies beat the quantized kernel twice in a row.

    On a busy machine it stops at the first row count timed in noise (there each one took seconds, not ms): the
    quantized kernel up to the last row count it won, for this start only.
    """
    last_win, losses, timings = 0, 0, {}
    for rows in _PROBE_ROWS:
        if rows > max_batch_rows:
            break
        q, d = _time_rows(m, group, rows, act, serving)
        timings[rows] = {"quantized_ms": round(q, 3), "dense_ms": round(d, 3)}
        last_win, losses = (rows, 0) if q <= d else (last_win, losses + 1)
        if losses == 2:
            break
        if m.noise().busy():
            return {"max_rows": last_win, "timings": timings}
    # no loss at any size probed: the quantized kernel always runs
    return {"max_rows": last_win if losses else NEVER, "timings": timings}


def _check_crossover(m: Meter, group: list, act: torch.dtype, serving: torch.dtype, entry: dict) -> tuple[bool, str]:
    """The remembered limit's decisive rows timed again: the last the quantized kernel won, the first it lost.

    Where the quantized kernel won at every row count timed, only it is timed (no dense copy is made for a check):
    at the most rows, it must still beat what the dense copies took there when the plan was made."""
    limit, timed = int(entry["max_rows"]), sorted(int(r) for r in entry["timings"])
    if limit >= NEVER and timed:
        rows = timed[-1]
        q = _time_quantized(m, group, rows, act, serving)
        then = entry["timings"].get(str(rows)) or entry["timings"][rows]  # (JSON's keys are strings)
        d = float(then["dense_ms"])
        return q <= d * (1 + MARGIN), f"{rows} rows: quantized {q:.2f} ms, dense {d:.2f} ms when timed"
    agrees, seen = True, []
    for rows in [r for r in timed if r <= limit][-1:] + [r for r in timed if r > limit][:1]:
        q, d = _time_rows(m, group, rows, act, serving)
        picked, other = (q, d) if rows <= limit else (d, q)
        agrees &= picked <= other * (1 + MARGIN)
        seen.append(f"{rows} rows: quantized {q:.2f} ms, dense {d:.2f} ms")
    return agrees, "; ".join(seen)


def _pick_act(group: list, serving: torch.dtype, facts: dict, retime: bool) -> tuple[torch.dtype, Timed | None]:
    """bf16 or the serving dtype, whichever runs the kernel faster at one row (on a few linears); kept per machine."""
    if serving == torch.bfloat16:
        return serving, None
    few = group[:4]
    # remembered like the crossovers: timed at each load, two near-equal timings flipped the pick under CPU
    # contention, and two loads of one model on one machine ran different kernels
    entry, timed = _timed(_key(few, serving, "activations"), {**facts, "what": "activations", "linears": len(few)},
                          lambda m: _measure_act(m, few, serving), lambda m, e: _check_act(m, few, serving, e), retime)
    return _ACTS[entry["act"]], timed


def _time_acts(m: Meter, few: list, serving: torch.dtype) -> dict[str, float]:
    """ms for the linears at one row with bf16 and with the serving dtype's activations."""
    x = {lin.in_features: torch.randn(1, lin.in_features) for lin in few}
    return {_dtype_name(dt): m.time(lambda dt=dt: [lin.quantized(x[lin.in_features].to(dt), dt) for lin in few])
            for dt in (torch.bfloat16, serving)}


def _measure_act(m: Meter, few: list, serving: torch.dtype) -> dict:
    """The faster activation dtype; within MARGIN of it, the serving dtype (no cast, no rounding)."""
    t = _time_acts(m, few, serving)
    act = _dtype_name(serving) if t[_dtype_name(serving)] <= min(t.values()) * (1 + MARGIN) else min(t, key=t.get)
    return {"act": act, "timings_ms": {k: round(v, 3) for k, v in t.items()}}


def _check_act(m: Meter, few: list, serving: torch.dtype, entry: dict) -> tuple[bool, str]:
    """The remembered activation dtype against the other, timed again."""
    t = _time_acts(m, few, serving)
    return t[entry["act"]] <= min(t.values()) * (1 + MARGIN), ", ".join(f"{k} {v:.2f} ms" for k, v in t.items())


def _key(group: list, serving: torch.dtype, *what) -> str:
    """What a measurement depends on: the CPU, torch and its threads, the serving dtype, the linears' shapes, our
    kernels, and what was measured (what)."""
    # the CPU and our kernel library's build (our int8 kernel is part of what was measured)
    shapes = sorted(Counter((lin.kind, lin.out_features, lin.in_features) for lin in group).items())
    facts = [kernel_library.cpu_id(), torch.__version__, torch.get_num_threads(), str(serving), shapes,
             kernel_library.library_id(), *what]
    return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()[:24]
