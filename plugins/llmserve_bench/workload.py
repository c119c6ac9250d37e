"""The seeded synthetic workload of both benches: the same flags give the same requests in either."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Item:
    prompt: list[int] | str
    max_tokens: int
    priority: int = 0
    arrival: float = 0.0  # seconds after the start


_WORDS = ("the of and to in is that for it as with was on be by at this from or have an are not but all "
          "they which one you were her there been has their if will more when would about into time than two "
          "other could only many then first some these people state may like after over such years").split()


def add_workload_arguments(p: argparse.ArgumentParser, requests: int, prompt_len: list[int],
                           output_len: list[int]) -> None:
    """The workload and output flags, with this bench's defaults."""
    p.add_argument("--requests", type=int, default=requests, help="number of requests")
    p.add_argument("--prompt-len", type=int, nargs=2, default=prompt_len, metavar=("MIN", "MAX"),
                   help="prompt lengths in tokens, uniform in [MIN, MAX]")
    p.add_argument("--output-len", type=int, nargs=2, default=output_len, metavar=("MIN", "MAX"),
                   help="max_tokens (EOS ignored), uniform in [MIN, MAX]")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="every prompt starts with the same TOKENS-token prefix")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the synthetic workload")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Item]:
    """The seeded synthetic requests: token ids below vocab_size, or words with --text-prompts."""
    rng = random.Random(args.workload_seed)
    text = getattr(args, "text_prompts", False)  # words, so any tokenizer gets the same text
    top = min(vocab_size, 50000) - 1
    draw = (lambda: rng.choice(_WORDS)) if text else (lambda: rng.randint(0, top))
    prefix = [draw() for _ in range(args.shared_prefix)]
    rate, priorities = getattr(args, "request_rate", 0.0), getattr(args, "priorities", 1)
    items, t = [], 0.0
    for _ in range(args.requests):
        prompt = prefix + [draw() for _ in range(rng.randint(*args.prompt_len))]
        item = Item(" ".join(prompt) if text else prompt, rng.randint(*args.output_len))
        # drawn only when asked for, so the other draws do not depend on these flags
        if rate > 0:
            t += rng.expovariate(rate)
            item.arrival = t
        if priorities > 1:
            item.priority = rng.randrange(priorities)
        items.append(item)
    return items


def workload_facts(args: argparse.Namespace) -> dict[str, Any]:
    """The workload flags, for a report."""
    return {k: getattr(args, k) for k in ("requests", "prompt_len", "output_len", "shared_prefix", "workload_seed")}
