"""`llmserve plan show|retime|forget`: the quantized kernels' plans timed on this machine (kernel_plan.py), as the
plans file holds them (plan_store.py). show and forget import no torch; retime loads the configured model."""

from __future__ import annotations

import json
import time

from llmserve.config_args import add_config_arguments, config_from_args
from llmserve.errors import ConfigError
from llmserve_torch import plan_store


def add_command(subparsers) -> None:
    """`llmserve plan` and its three commands."""
    plan = subparsers.add_parser("plan", help="the quantized kernels' plans timed on this machine: show, retime, "
                                              "forget")
    psub = plan.add_subparsers(dest="plan_command", metavar="PLAN", required=True, action=type(subparsers))
    p = psub.add_parser("show", help="each remembered plan: its model, choice, age, how quietly it was timed, its "
                                     "last check")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=show)
    p = psub.add_parser("retime", help="time the configured model's plan now (remembered only if the machine was "
                                       "quiet; exit status 1 if not)")
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=retime)
    p = psub.add_parser("forget", help="forget every plan: each model's next start times its own")
    p.set_defaults(func=forget)


def show(args) -> int:
    """Print the plans file: each entry's model, kind, choice, age, noise and last check."""
    now, known = time.time(), plan_store.entries()
    if args.json:
        print(json.dumps({"file": str(plan_store.path()), "plans": {
            k: {**e, "age_s": _age_s(now, e.get("timed_at")), "checked_age_s": _age_s(now, e.get("checked_at"))}
            for k, e in known.items()}}, indent=1))
        return 0
    judged = {k: e for k, e in known.items() if "timed_at" in e}
    print(f"{plan_store.path()}: {len(judged)} plan{'s' * (len(judged) != 1)}"
          f"{' (each model times its plan at its next start)' if not known else ''}")
    for key, e in sorted(judged.items(), key=lambda ke: (str(ke[1].get("model")), str(ke[1].get("kind")),
                                                         str(ke[1].get("what")))):
        print(f"{e.get('model') or '(model not recorded)'}\n  {_choice(e)}")
        print(f"    {_when(now, e)}")
        if e.get("timings"):
            print("    ms quantized / dense: " + ", ".join(f"{r} rows {t.get('quantized_ms')} / {t.get('dense_ms')}"
                                                          for r, t in e["timings"].items()))
        print(f"    torch {e.get('torch', '?')}, {e.get('threads', '?')} threads, {e.get('library', '?')}; key {key}")
    if len(known) > len(judged):
        print(f"and {len(known) - len(judged)} older entries, timed before timings were judged: never used again "
              f"(a start that needs one times it afresh); `llmserve plan forget` drops them")
    return 0


def _age_s(now: float, at) -> int | None:
    return round(now - at) if isinstance(at, (int, float)) else None


def _ago(now: float, at) -> str:
    s = _age_s(now, at)
    return "at an unrecorded time" if s is None else f"{plan_store.age(s)} ago"


def _choice(e: dict) -> str:
    """What the entry decided, and for what."""
    if e.get("what") == "activations":
        return (f"{e.get('kind')} activations for {e.get('serving')} serving ({e.get('linears')} linears): "
                f"{e.get('act')} ({', '.join(f'{k} {v} ms' for k, v in e.get('timings_ms', {}).items())})")
    rows = e.get("max_rows")
    limit = "all rows" if isinstance(rows, int) and rows >= 1 << 30 else f"up to {rows} rows"
    return (f"{e.get('kind')} crossover ({e.get('linears')} linears, {e.get('serving')} serving, "
            f"{e.get('activations')} activations, steps up to {e.get('max_batch_rows')} rows): quantized kernel "
            f"{limit}, dense copies above")


def _when(now: float, e: dict) -> str:
    """When it was timed and how quietly, and what the last start's check found."""
    n = e.get("noise") or {}
    noise = ", ".join(part for part in (
        f"repeats {n['spread']:.0%} apart" if isinstance(n.get("spread"), (int, float)) else "",
        f"threads waited for a CPU {n['waited']:.0%} of the time" if isinstance(n.get("waited"), (int, float)) else "",
        f"load {n['load']:.2f} a CPU" if isinstance(n.get("load"), (int, float)) else "") if part)
    said = f"timed {_ago(now, e.get('timed_at'))}" + (f" ({noise})" if noise else "")
    if e.get("checked_at"):
        said += f"; checked {_ago(now, e.get('checked_at'))}: {e.get('check')}"
    return said


def retime(args) -> int:
    """Load the configured model with its plan timed afresh; print what was timed and whether it was remembered."""
    cfg = config_from_args(args)
    if cfg.backend.name != "torch":
        raise ConfigError(f"plan retime: kernel plans belong to the torch backend; this configuration's backend is "
                          f"{cfg.backend.name!r}")
    cfg.backend.options = {**cfg.backend.options, "quant_rows": "retime"}
    from llmserve_torch.backend import TorchBackend

    backend = TorchBackend(cfg)
    kernels = backend.loaded.kernels.describe() if backend.loaded.kernels else {}
    backend.shutdown()
    if args.json:
        print(json.dumps({"model": backend.loaded.source, "kernels": kernels}, indent=1))
    elif not kernels:
        print(f"{backend.loaded.source}: no quantized linears, no plan")
    noisy = False
    for kind, k in kernels.items():
        timed = [t for t in (k.get("activations_timed"), k.get("timed")) if t]
        noisy |= any(t["noisy"] for t in timed)
        if args.json:
            continue
        rows = k["quantized_up_to_rows"]
        print(f"{kind}: quantized kernel {'for all rows' if rows is None else f'up to {rows} rows'}, "
              f"{k['activations']} activations ({k['how']})")
        for t in timed:
            print(f"    on a busy machine ({t['noisy']}): used for that start only, not remembered" if t["noisy"] else
                  f"    quiet (repeats {t['noise']['spread']:.0%} apart): "
                  f"{'remembered' if t['remembered'] else 'not remembered: the plans file could not be written'}")
    if noisy and not args.json:
        print("run `llmserve plan retime` again when the machine is quiet; until then each start times it again")
    return 1 if noisy else 0


def forget(args) -> int:
    """Delete the plans file."""
    try:
        n = plan_store.forget()
    except OSError as e:
        raise ConfigError(f"plan forget: could not delete {plan_store.path()}: {e}") from None
    print(f"forgot {n} plan{'s' * (n != 1)} ({plan_store.path()}); each model times its plan at its next start")
    return 0
