"""The limit of a decode step on this machine, and how far a run's decode steps are from it.

A decode step at batch B over contexts c_1..c_B cannot take less than max(memory, compute):

    memory  = (weight bytes + KV bytes per token × (c_1 + … + c_B)) / read bandwidth
    compute = 2 × matmul params × B / GEMM rate

(shared/design/performance.md, "The limit"). The backend says what a step reads (`describe()`:
weight_bytes, matmul_params, kv_bytes_per_token); the bandwidth and the GEMM rate are measured
here, in the bench's process and on the thread that steps the engine, so with the engine's torch
thread count. Activations, norms and the sampler are left out: the bound is a floor, not a model.

A shared VM drifts by tens of percent over seconds (read bandwidth 22-40 GB/s within one process on
the 2-core dev EPYC; a GEMM probe now and then at half rate), so both are read before and after a
run and the best readings bound the steps. Each row also says what the step itself read per second
(the floor's bytes / step time), a figure that does not move with the probes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

FOOTPRINT_KEYS = ("weight_bytes", "matmul_params", "kv_bytes_per_token")
# Read bandwidth readings further apart than this (largest / smallest) say the machine changed speed during the run:
# the 2-core dev VM switches between ~50 and ~90 GB/s minutes apart, and a run whose steps ran at the slow speed
# but whose probe caught the fast one printed 1.7× the bound where steady runs printed 1.1-1.3×
UNSTEADY = 1.25


def _best_seconds(fn: Callable[[], Any], reps: int, budget: float = 0.2) -> float:
    """The fastest timed call after one untimed warm-up: at least `reps` calls, more while under `budget` seconds
    (a short call is timed many times, so that one call not delayed by another process is among them)."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    n = 0
    while n < reps or (time.perf_counter() - start < budget and n < 1000):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def cuda_seconds(fn: Callable[[], Any], reps: int) -> list[float]:
    """Seconds of each of `reps` calls after one untimed warm-up, each timed by CUDA events on the current stream
    (the host clock would time the launch, not the kernel)."""
    import torch

    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def _is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def measure_bandwidth(nbytes: int = 256 * 2**20, reps: int = 5, device: str = "cpu") -> float:
    """Memory read bandwidth in bytes/s: the best of `reps` sums over a float32 buffer far larger than any L3.

    On a CUDA device: bytes read + written by a device-to-device copy of a buffer far larger than the L2,
    the best of 20 or more timed by CUDA events (a decode step's reads stream the same way).
    """
    import torch

    if _is_cuda(device):
        src = torch.ones(nbytes // 4, device=device)
        dst = torch.empty_like(src)
        return 2 * src.nbytes / min(cuda_seconds(lambda: dst.copy_(src), max(reps, 20)))
    x = torch.ones(nbytes // 4)
    return x.nbytes / _best_seconds(x.sum, reps)


def measure_gemm_rate(rows: int, k: int, n: int, dtype: str, reps: int = 10, device: str = "cpu") -> float:
    """FLOP/s of [rows, k] × [k, n] at dtype: the better of F.linear and oneDNN's pre-packed linear (the engine's);
    on a CUDA device F.linear, timed by CUDA events."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    if _is_cuda(device):
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(rows, k, generator=g, device=device).to(dt)
        w = torch.randn(n, k, generator=g, device=device).to(dt)
        return 2 * rows * k * n / min(cuda_seconds(lambda: F.linear(x, w), max(reps, 20)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(dt)
    w = torch.randn(n, k, generator=g).to(dt)
    fns = [lambda: F.linear(x, w)]
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight"):
        try:
            packed = mkldnn._reorder_linear_weight(w, rows)
            fns.append(lambda: mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        except RuntimeError:  # no packed GEMM for this dtype here
            pass
    return 2 * rows * k * n / min(_best_seconds(f, reps) for f in fns)


@dataclass(slots=True)
class Probe:
    """What this machine did: read bandwidth and GEMM rate readings at the model's dtype, and how they were taken."""

    bandwidth_readings: list[float]  # bytes/s, in the order taken
    gemm_readings: list[float]  # FLOP/s
    gemm_shape: tuple[int, int, int]  # rows, k, n
    dtype: str
    threads: int
    seconds: float  # what the probes took
    device: str = "cpu"  # where they ran: a CUDA run's bound is its GPU's, not the host's

    @property
    def bandwidth(self) -> float:
        return max(self.bandwidth_readings)

    @property
    def gemm_rate(self) -> float:
        return max(self.gemm_readings)


def probe(dtype: str, hidden: int, batch: int, earlier: Probe | None = None, device: str = "cpu") -> Probe:
    """Read bandwidth and the GEMM rate of max(batch, 64) rows through a hidden → 4·hidden linear, added to
    `earlier` readings (whose shape it keeps).

    The compute term asks what the arithmetic units can do: with fewer rows a GEMM reuses each weight
    too little, and its "rate" is the cache's bandwidth (the memory term's business). The rate only
    grows with rows, so batches below the probe's rows get a lower compute floor: the bound stays a floor.
    """
    import torch

    t0 = time.perf_counter()
    rows = earlier.gemm_shape[0] if earlier else max(batch, 64)
    device = earlier.device if earlier else device
    bw = measure_bandwidth(device=device)
    rate = measure_gemm_rate(rows, hidden, 4 * hidden, dtype, device=device)
    before = earlier or Probe([], [], (rows, hidden, 4 * hidden), dtype, torch.get_num_threads(), 0.0, device)
    return Probe([*before.bandwidth_readings, bw], [*before.gemm_readings, rate], before.gemm_shape, dtype,
                 torch.get_num_threads(), before.seconds + time.perf_counter() - t0, device)


def step_bound(weight_bytes: int, kv_bytes_per_token: int, matmul_params: int, batch: int, context_tokens: int,
               bandwidth: float, gemm_rate: float) -> dict[str, Any]:
    """Seconds of one decode step's floor: memory, compute, the larger of the two, and which binds."""
    memory = (weight_bytes + kv_bytes_per_token * context_tokens) / bandwidth
    compute = 2 * matmul_params * batch / gemm_rate
    return {"memory_s": memory, "compute_s": compute, "bound_s": max(memory, compute),
            "binds": "memory" if memory >= compute else "compute"}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def decode_bound(steps: list[tuple[int, int, float]], footprint: dict[str, int], p: Probe) -> dict[str, Any]:
    """Per observed batch size: step p50 against the bound's p50 over the same steps, their ratio, the binding term.

    steps: (batch size, context tokens summed over the batch, step seconds) of each decode-only step.
    """
    by_batch: dict[int, list[tuple[int, float]]] = {}
    for b, ctx, sec in steps:
        by_batch.setdefault(b, []).append((ctx, sec))
    rows = []
    for b in sorted(by_batch):
        got = by_batch[b]
        bounds = [step_bound(footprint["weight_bytes"], footprint["kv_bytes_per_token"], footprint["matmul_params"],
                             b, ctx, p.bandwidth, p.gemm_rate) for ctx, _ in got]
        step = _median([sec for _, sec in got])
        memory, compute = _median([x["memory_s"] for x in bounds]), _median([x["compute_s"] for x in bounds])
        bound = max(memory, compute)
        rows.append({"batch": b, "steps": len(got), "context_mean": sum(c for c, _ in got) / len(got) / b,
                     "step_p50_ms": step * 1e3, "bound_ms": bound * 1e3, "memory_ms": memory * 1e3,
                     "compute_ms": compute * 1e3, "ratio": step / bound,
                     "binds": "memory" if memory >= compute else "compute",
                     "read_gbs": memory * p.bandwidth / step / 1e9})  # the floor's bytes over the step's time
    bw = p.bandwidth_readings
    return {"probe": {**asdict(p), "bandwidth_gbs": p.bandwidth / 1e9, "gemm_gflops": p.gemm_rate / 1e9,
                      "bandwidth_readings_gbs": [x / 1e9 for x in bw],
                      "gemm_readings_gflops": [x / 1e9 for x in p.gemm_readings],
                      "unsteady": len(bw) > 1 and max(bw) > UNSTEADY * min(bw)},
            "footprint": {k: footprint[k] for k in FOOTPRINT_KEYS}, "by_batch": rows}


def wants_bound(describe: dict[str, Any], skip: bool = False) -> str | None:
    """Why no bound can be computed for this backend (None: it can)."""
    if skip:
        return "--no-bound"
    if not all(k in describe for k in FOOTPRINT_KEYS):
        return "the backend does not say what a step reads"
    return None


def probe_before(describe: dict[str, Any], max_batch: int, skip: bool = False) -> Probe | None:
    """The first readings, before the run (None when there will be no bound)."""
    if wants_bound(describe, skip):
        return None
    return probe(describe["dtype"], describe["hidden_size"], max_batch, device=describe.get("device", "cpu"))


def bound_report(steps: list[tuple[int, int, float]], describe: dict[str, Any], skip: bool = False,
                 before: Probe | None = None) -> dict[str, Any]:
    """decode_bound of a run's decode-only steps with readings taken now and `before`, or {"skipped": why}."""
    why = wants_bound(describe, skip) or (None if steps else "no decode-only steps")
    if why:
        return {"skipped": why}
    p = probe(describe["dtype"], describe["hidden_size"], max(b for b, _, _ in steps), before,
              device=describe.get("device", "cpu"))
    return decode_bound(steps, describe, p)


def print_decode_bound(r: dict[str, Any], max_rows: int = 8) -> None:
    """The bound table: the most frequent batch sizes (all of them are in --json)."""
    if "skipped" in r:
        print(f"decode step vs bound: skipped ({r['skipped']})")
        return
    p, f = r["probe"], r["footprint"]
    bws = ", ".join(f"{x:.1f}" for x in p["bandwidth_readings_gbs"])
    rates = ", ".join(f"{x:.0f}" for x in p["gemm_readings_gflops"])
    print(f"decode step vs bound: read bandwidth {p['bandwidth_gbs']:.1f} GB/s (best of {bws}), GEMM "
          f"{p['gemm_gflops']:.0f} GFLOP/s (best of {rates}; {p['dtype']}, {'×'.join(map(str, p['gemm_shape']))}, "
          f"{p['threads']} threads{'' if p.get('device', 'cpu') == 'cpu' else ', on ' + p['device']}; "
          f"probes {p['seconds']:.2f} s); "
          f"weights {f['weight_bytes'] / 1e6:.1f} MB, {f['matmul_params'] / 1e6:.1f} M matmul params, "
          f"KV {f['kv_bytes_per_token'] / 1024:.1f} KiB/token")
    rows = sorted(sorted(r["by_batch"], key=lambda x: -x["steps"])[:max_rows], key=lambda x: x["batch"])
    print("   batch  steps  ctx/seq  step p50 ms  bound ms  (memory / compute)  step/bound  binds    step read GB/s")
    for x in rows:
        print(f"  {x['batch']:6d} {x['steps']:6d} {x['context_mean']:8.0f} {x['step_p50_ms']:12.2f} "
              f"{x['bound_ms']:9.2f}  ({x['memory_ms']:.2f} / {x['compute_ms']:.2f}) {x['ratio']:11.2f}  "
              f"{x['binds']:8s} {x['read_gbs']:.1f}")
    if len(r["by_batch"]) > len(rows):
        print(f"  ({len(r['by_batch']) - len(rows)} more batch sizes with fewer steps in --json)")
    if p.get("unsteady"):
        print(f"  note: the read bandwidth moved between the probes ({bws} GB/s): the machine changed speed during "
              f"the run, and the steps may have run at the slower; step/bound is against the best reading, so "
              f"it overstates the gap (run again)")
