"""The data that crosses the scheduler → backend → scheduler boundary each step.

The scheduler returns a SchedulerOutput; the backend reads it and returns a ModelOutput, which
goes back to the scheduler's update_from_output. Neither side reaches into the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.request import Logprob, SamplingParams


@dataclass(frozen=True, slots=True)
class Forwards:
    """Several forwards a step: what a backend runs in one execute() on a batch of decodes, each forward on the
    tokens the one before sampled (ModelBackend.forwards; Scheduler.limit_forwards caps its offers by it).

    The scheduler offers a batch SchedulerOutput.num_steps forwards (its blocks reserved for all of them); the
    backend runs what it can and returns the later forwards' tokens in ModelOutput.more_token_ids, handing each
    forward's tokens to ModelBackend.on_forward as they exist; the engine replays them one forward at a time."""

    most: int = 1  # the most forwards one execute() runs (1: one a step)
    max_rows: int | None = None  # the most sequences a batch may hold and still run several (None: any)

    def cap(self, steps: int, rows: int) -> int:
        """The forwards to offer a batch of `rows` decodes that could run `steps`: at most `most`, 1 past max_rows."""
        if self.max_rows is not None and rows > self.max_rows:
            return 1
        return max(1, min(steps, self.most))


@dataclass(slots=True)
class ScheduledRequest:
    """One sequence's share of a step: compute token_ids[num_computed_tokens : +num_new_tokens]."""

    request_id: str
    token_ids: list[int]  # every token of the sequence so far (a shared reference: read only)
    num_computed_tokens: int  # tokens whose K/V are already in the cache
    num_new_tokens: int  # tokens to compute this step (a prefill chunk, or 1 for a decode)
    block_table: list[int]  # the sequence's KV blocks in order (a shared reference: read only)
    sampling: SamplingParams
    do_sample: bool  # sample the next token from the last position's logits
    num_prompt_tokens: int
    # the number of output tokens generated so far; with a seed, sampling randomness is a pure
    # function of (seed, this) so batching and preemption cannot change the result
    num_output_tokens: int = 0
    # an embedding sequence's pooling (llmserve.pooling.POOLING_TYPES): the backend returns the sum of this chunk's
    # final-norm hidden states over pooling.pooled_rows in ModelOutput.pooled (do_sample is False); None: generation
    pooling: str | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the backend needs for one forward pass over a flattened, mixed batch."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    block_size: int = 16
    # sequences that ended or were preempted since the last batch: drop any per-sequence state
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # constraints (llmserve/constraints.py): an int32 tensor [len(bitmask_rows), ceil(vocab/32)];
    # row k says which tokens requests[bitmask_rows[k]] may sample (bit t % 32 of word t // 32)
    token_bitmask: Any = None
    bitmask_rows: list[int] = field(default_factory=list)
    # a batch of decodes only: the backend may run up to this many forwards back to back (Forwards); every
    # sequence's blocks cover them all
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def split(self) -> tuple[SchedulerOutput, SchedulerOutput]:
        """The two halves of this batch (mask rows follow their requests), to find a sequence that fails it."""
        half = len(self.requests) // 2
        return self._part(range(half)), self._part(range(half, len(self.requests)))

    def _part(self, idx: range) -> SchedulerOutput:
        reqs = [self.requests[i] for i in idx]
        keep = [k for k, i in enumerate(self.bitmask_rows) if i in idx]
        prefill = sum(r.num_new_tokens for r in reqs if r.num_computed_tokens < r.num_prompt_tokens)
        return SchedulerOutput(
            requests=reqs, num_prefill_tokens=prefill, num_decode_tokens=sum(r.num_new_tokens for r in reqs) - prefill,
            block_size=self.block_size, finished_request_ids=self.finished_request_ids,
            preempted_request_ids=self.preempted_request_ids,
            token_bitmask=self.token_bitmask[keep] if keep else None,
            bitmask_rows=[self.bitmask_rows[k] - idx.start for k in keep], num_steps=self.num_steps)


@dataclass(slots=True)
class ModelOutput:
    """The backend's answer, aligned with SchedulerOutput.requests."""

    sampled_token_ids: list[int | None]  # None where do_sample was False
    # Logprob of each sampled token with its top alternatives, where sampling.logprobs is set
    logprobs: list[Logprob | None] | None = None
    # for requests with sampling.prompt_logprobs: one entry per computed token of this chunk,
    # the logprob of the *next* prompt token at that position (None past the prompt's end)
    prompt_logprobs: list[list[Logprob | None] | None] | None = None
    # where the backend ran more forwards than one (Forwards): each later forward's tokens, aligned with the
    # requests like sampled_token_ids (the engine ends a sequence at its stop and drops what follows)
    more_token_ids: list[list[int]] | None = None
    # aligned with the requests, where any has `pooling`: the float sum of its chunk's pooled rows' final-norm hidden
    # states (None for the others, and for a chunk with no pooled row)
    pooled: list[list[float] | None] | None = None
