"""Shortest-job-first: admit the request that asks for the fewest tokens (prompt + max_tokens) first.

Everything but the order is inherited from the default continuous-batching scheduler (token
budget, chunked prefill, preemption): `order_key` is the one method a policy overrides.
"""

from __future__ import annotations

from llmserve.request import Request
from llmserve_scheduler import ContinuousScheduler


def requested_tokens(request: Request) -> int:
    """The most tokens this sequence can occupy: its prompt plus its max_tokens (capped by the context)."""
    if request.max_total_tokens:  # set by the engine: min(context, prompt + max_tokens)
        return request.max_total_tokens
    max_tokens = request.sampling.max_tokens or 0
    return len(request.prompt_token_ids) + max_tokens


class ShortestJobFirstScheduler(ContinuousScheduler):
    """Continuous batching whose waiting queue is ordered by requested tokens, smallest first.

    Short requests no longer wait behind long ones, which lowers mean latency when lengths
    differ; the price is that a long request can wait as long as shorter ones keep arriving.
    When memory runs out the running sequence with the largest request is preempted first.
    """

    policy = "sjf"

    def __init__(self, *args, respect_priority: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.respect_priority = respect_priority
        # a priority is a 400 unless this policy uses it (the base class checks uses_priority)
        self.uses_priority = respect_priority
        if respect_priority:
            self.policy = "sjf+priority"

    def order_key(self, request: Request) -> tuple:
        """(priority?, requested tokens, arrival): smaller runs first; arrival breaks ties (FCFS)."""
        key = (requested_tokens(request), request.arrival_seq, request.index)
        if self.respect_priority:
            return (request.priority, *key)
        return key
