"""Continuous batching: iteration-level scheduling with chunked prefill and preemption.

Each step shares one token budget between the running sequences (decodes and unfinished
prefill chunks, best first) and new admissions from the waiting queue. A running sequence that
cannot grow preempts the worst running one (its blocks are freed and it is recomputed later)
instead of failing. The scheduler owns the KV-cache allocator: it allocates before the forward
and caches full blocks after it (update_from_output). The waiting queue's order is the policy,
an `order_key`: FCFS here, priority then FCFS in PriorityScheduler.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable

from llmserve.batch import Forwards, ModelOutput, ScheduledRequest, SchedulerOutput
from llmserve.errors import InvalidRequestError
from llmserve.interfaces import CacheAllocator, Scheduler
from llmserve.request import Request, RequestStatus
from llmserve.stats import SchedulerStats


class ContinuousScheduler(Scheduler):
    """FCFS continuous batching; subclass and override `order_key` (and `policy`) for other orders."""

    policy = "fcfs"
    uses_priority = False  # a request's priority changes nothing here: non-zero is refused, not ignored

    def __init__(
        self,
        allocator: CacheAllocator,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        num_scheduler_steps: int = 1,
    ):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_scheduler_steps = num_scheduler_steps
        self.forwards = Forwards(num_scheduler_steps)  # what the backend runs (limit_forwards): the offers' cap
        self._waiting: list[tuple[tuple, Request]] = []  # heap of (order_key, request)
        self._num_waiting = 0  # live entries (aborted ones are dropped lazily from the heap)
        self._running: list[Request] = []  # sorted by order_key: best first, preemption victims last
        self._running_keys: list[tuple] = []
        self._by_id: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0  # total, for metrics

    # --- policy -------------------------------------------------------------------------------

    def order_key(self, request: Request) -> tuple:
        """Smaller runs first: admission order for the waiting queue, survival order when preempting."""
        return (request.arrival_seq, request.index)

    # --- queue management ---------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.priority and not self.uses_priority:
            raise InvalidRequestError(f"priority {request.priority} was given, but the scheduling policy "
                                      f"{self.policy!r} ignores priorities (serve with --policy priority)",
                                      param="priority")
        assert request.request_id not in self._by_id, f"duplicate sequence id {request.request_id}"
        request.status = RequestStatus.WAITING
        self._by_id[request.request_id] = request
        heapq.heappush(self._waiting, (self.order_key(request), request))
        self._num_waiting += 1

    def _insert_running(self, request: Request) -> None:
        key = self.order_key(request)
        i = bisect.bisect_right(self._running_keys, key)
        self._running_keys.insert(i, key)
        self._running.insert(i, request)

    def _remove_running(self, request: Request) -> None:
        i = self._running.index(request)
        del self._running[i]
        del self._running_keys[i]

    def finish(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            request = self._by_id.pop(rid, None)
            if request is None:
                continue
            if request in self._running:
                self._remove_running(request)
            else:
                self._num_waiting -= 1  # its heap entry is skipped when it surfaces
            self.allocator.free(rid)
            self._finished_ids.append(rid)

    def limit_forwards(self, forwards: Forwards) -> None:
        self.num_scheduler_steps = min(self.num_scheduler_steps, max(1, forwards.most))
        self.forwards = forwards

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _preempt(self, victim: Request, batch: SchedulerOutput) -> None:
        """Free the victim's blocks and queue it for recomputation from scratch."""
        self._remove_running(victim)
        self.allocator.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (self.order_key(victim), victim))
        self._num_waiting += 1
        batch.preempted_request_ids.append(victim.request_id)
        self.num_preemptions += 1

    # --- the step -----------------------------------------------------------------------------

    def _entry(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_ids,
            num_computed_tokens=start,
            num_new_tokens=n,
            block_table=self.allocator.block_table(req.request_id),
            sampling=req.sampling,
            do_sample=start + n == len(req.token_ids) and req.pooling is None,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=len(req.token_ids) - len(req.prompt_token_ids),
            pooling=req.pooling.kind if req.pooling is not None else None,
        )

    def schedule(self) -> SchedulerOutput:
        alloc = self.allocator
        batch = SchedulerOutput(block_size=alloc.block_size)
        batch.finished_request_ids, self._finished_ids = self._finished_ids, []
        budget = self.max_num_batched_tokens
        out = batch.requests
        prefill = decode = 0

        # 1. running sequences, best first: a decode token each, or the next prefill chunk
        i = 0
        max_seqs = self.max_num_seqs
        while i < len(self._running) and budget > 0 and len(out) < max_seqs:
            req = self._running[i]
            remaining = len(req.token_ids) - req.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill and req.num_computed_tokens == 0:
                i += 1
                continue
            target = req.num_computed_tokens + n
            while alloc.allocate(req.request_id, req.token_ids, target) is None:
                victim = self._running[-1]  # the worst; never one already scheduled this step
                self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                out.append(self._entry(req, n))
                budget -= n
                if remaining == 1 and req.num_computed_tokens >= len(req.prompt_token_ids):
                    decode += 1
                else:
                    prefill += n
                i += 1
                continue
            # req preempted itself: it was the last running one, nothing more to do here
            break

        # 2. admit waiting sequences in policy order while budget, seats and blocks last
        if not batch.preempted_request_ids:
            waiting = self._waiting
            while waiting and budget > 0 and len(self._running) < max_seqs:
                _, req = waiting[0]
                if req.status is not RequestStatus.WAITING or req.request_id not in self._by_id:
                    heapq.heappop(waiting)  # aborted while waiting
                    continue
                # prompt logprobs, mean or CLS pooling need every prompt position computed: no prefix reuse
                use_cache = req.reads_prefix_cache
                cached = alloc.lookup_prefix(req.token_ids, req.cache_salt) if use_cache else 0
                remaining = len(req.token_ids) - cached
                n = min(remaining, budget)
                if n < remaining and req.whole_prompt:
                    break  # an encoder's prompt goes in one step (the engine keeps it within the budget)
                if n < remaining and not self.enable_chunked_prefill:
                    # a whole prompt must fit; if it can never fit in one step, chunk it anyway
                    if remaining <= self.max_num_batched_tokens or out:
                        break
                got = alloc.allocate(req.request_id, req.token_ids, cached + n, use_prefix_cache=use_cache,
                                     salt=req.cache_salt)
                if got is None:
                    break  # not enough blocks: wait for running sequences to finish
                assert got == cached, f"prefix lookup {cached} != allocation {got}"
                heapq.heappop(waiting)
                self._num_waiting -= 1
                req.num_computed_tokens = got
                if req.num_preemptions == 0:
                    req.num_cached_tokens = got
                req.status = RequestStatus.PREFILL
                self._insert_running(req)
                out.append(self._entry(req, n))
                budget -= n
                prefill += n

        batch.num_prefill_tokens = prefill
        batch.num_decode_tokens = decode
        # several forwards where no waiting sequence could have joined the next (none waits, or every seat is taken)
        # (and only for as many sequences as the backend runs ahead: no blocks reserved for forwards it won't run)
        if self.num_scheduler_steps > 1 and decode and not prefill and not batch.preempted_request_ids \
                and (not self._num_waiting or len(self._running) >= max_seqs) \
                and self.forwards.cap(self.num_scheduler_steps, len(out)) > 1:
            batch.num_steps = self._lookahead(out)
        return batch

    def _lookahead(self, out: list[ScheduledRequest]) -> int:
        """How many forwards a batch of decodes may run: no sequence past its token limit,
        every sequence's blocks reserved for all of them; 1 where the blocks are not there (nothing is preempted
        for a lookahead)."""
        by_id = self._by_id
        reqs = [by_id[sr.request_id] for sr in out]
        steps = min([self.num_scheduler_steps] + [r.max_total_tokens - len(r.token_ids) for r in reqs])
        if steps <= 1:
            return 1
        for r in reqs:
            if self.allocator.allocate(r.request_id, r.token_ids, r.num_computed_tokens + steps) is None:
                return 1
        return steps

    def update_from_output(self, output: SchedulerOutput, model_output: ModelOutput) -> None:
        bs = output.block_size
        alloc = self.allocator
        by_id = self._by_id
        for sr in output.requests:
            req = by_id.get(sr.request_id)
            if req is None:
                continue  # ended meanwhile (aborted): nothing to advance
            before = req.num_computed_tokens
            after = before + sr.num_new_tokens
            req.num_computed_tokens = after
            if sr.do_sample:  # its prompt is computed and it has a token: decoding from now on
                req.status = RequestStatus.DECODE
            if after // bs > before // bs and req.extends_prefix_cache:
                alloc.cache_full_blocks(req.request_id, req.token_ids, after)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self._running), num_waiting=self._num_waiting,
                              cache=self.allocator.stats(), num_preemptions=self.num_preemptions,
                              max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                              policy=self.policy, num_scheduler_steps=self.num_scheduler_steps)


class PriorityScheduler(ContinuousScheduler):
    """Lower priority numbers first, FCFS within a level (vLLM's convention)."""

    policy = "priority"
    uses_priority = True

    def order_key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_seq, request.index)
