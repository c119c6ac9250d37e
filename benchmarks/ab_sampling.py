#!/usr/bin/env python
"""Sampled decoding on CPU: the kernel library's sampler (its top-k/top-p/min-p filter and keyed race; in the fused
call, sampled rows running ahead as greedy ones do, filtered by the head), against the torch paths it replaced (torch's
uniform draws, a torch sort of the whole row, one forward a step for any sampled row), alternated in one engine.

Each round decodes `--output-len` tokens of `--concurrency` requests for every sampling case (greedy, temperature
1, temperature 0.7 with top_p 0.9, temperature 1 with top_k 40), under each path in the order kernel torch torch
kernel, so a change of the VM's state falls on both. Prints each case's milliseconds a forward (a token of each
sequence; median over rounds) and kernel / torch.

    python benchmarks/ab_sampling.py                 # c = 1, 3 rounds
    python benchmarks/ab_sampling.py -c 8 --json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from profile_step import build_engine, engine_arguments, run_cli  # noqa: E402

CASES = {"greedy": {"temperature": 0.0}, "temperature 1": {"temperature": 1.0},
         "t 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9}, "t 1, top_k 40": {"temperature": 1.0, "top_k": 40}}


@contextlib.contextmanager
def torch_paths(sampler):
    """The sampler as it drew before the kernel's: torch's uniforms, torch's sort of every filtered row (and without
    the kernel, no sampled row runs ahead: Sampler.race_temperatures)."""
    import llmserve_torch.sampling as sampling

    race, sampler.keyed_sample = sampler.keyed_sample, None
    try:
        with mock.patch.object(sampling, "_sort_descending", lambda x: x.sort(dim=-1, descending=True)):
            yield
    finally:
        sampler.keyed_sample = race


def run(args) -> dict:
    import torch

    from llmserve.request import SamplingParams
    from llmserve_bench.report import machine_info, progress_bar

    engine = build_engine(args, args.num_scheduler_steps)
    sampler = engine.backend.sampler
    if sampler.keyed_sample is None:
        raise SystemExit("the kernel library did not build here: nothing to compare")
    g = torch.Generator().manual_seed(args.seed)

    def decode(kw: dict) -> float:
        """Milliseconds a forward of the concurrency's requests (a token each), over their output."""
        for _ in range(args.concurrency):
            prompt = torch.randint(0, engine.backend.vocab_size, (args.prompt_len,), generator=g).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False,
                                                      **kw))
        start, steps = None, 0
        while engine.num_running + engine.num_waiting:
            so = engine.step()
            if so.metrics is not None and so.metrics.num_prefill_tokens == 0:
                if start is None:
                    start = time.perf_counter()
                else:
                    steps += so.metrics.num_forwards
        return (time.perf_counter() - start) / steps * 1e3

    got: dict[str, dict[str, list[float]]] = {c: {"kernel": [], "torch": []} for c in CASES}
    bar = progress_bar(args, args.rounds * 4, "ab sampling")
    for _ in range(args.rounds):
        for path in ("kernel", "torch", "torch", "kernel"):
            bar.update()
            with torch_paths(sampler) if path == "torch" else contextlib.nullcontext():
                for case, kw in CASES.items():
                    if case != "greedy" or path == "kernel":
                        got[case][path].append(decode(kw))
    bar.close()
    engine.shutdown()
    med = statistics.median
    cases = {c: {p: med(v) for p, v in paths.items() if v} for c, paths in got.items()}
    return {"concurrency": args.concurrency, "rounds": args.rounds, "output_len": args.output_len,
            "num_scheduler_steps": args.num_scheduler_steps,
            "machine": machine_info(), "ms_per_step": cases,
            "kernel_over_torch": {c: v["kernel"] / v["torch"] for c, v in cases.items() if "torch" in v}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    engine_arguments(ap, prompt_len=96)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-scheduler-steps", type=int, default=8,
                    help="forwards a step where the batch can run ahead (the engine's default: 8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    return run_cli(ap, argv, run, print_report)


def print_report(r: dict) -> None:
    """One line a case: each path's milliseconds a forward, and their ratio."""
    print(f"c = {r['concurrency']}, {r['output_len']} tokens a request, num_scheduler_steps "
          f"{r['num_scheduler_steps']}, medians of {r['rounds'] * 2} runs a path:")
    for case, v in r["ms_per_step"].items():
        line = f"  {case:18s} kernel {v['kernel']:7.3f} ms"
        if "torch" in v:
            line += f"   torch {v['torch']:7.3f} ms   kernel / torch {r['kernel_over_torch'][case]:.3f}"
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
