"""The kernel plan cannot go stale: a timing on a busy machine is used for its start and never remembered, a
remembered plan is checked at each start and timed again where the check disagrees, and `llmserve plan` shows,
re-times and forgets what is remembered (issue 35.3)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from llmserve.cli import main
from llmserve_torch import kernel_library, kernel_plan, plan_store
from llmserve_torch.kernel_plan import KernelPlan, Noise, plan_kernels
from llmserve_torch.models.common import Linear
from llmserve_torch.plan_tuner import PlanTuner
from llmserve_torch.quant import QuantLinear, quantize_int4

QUIET, BUSY = Noise(0.02, 0.01, 0.3), Noise(1.5, 0.5, 2.0)


@pytest.fixture(autouse=True)
def plans(tmp_path, monkeypatch):
    """A plans file of the test's own (the kernels loaded first from the usual cache: never compiled into tmp)."""
    kernel_library.unavailable()
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path / "quant-plans.json"


def _lins(serving: torch.dtype, dense: bool = True, n: int = 2) -> list[QuantLinear]:
    w = torch.from_numpy(np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32) * 0.05)
    return [QuantLinear(quantize_int4(w), None, None, Linear(w.to(serving), None, pack=False) if dense else None)
            for _ in range(n)]


class Machine:
    """Timings by row count (quantized ms, dense ms) and by activation dtype, the noise every meter reports, and
    the row counts timed."""

    def __init__(self, monkeypatch, rows: dict | None = None, acts: dict | None = None):
        self.rows, self.acts, self.noise, self.timed = rows or {}, acts or {}, QUIET, []
        monkeypatch.setattr(kernel_plan, "_time_rows", lambda m, group, rows, act, serving: self._row(rows))
        monkeypatch.setattr(kernel_plan, "_time_quantized", lambda m, group, rows, act, serving: self._row(rows)[0])
        monkeypatch.setattr(kernel_plan, "_time_acts", lambda m, few, serving: dict(self.acts))
        monkeypatch.setattr(kernel_plan.Meter, "noise", lambda m: self.noise)

    def _row(self, rows: int) -> tuple[float, float]:
        self.timed.append(rows)
        return self.rows[rows]

    def start(self, serving=torch.bfloat16, limit="auto", **kw):
        """One load's plan of the int4 linears (steps of up to 64 rows)."""
        self.timed = []
        plan = KernelPlan()
        plan_kernels(plan, _lins(serving, **kw), serving, max_batch_rows=64, limit=limit, model="tiny")
        return plan.kinds["int4"]


# the quantized kernel wins up to 4 rows
UP_TO_4 = {1: (1.0, 3.0), 2: (1.2, 3.0), 4: (2.0, 3.0), 8: (4.0, 3.0), 16: (8.0, 4.0)}


@contextlib.contextmanager
def busy_cores():
    """A busy loop on every core this process may use (each ends by itself within 60 s, and is killed on the way
    out)."""
    spin = "import time\nprint(flush=True)\nend = time.time() + 60\nwhile time.time() < end:\n    pass\n"
    procs = []
    try:
        for _ in range(len(os.sched_getaffinity(0))):
            procs.append(subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE))
        for p in procs:
            p.stdout.readline()  # it is spinning
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_plan_timed_beside_busy_cores_is_not_kept_and_a_quiet_start_times_it_again(plans):
    """The issue's done-when, on the real kernels and clock: float32 serving, so both the activation dtype and the
    crossover are timed."""
    with busy_cores():
        plan = KernelPlan()
        plan_kernels(plan, _lins(torch.float32), torch.float32, max_batch_rows=64, model="tiny")
    busy = plan.kinds["int4"]
    for timed in (busy.act_timed, busy.timed):
        assert timed.noise.busy() and not timed.remembered and not timed.recalled
    assert not plans.exists()  # nothing written: the next start cannot recall it
    assert plan.describe()["int4"]["timed"]["noisy"]  # /stats says so

    quiet = KernelPlan()
    plan_kernels(quiet, _lins(torch.float32), torch.float32, max_batch_rows=64, model="tiny")
    kp = quiet.kinds["int4"]
    assert kp.how == "measured"  # timed again, not recalled
    for timed in (kp.act_timed, kp.timed):
        assert not timed.recalled
        # (other programs share this machine: where they were busy meanwhile this start is not kept either)
        assert timed.remembered == (not timed.noise.busy())
    assert plans.exists() == (kp.timed.remembered or kp.act_timed.remembered)


def _deferred_start(m, plan=None):
    """A start that serves first (defer=True): bf16, the int4 linears."""
    plan = plan or KernelPlan()
    m.timed = []
    plan_kernels(plan, _lins(torch.bfloat16), torch.bfloat16, max_batch_rows=64, model="tiny", defer=True)
    return plan


def test_a_start_with_nothing_remembered_serves_the_safe_plan_and_tunes_when_idle(monkeypatch, plans):
    m = Machine(monkeypatch, {r: (1.0, 3.0) for r in (1, 2, 4, 8, 16, 32, 64)})
    plan = _deferred_start(m)
    kp = plan.kinds["int4"]
    assert m.timed == [] and kp.deferred and kp.max_rows >= 64 and "int4" in plan.pending  # nothing timed at start
    assert plan.describe()["int4"]["deferred"] and not plans.exists()
    m.noise = BUSY  # the first idle moment was not quiet: nothing kept, still pending
    assert kernel_plan.tune_deferred(plan)[0].startswith("int4: timed on a busy machine")
    assert "int4" in plan.pending and not plans.exists()
    m.noise = QUIET
    tuner = PlanTuner(plan, idle=lambda: 60.0)
    tuner.start()
    tuner._thread.join(10)
    assert not plan.pending and plan.kinds["int4"].how == "measured" and plan.kinds["int4"].timed.remembered
    assert _deferred_start(m).kinds["int4"].how == "measured earlier on this machine"  # the next start recalls it


def test_the_tuner_times_only_while_holding_the_backends_step_lock(monkeypatch, plans):
    """Our kernels' thread team runs one call at a time: a background timing holds the lock every step takes."""
    import threading

    m = Machine(monkeypatch, {r: (1.0, 3.0) for r in (1, 2, 4, 8, 16, 32, 64)})
    steps = threading.Lock()
    held = []
    real = m._row
    m._row = lambda rows: held.append(steps.locked()) or real(rows)
    plan = _deferred_start(m)
    tuner = PlanTuner(plan, idle=lambda: 60.0, steps=steps)
    tuner.start()
    tuner._thread.join(10)
    assert held and all(held) and not plan.pending and not steps.locked()


def test_a_deferred_timing_where_dense_copies_win_keeps_the_safe_plan_until_the_next_start(monkeypatch, plans):
    m = Machine(monkeypatch, UP_TO_4)
    plan = _deferred_start(m)
    (said,) = kernel_plan.tune_deferred(plan)
    kp = plan.kinds["int4"]
    assert said == "int4: dense copies win past 4 rows; remembered for the next start"
    assert kp.max_rows >= 64 and "next start" in kp.how and not plan.pending  # this run keeps the safe plan
    lins = _lins(torch.bfloat16)
    later = KernelPlan()
    plan_kernels(later, lins, torch.bfloat16, max_batch_rows=64, model="tiny", defer=True)
    assert later.kinds["int4"].max_rows == 4 and all(lin.dense is not None for lin in lins)


def test_a_quiet_plan_is_remembered_and_the_next_start_checks_only_its_decisive_rows(monkeypatch, plans):
    m = Machine(monkeypatch, UP_TO_4)
    first = m.start()
    assert first.max_rows == 4 and first.how == "measured" and m.timed == [1, 2, 4, 8, 16]
    assert first.timed.remembered and not first.timed.recalled
    (entry,) = json.loads(plans.read_text()).values()
    assert entry["max_rows"] == 4 and entry["model"] == "tiny" and entry["kind"] == "int4"
    assert entry["noise"] == QUIET.as_dict() and abs(entry["timed_at"] - time.time()) < 60

    second = m.start()
    assert m.timed == [4, 8]  # the last row count the quantized kernel won and the first it lost, nothing more
    assert second.how == "measured earlier on this machine" and second.max_rows == 4
    assert second.timed.recalled and second.timed.check.startswith("agreed (4 rows: quantized 2.00 ms")
    assert second.timings == first.timings
    stats = KernelPlan()
    stats.kinds["int4"] = second
    assert stats.describe()["int4"]["timed"]["age_s"] >= 0 and stats.describe()["int4"]["timed"]["recalled"]


def test_a_start_whose_check_disagrees_times_the_plan_again(monkeypatch, plans):
    m = Machine(monkeypatch, UP_TO_4)
    m.start()
    m.rows = {**UP_TO_4, 4: (4.5, 3.0)}  # the dense copies now win at 4 rows, by 50 %
    kp = m.start()
    assert m.timed == [4, 8, 4, 8, 1, 2, 4, 8]  # checked, the disagreement confirmed, then timed afresh
    assert kp.how == "measured" and kp.max_rows == 2 and not kp.timed.recalled
    assert kp.timed.check.startswith("re-timed: the check at start disagreed (4 rows: quantized 4.50 ms")
    (entry,) = json.loads(plans.read_text()).values()
    assert entry["max_rows"] == 2


def test_a_plan_where_the_quantized_kernel_always_wins_is_checked_without_a_dense_copy(monkeypatch, plans):
    always = {r: (1.0, 3.0) for r in (1, 2, 4, 8, 16, 32, 64)}
    m = Machine(monkeypatch, always)
    assert m.start().max_rows >= 64
    plan = KernelPlan()
    lins = [QuantLinear(quantize_int4(torch.randn(64, 128)), None, plan, densify=lambda w: pytest.fail("made"))
            for _ in range(2)]  # the linears the first start timed (a plan is remembered for their shapes)
    m.timed = []
    plan_kernels(plan, lins, torch.bfloat16, max_batch_rows=64, limit="auto", model="tiny")
    # the quantized kernel at the most rows only, against what the dense copies took there when it was timed
    assert m.timed == [64] and plan.kinds["int4"].timed.recalled and all(lin.dense is None for lin in lins)
    assert plan.kinds["int4"].timed.check.startswith("agreed (64 rows: quantized 1.00 ms, dense 3.00 ms when timed")
    m.rows = {**always, 64: (4.0, 3.0)}  # now slower than the dense copies were: timed afresh (dense copies made)
    kp = m.start()
    assert not kp.timed.recalled and kp.timed.check.startswith("re-timed: the check at start disagreed")


def test_a_check_within_the_margin_or_on_a_busy_machine_keeps_the_remembered_plan(monkeypatch, plans):
    m = Machine(monkeypatch, UP_TO_4)
    m.start()
    m.rows = {**UP_TO_4, 4: (3.5, 3.0)}  # 17 % the other way: within the noise, no disagreement
    kp = m.start()
    assert m.timed == [4, 8] and kp.timed.recalled and kp.max_rows == 4
    m.rows, m.noise = {**UP_TO_4, 4: (9.0, 3.0)}, BUSY  # a clear disagreement, timed on a busy machine
    kp = m.start()
    assert m.timed == [4, 8] and kp.timed.recalled and kp.max_rows == 4
    assert kp.timed.check.startswith("was not judged (repeats 150% apart, threads waited for a CPU 50% of the time)")


def test_a_noisy_plan_serves_its_start_stops_early_and_is_never_written(monkeypatch, plans):
    m = Machine(monkeypatch, UP_TO_4)
    m.noise = BUSY
    kp = m.start()
    assert m.timed == [1]  # busy from the first row count on: no more timing at this start
    assert kp.max_rows == 1 and kp.how == "measured" and not kp.timed.remembered
    assert not plans.exists()
    m.start()
    assert m.timed == [1]  # the next start times it again
    m.noise = QUIET
    assert m.start().max_rows == 4 and m.timed == [1, 2, 4, 8, 16] and plans.exists()


def test_an_entry_from_before_timings_were_judged_is_timed_again(monkeypatch, plans):
    m = Machine(monkeypatch, UP_TO_4)
    m.start()
    old = {k: {"max_rows": 256, "timings": e["timings"]} for k, e in json.loads(plans.read_text()).items()}
    plans.write_text(json.dumps(old))  # as the plans file held them before
    kp = m.start()
    assert m.timed == [1, 2, 4, 8, 16] and kp.max_rows == 4
    assert kp.timed.check == "re-timed: the remembered entry was made before timings were judged, or is unreadable"


def test_quant_rows_retime_times_a_remembered_plan_afresh(monkeypatch, plans):
    m = Machine(monkeypatch, UP_TO_4)
    m.start()
    kp = m.start(limit="retime")
    assert m.timed == [1, 2, 4, 8, 16] and kp.timed.check == "re-timed: asked for" and kp.timed.remembered
    assert m.start(limit=3).how == "asked for" and m.timed == []


def test_the_activation_dtype_is_the_serving_one_unless_the_other_wins_beyond_the_noise(monkeypatch, plans):
    """A float32 model's kernels take bf16 or float32 activations: 31.98 vs 31.96 ms once flipped the pick under
    contention, and two loads of one model ran different kernels."""
    m = Machine(monkeypatch, acts={"bfloat16": 1.0, "float32": 1.05})
    kp = m.start(torch.float32, dense=False)
    assert kp.act == torch.float32 and kp.act_timed.remembered and kp.how == "no dense copy"
    m.acts = {"bfloat16": 1.0, "float32": 1.15}  # checked at the next start: still within the noise
    kp = m.start(torch.float32, dense=False)
    assert kp.act == torch.float32 and kp.act_timed.recalled
    m.acts = {"bfloat16": 1.0, "float32": 2.0}  # float32 now clearly slower: timed again
    kp = m.start(torch.float32, dense=False)
    assert kp.act == torch.bfloat16 and not kp.act_timed.recalled and "disagreed" in kp.act_timed.check
    assert m.start(torch.float32, dense=False).act == torch.bfloat16  # and remembered so
    m.acts = {"bfloat16": 1.0, "float32": 1.0}
    assert not m.start(torch.float32, dense=False, n=3).act_timed.recalled  # other linears: another measurement


def test_noise_is_judged_by_spread_by_waiting_for_a_cpu_or_without_scheduler_figures_by_load():
    assert not Noise(0.1, 0.1, 3.0).busy()  # the load average lags and counts other users: only a fallback
    assert Noise(1.2, 0.0, 0.1).busy() == "repeats 120% apart" and not Noise(0.5, 0.0, 0.1).busy()
    assert Noise(0.0, 0.25, 0.1).busy() == "threads waited for a CPU 25% of the time"
    assert Noise(0.0, None, 1.5).busy() == "load average 1.50 a CPU" and not Noise(0.0, None, 0.5).busy()


def test_the_meter_times_the_best_of_its_repeats_per_call():
    calls = []
    m = kernel_plan.Meter(repeats=3)
    ms = m.time(lambda: calls.append(1))
    assert 0 < ms < 1 and len(calls) > 4  # a call this short is repeated to fill a sample
    assert m.noise().spread == m.spread >= 0


def test_a_timing_disturbed_for_a_moment_is_taken_once_more(monkeypatch):
    monkeypatch.setattr(kernel_plan, "SAMPLE_S", 0)  # a sample is one call
    calls = []

    def fn():  # the warm-up, then three repeats of which two are slowed by a moment's burst, then quiet ones
        calls.append(1)
        time.sleep(0.1 if len(calls) in (2, 3) else 0.02)

    m = kernel_plan.Meter(repeats=3)
    ms = m.time(fn)
    assert len(calls) == 7 and 20 <= ms < 100 and m.spread < kernel_plan.MAX_SPREAD


def test_plan_show_retime_and_forget(monkeypatch, plans, capsys):
    m = Machine(monkeypatch, UP_TO_4, {"bfloat16": 1.0, "float32": 1.0})
    assert main(["plan", "show"]) == 0
    assert f"{plans}: 0 plans" in capsys.readouterr().out
    # the embedded model, quantized: its start times the plan (as `llmserve serve` would), and /stats shows it
    argv = ["--model", "embedded", "--quantization", "int8", "--dtype", "float32", "--log-level", "warning"]
    assert main(["plan", "retime", *argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    kernels = got["kernels"]["int8"]
    assert got["model"] == "embedded" and kernels["how"] == "measured" and kernels["quantized_up_to_rows"] == 4
    assert kernels["timed"]["remembered"] and not kernels["timed"]["noisy"] and kernels["timed"]["age_s"] >= 0
    assert kernels["activations_timed"]["check"] == "re-timed: asked for"

    assert main(["plan", "show"]) == 0
    out = capsys.readouterr().out
    assert f"{plans}: 2 plans" in out and "embedded\n  int8 crossover (17 linears, float32 serving" in out
    assert "quantized kernel up to 4 rows" in out and "int8 activations for float32 serving" in out
    assert "s ago (repeats 2% apart, threads waited for a CPU 1% of the time, load 0.30 a CPU)" in out
    assert main(["plan", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert {e["what"] for e in shown["plans"].values()} == {"crossover", "activations"}
    assert all(e["age_s"] >= 0 for e in shown["plans"].values())

    m.noise = BUSY
    assert main(["plan", "retime", *argv]) == 1  # timed, but not kept: the remembered plans stay
    out = capsys.readouterr().out
    assert "on a busy machine (repeats 150% apart" in out and "not remembered" in out
    assert len(plan_store.entries()) == 2

    assert main(["plan", "forget"]) == 0
    assert "forgot 2 plans" in capsys.readouterr().out and not plans.exists()


def test_a_timing_makes_dense_copies_of_a_bounded_spread_of_linears(monkeypatch):
    """The timing's transient dense copies stay under DENSE_TIMING_BYTES (a 0.5B model's all took ~1 GB), spread over
    the group, the same set each time."""
    lins = _lins(torch.bfloat16, dense=False, n=10)  # 64 x 128 each: 16 KiB of bf16
    assert kernel_plan._timed_set(lins, torch.bfloat16) == lins
    monkeypatch.setattr(kernel_plan, "DENSE_TIMING_BYTES", 40 * 1024)  # room for two and a half
    few = kernel_plan._timed_set(lins, torch.bfloat16)
    assert few == lins[::5] and few == kernel_plan._timed_set(lins, torch.bfloat16)
    assert sum(lin.out_features * lin.in_features * 2 for lin in few) <= 40 * 1024
