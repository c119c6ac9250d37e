"""The Engine: request lifecycle and the synchronous step loop.

    add_request → WAITING → PREFILL (one or more chunks) → DECODE → FINISHED | FAILED
                     ↑______ preempted: blocks freed, recomputed later ______|

The scheduler makes every move between its queues and sets the status on the way; the engine only ends a
sequence (Scheduler.end: finished, failed or aborted).

Each step asks the scheduler for its output, runs it on the backend, hands the model output
back to the scheduler (which advances computed tokens and caches full KV blocks), then appends
tokens, checks stop conditions, detokenizes and reports metrics. The scheduler owns the KV
cache: the engine never touches it. A request with n > 1 is a fan-out of n sequences that share
the prompt through the prefix cache. The engine is not thread-safe: the async wrapper
(async_engine.py) builds and drives it from a single thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmserve.batch import ModelOutput, SchedulerOutput
from llmserve.config import EngineConfig, config_from_dict
from llmserve.constraints import Constraints
from llmserve.detokenize import IncrementalDetokenizer
from llmserve.errors import BackendLostError, BackendUnavailableError, InvalidRequestError, PluginError
from llmserve.interfaces import MetricSink, ModelBackend, Scheduler, Tokenizer
from llmserve.limits import check_prompt
from llmserve.metrics import MetricsCollector, RequestMetrics, StepMetrics
from llmserve.plugins import PluginSet, load_plugins
from llmserve.pooling import accumulate, check_pooling, finish
from llmserve.request import (FinishReason, PoolingParams, Request, RequestOutput, RequestStatus, SamplingParams,
                              apply_generation_defaults)
from llmserve.stats import SchedulerStats
from llmserve.threads import ThreadOwner

log = logging.getLogger("llmserve.engine")


@dataclass(slots=True)
class StepOutput:
    """What one step produced: a delta per sequence that advanced or ended, and the step's metrics."""

    outputs: list[RequestOutput] = field(default_factory=list)
    metrics: StepMetrics | None = None


@dataclass(slots=True)
class _Group:
    """The caller's request: its n sequences, and those held back until the first has computed the prompt."""

    seq_ids: list[str]
    unfinished: int
    held: list[Request] = field(default_factory=list)


def build_tokenizer(config: EngineConfig, plugins: PluginSet, default: str | None,
                    path: str | None) -> Tokenizer | None:
    """The configured tokenizer; `auto` is the backend's default (`default`, loaded from `path`), None for none."""
    name = config.tokenizer.name
    if name == "auto":  # the model's own: the backend knows what it loaded
        name = default
        if name is None:
            log.warning("the %s backend names no tokenizer: the engine takes token ids only", config.backend.name)
            return None
    if name == "none":
        return None
    if config.model.tokenizer is None and path:  # a copy: the config is shared
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, tokenizer=path))
    return plugins.get("tokenizer", name).factory(config)


def build_constraints(config: EngineConfig, plugins: PluginSet, tokenizer: Tokenizer | None,
                      vocab_size: int) -> Constraints:
    """Structured output over the configured grammar engine; without one (or a tokenizer), the reason it is off."""
    if tokenizer is None:
        return Constraints(None, "this server has no tokenizer", vocab_size)
    try:
        grammar = plugins.get("grammar", config.structured_output.name).factory(config, tokenizer, vocab_size)
    except NotImplementedError as e:
        log.info("no structured output: %s", e)
        return Constraints(None, str(e), vocab_size)
    return Constraints(grammar, "", vocab_size)


def build_sinks(config: EngineConfig, plugins: PluginSet) -> list[MetricSink]:
    """The configured metric sinks."""
    return [plugins.get("metric_sink", s.name).factory(config, dict(s.options)) for s in config.metrics.sinks]


def _forwards(batch: SchedulerOutput, mo: ModelOutput, live: dict[str, Request]):
    """The backend's answer as (batch, output) per forward: the first as it came, then each later forward's tokens
    (ModelOutput.more_token_ids) for the sequences still live after the forwards before it."""
    yield batch, mo
    for toks in mo.more_token_ids or ():
        part = _later_forward(batch, toks, live)
        if part is None:
            return
        yield part


def _later_forward(batch: SchedulerOutput, toks: list[int], live: dict[str, Request]):
    """A forward after a step's first as (batch, output): the sequences still live and their tokens (None: none)."""
    rows = [i for i, sr in enumerate(batch.requests) if sr.request_id in live]
    if not rows:
        return None
    reqs = [batch.requests[i] for i in rows]
    return (SchedulerOutput(requests=reqs, num_decode_tokens=len(reqs), block_size=batch.block_size),
            ModelOutput(sampled_token_ids=[toks[i] for i in rows]))


class _Relay:
    """A step's forwards replayed as the backend makes them (ModelBackend.on_forward, on the backend's thread while
    the engine's waits in execute()), their outputs handed on at once (Engine.early): a token reaches its stream
    when its forward ends, not when the step's last does."""

    def __init__(self, engine: Engine, batch: SchedulerOutput, t0: float):
        self.engine, self.batch, self.t0 = engine, batch, t0
        self.handed = 0  # forwards replayed here; the step replays the rest
        self.sampled = 0
        self.every = engine.config.scheduler.stream_interval
        self.hold = engine.config.scheduler.stream_hold_ms / 1000  # a forward this long delivers at once
        self.last = t0  # when the forward before ended
        self.held: list[RequestOutput] = []  # replayed, not yet delivered (every `every` forwards)
        self.error: BaseException | None = None  # raised on the engine's thread once execute() returns

    def forward(self, j: int, tokens: list[int]) -> None:
        """ModelBackend.on_forward: replay forward j as the step would have."""
        if self.error is not None or j != self.handed:
            return
        e = self.engine
        try:
            part = (self.batch, ModelOutput(sampled_token_ids=tokens)) if j == 0 else \
                _later_forward(self.batch, tokens, e._seqs)
            if part is not None:
                e.scheduler.update_from_output(*part)
                self.sampled += len(part[1].sampled_token_ids)
                e._postprocess(*part, time.perf_counter(), self.t0, self.held)
            self.handed = j + 1
            now = time.perf_counter()
            slow, self.last = now - self.last >= self.hold, now
            if self.held and (self.handed % self.every == 0 or slow):
                held, self.held = _one_delta_each(self.held), []
                e.early(held)
        except Exception as exc:  # noqa: BLE001 - the step fails as it would have failed replaying this forward
            self.error = exc


def _one_delta_each(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """A step's outputs with each sequence's deltas joined into its first (a step of several forwards)."""
    first: dict[tuple[str, int], RequestOutput] = {}
    joined = []
    for o in outputs:
        key = (o.request_id, o.index)
        if key in first:
            first[key].extend(o)
        else:
            first[key] = o
            joined.append(o)
    return joined


class Engine:
    """Owns the plugin manager, the components built from it, and every request's state."""

    def __init__(self, config: EngineConfig, plugins: PluginSet):
        self.config = config
        self.plugins = plugins
        # the thread that builds the engine must be the one that steps it (llmserve/threads.py)
        self.threads = ThreadOwner()
        t0 = time.perf_counter()
        # the backend first: a missing checkpoint is reported as such, not as a tokenizer error
        self.backend: ModelBackend = self._factory("backend", config.backend.name)(config)
        cc = config.cache
        num_blocks = cc.num_blocks or self.backend.num_kv_blocks(cc.block_size)
        if num_blocks < 1:
            raise PluginError(f"the KV cache budget holds no block of {cc.block_size} tokens; "
                              "raise backend.kv_cache_memory or set cache.num_blocks")
        self.backend.init_kv_cache(num_blocks, cc.block_size)
        # the scheduler owns the KV cache built for it: the engine never calls it
        kv_cache = self._factory("cache", cc.name)(config, num_blocks)
        self.scheduler: Scheduler = self._factory("scheduler", config.scheduler.name)(config, kv_cache)
        self.scheduler.limit_forwards(self.backend.forwards)
        self.tokenizer: Tokenizer | None = build_tokenizer(config, plugins, self.backend.default_tokenizer,
                                                           self.backend.tokenizer_path)
        self.metric_sinks: list[MetricSink] = build_sinks(config, plugins)
        self.max_model_len: int = min(self.backend.max_model_len, num_blocks * cc.block_size,
                                      config.model.max_model_len or self.backend.max_model_len)
        if not self.backend.causal:  # an encoder's prompt is computed in one step: the step's budget bounds it
            self.max_model_len = min(self.max_model_len, config.scheduler.max_num_batched_tokens)
        # embeddings: the pooling requests get (model.pooling, else the model's), the vector's length, and whether
        # the model generates at all (an encoder does not); pooling None: no embeddings
        self.pooling = (config.model.pooling or self.backend.pooling) if self.backend.pooling else None
        self.embedding_size = self.backend.hidden_size
        self.generates = self.backend.generates
        self.eos_token_id = self.backend.eos_token_id
        if self.eos_token_id is None and self.tokenizer is not None:
            self.eos_token_id = self.tokenizer.eos_token_id
        # a model may end turns with several ids (Llama 3's <|eot_id|>, a list in generation_config.json)
        self.eos_token_ids = frozenset(self.backend.eos_token_ids) | {self.eos_token_id} - {None}
        auto = config.model.generation_config == "auto"  # the model's sampling defaults, for omitted fields
        self.generation_defaults = dict(self.backend.generation_defaults) if auto else {}
        self.generation_defaults_source = self.backend.generation_defaults_source if self.generation_defaults else None
        self.vocab_size: int = self.backend.vocab_size
        self.constraints = build_constraints(config, plugins, self.tokenizer, self.vocab_size)
        self.collector = MetricsCollector()
        self._seqs: dict[str, Request] = {}
        self._groups: dict[str, _Group] = {}
        self._holding: dict[str, _Group] = {}  # groups whose other sequences wait for the first's prompt
        self._pending: list[RequestOutput] = []  # outputs made outside step() (immediate failures)
        # where outputs made during a step go at once (AsyncEngine's delivery); None: with the step's outputs
        self.early: Callable[[list[RequestOutput]], None] | None = None
        self._step_no = 0
        self._prefix_q = self._prefix_h = 0
        self.startup_seconds = time.perf_counter() - t0
        log.info("engine ready in %.2fs: backend=%s blocks=%d×%d max_model_len=%d",
                 self.startup_seconds, config.backend.name, num_blocks, cc.block_size, self.max_model_len)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: EngineConfig | dict | None = None, extra_plugins: list | None = None) -> Engine:
        """Load plugins (defaults, entry points, extra_plugins) and build an engine from config."""
        if config is None or isinstance(config, dict):
            config = config_from_dict(config or {})
        return cls(config, load_plugins(extra_plugins=extra_plugins))

    def _factory(self, kind: str, name: str):
        return self.plugins.get(kind, name).factory

    def add_metric_sink(self, sink: MetricSink) -> None:
        """Attach a sink after construction (a plugin's route hook serving it, say); it gets every later event."""
        self.metric_sinks.append(sink)
        sink.on_scheduler_stats(self.scheduler.stats())

    # --- requests -----------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None,
                    cache_salt: str | None = None, pooling: PoolingParams | None = None) -> str:
        """Queue a request with validated params; return its id. Bad input raises InvalidRequestError (nothing queued).

        With `pooling` it is an embedding: one sequence, prefilled in the steps generation runs in, ending with
        RequestOutput.embedding instead of tokens (sampling_params are not used)."""
        if pooling is not None:
            pooling = self.check_pooling(pooling)
            sp = SamplingParams(max_tokens=None)  # nothing is sampled
        else:
            sp = sampling_params or SamplingParams(**apply_generation_defaults(self.generation_defaults, {},
                                                                                self.generation_defaults))
            if not self.generates:
                raise InvalidRequestError(
                    f"the model {self.config.served_model_name!r} is an encoder: it generates no text and answers "
                    "POST /v1/embeddings only", param="model", code="model_not_generative")
        rid = request_id or uuid.uuid4().hex
        if rid in self._groups:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        prompt = list(prompt_token_ids)
        # SamplingParams.validate ran where the params were made (the server's protocol layer, or
        # the offline caller); what only the engine knows is checked here, by the shared rule
        check_prompt(prompt, sp, self.backend.vocab_size, self.max_model_len, generates=pooling is None)
        self.constraints.check(sp)  # compiled once and cached: the server has usually done it already
        now = time.perf_counter() if arrival_time is None else arrival_time
        max_total = self.max_model_len if sp.max_tokens is None else min(self.max_model_len, len(prompt) + sp.max_tokens)
        if pooling is not None:
            max_total = len(prompt)
        ids = [rid] if sp.n == 1 else [f"{rid}#{i}" for i in range(sp.n)]
        seqs = []
        for i, sid in enumerate(ids):
            # n samples from one seed must differ: each sequence draws from its own stream
            p = sp if i == 0 or sp.seed is None else dataclasses.replace(sp, seed=sp.seed + i)
            seqs.append(Request(sid, prompt, p, now, priority=priority, group_id=rid, index=i,
                                max_total_tokens=max_total, cache_salt=cache_salt, pooling=pooling,
                                whole_prompt=pooling is not None and not self.backend.causal))
        for r in seqs[1:]:
            r.arrival_seq = seqs[0].arrival_seq  # one arrival: the policy orders the n together
        self.scheduler.add(seqs[0])  # the policy may refuse it (InvalidRequestError): nothing is held yet
        for r in seqs:
            self.constraints.add(r)
        group = _Group(ids, sp.n)
        # fan-out: the others wait until the first has computed the prompt, then hit its cached
        # blocks; without prefix reuse (caching off, prompt logprobs) they would gain nothing
        cc = self.config.cache
        if sp.n > 1 and sp.prompt_logprobs is None and cc.enable_prefix_caching and len(prompt) > cc.block_size:
            group.held = seqs[1:]
            self._holding[rid] = group
        else:
            for r in seqs[1:]:
                self.scheduler.add(r)
        self._groups[rid] = group
        for r in seqs:
            self._seqs[r.request_id] = r
        return rid

    def check_pooling(self, p: PoolingParams) -> PoolingParams:
        """p with its kind resolved to the model's (pooling.check_pooling's rule, with this engine's model)."""
        return check_pooling(p, self.pooling, self.embedding_size, self.config)

    def _release_held(self) -> None:
        """Admit the held sequences of each group whose first sequence has computed its prompt."""
        for rid, g in list(self._holding.items()):
            first = self._seqs.get(g.seq_ids[0])
            if first is not None and first.num_computed_tokens < first.num_prompt_tokens:
                continue
            del self._holding[rid]
            held, g.held = g.held, []
            for r in held:
                if not r.status.is_done:
                    self.scheduler.add(r)

    def abort(self, request_id: str) -> bool:
        """Cancel every sequence of the request; blocks are freed now. False if it is not running."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for sid in list(group.seq_ids):
            r = self._seqs.get(sid)
            if r is not None and not r.status.is_done:
                self._finish(r, FinishReason.ABORT, out=self._pending)
        if self.metric_sinks:  # the gauges show the present: tell the sinks now, outside any step
            st = self.scheduler.stats()
            for s in self.metric_sinks:
                s.on_scheduler_stats(st)
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished

    @property
    def num_waiting(self) -> int:
        """Sequences waiting: the scheduler's, and those of n > 1 groups held until their prompt is computed (read
        from the server's thread too: list() copies the groups in one step)."""
        return self.scheduler.num_waiting + sum(len(g.held) for g in list(self._holding.values()))

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # --- ending sequences ---------------------------------------------------------------------

    def _end(self, r: Request, now: float) -> None:
        """Release the sequence everywhere (the scheduler sets its final status) and report its metrics."""
        self.scheduler.end(r, RequestStatus.FAILED if r.finish_reason is FinishReason.ERROR else RequestStatus.FINISHED)
        self.constraints.drop(r.request_id)
        self._seqs.pop(r.request_id, None)
        g = self._groups.get(r.group_id)
        if g is not None:
            g.unfinished -= 1
            if g.unfinished <= 0:
                del self._groups[r.group_id]
                self._holding.pop(r.group_id, None)
        m = RequestMetrics(
            request_id=r.group_id, index=r.index,
            finish_reason=r.finish_reason.value if r.finish_reason else None, error=r.error,
            num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens,
            num_cached_tokens=r.num_cached_tokens, num_preemptions=r.num_preemptions,
            queue_seconds=(r.first_scheduled_time - r.arrival_time) if r.first_scheduled_time else None,
            ttft_seconds=(r.first_token_time - r.arrival_time) if r.first_token_time else None,
            e2e_seconds=now - r.arrival_time, inter_token_latencies=r.inter_token_latencies,
        )
        self.collector.on_request_finished(m)
        for s in self.metric_sinks:
            s.on_request_finished(m)

    def _finish(self, r: Request, reason: FinishReason, out: list[RequestOutput], stop_reason=None,
                text: str = "") -> None:
        """End the sequence for `reason`: its last delta goes to `out`, then _end releases it."""
        r.finish_reason = reason
        r.stop_reason = stop_reason
        if (r.detok is not None and reason in (FinishReason.STOP, FinishReason.LENGTH)
                and not isinstance(stop_reason, str)):
            text += r.detok.flush()  # the text held back for stop strings is final now
        out.append(self._delta(r, text, finished=True))
        self._end(r, time.perf_counter())

    def _fail(self, r: Request, message: str, param: str | None = None, unavailable: bool = False) -> None:
        """Fail the sequence, and the sequences of its request still held back (a failed request ends whole);
        param names the request's field when its own values are why; unavailable: the backend could not be reached."""
        g = self._holding.get(r.group_id)
        for seq in [r] + (g.held if g is not None else []):
            if not seq.status.is_done:
                seq.error, seq.error_param, seq.unavailable = message, param, unavailable
                self._finish(seq, FinishReason.ERROR, self._pending)

    def _delta(self, r: Request, text: str, finished: bool = False) -> RequestOutput:
        # finish and stop reasons are set only when the sequence ends; token_ids never shrink below the prompt
        o = RequestOutput(
            request_id=r.group_id, index=r.index, new_token_ids=r.pending_token_ids, new_text=text,
            finished=finished, finish_reason=r.finish_reason, stop_reason=r.stop_reason, error=r.error,
            error_param=r.error_param, unavailable=r.unavailable,
            logprobs=r.pending_logprobs or None, num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens, num_cached_tokens=r.num_cached_tokens,
            embedding=r.pooled if r.pooling is not None and r.finish_reason is FinishReason.STOP else None,
        )
        if r.prompt_logprobs is not None and len(r.prompt_logprobs) >= r.num_prompt_tokens:
            o.prompt_logprobs, r.prompt_logprobs = r.prompt_logprobs, None
        r.pending_token_ids = []
        if r.pending_logprobs:
            r.pending_logprobs = []
        return o

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Schedule, run the backend once, and turn its tokens into per-request outputs."""
        t0 = time.perf_counter()
        self.threads.check()
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        backend_s, sampled, forwards = 0.0, 0, 1
        if batch.requests:
            self.constraints.fill(batch, self._seqs)
            tb = time.perf_counter()
            # several forwards: each replayed as it ends, where the outputs have somewhere to go mid-step
            relay = _Relay(self, batch, t0) if batch.num_steps > 1 and self.early is not None else None
            self.backend.on_forward = relay.forward if relay is not None else None
            try:
                done = self._execute(batch)
            finally:
                self.backend.on_forward = None
            now = time.perf_counter()
            backend_s = now - tb
            if relay is not None:
                if relay.error is not None:
                    raise relay.error
                sampled += relay.sampled
                outputs += relay.held  # replayed since its last delivery: with the step's
            for part, mo in done:
                f = 1 + len(mo.more_token_ids or ())
                forwards = max(forwards, f)
                handed = relay.handed if relay is not None and part is batch else 0
                # a forward at a time, as if each had been a step: stops, blocks and text as one forward a step; each
                # forward the relay did not replay stamped when it ended (its even share of the backend's time)
                for j, (fpart, fmo) in enumerate(_forwards(part, mo, self._seqs)):
                    if j < handed:
                        continue
                    self.scheduler.update_from_output(fpart, fmo)
                    sampled += len(fmo.sampled_token_ids) - fmo.sampled_token_ids.count(None)
                    self._postprocess(fpart, fmo, now if f == 1 else tb + backend_s * (j + 1) / f, t0, outputs)
            if forwards > 1:
                outputs = _one_delta_each(outputs)
            if self._holding:
                self._release_held()
        outputs.extend(self._pending)
        self._pending = []
        return StepOutput(outputs, self._report_step(batch, t0, backend_s, sampled, forwards))

    def _execute(self, batch: SchedulerOutput) -> list[tuple[SchedulerOutput, ModelOutput]]:
        """Run the batch; when the backend fails it, halve it until the failing sequences are alone, fail
        only those and return the parts that ran (one request's bad parameters never fail another's)."""
        try:
            return [(batch, self.backend.execute(batch))]
        except BackendLostError:  # no step can run any more: the engine loop stops the engine
            raise
        except BackendUnavailableError as e:  # no sequence's fault: halving would only call a dead backend again
            for sr in batch.requests:
                r = self._seqs.get(sr.request_id)
                if r is not None and not r.status.is_done:
                    self._fail(r, str(e), unavailable=True)
            return []
        except Exception as e:  # rerunning a part is safe: nothing advances until update_from_output
            error = e
        if len(batch.requests) == 1:
            r = self._seqs.get(batch.requests[0].request_id)
            log.error("backend failed on sequence %s", batch.requests[0].request_id, exc_info=error)
            if r is not None and not r.status.is_done:
                self._fail(r, f"backend error: {type(error).__name__}: {error}")
            return []
        return [d for part in batch.split() for d in self._execute(part)]

    def _postprocess(self, batch, mo, now: float, t0: float, outputs: list[RequestOutput]) -> None:
        eos = self.eos_token_ids
        sampled, lps, plps = mo.sampled_token_ids, mo.logprobs, mo.prompt_logprobs
        for i, sr in enumerate(batch.requests):
            r = self._seqs[sr.request_id]
            if r.first_scheduled_time is None:
                r.first_scheduled_time = t0
            if sr.pooling is not None:
                self._pool(r, sr, mo.pooled[i] if mo.pooled is not None else None, now, outputs)
                continue
            if plps is not None and plps[i] is not None and r.num_output_tokens == 0:
                # entry j is the logprob of prompt token s+j+1 (the first has none); placed by position, so a
                # prefill recomputed after preemption rewrites them, and decode steps (past the prompt) add none
                s = sr.num_computed_tokens
                r.prompt_logprobs = (r.prompt_logprobs or [None])[: s + 1] + plps[i][: r.num_prompt_tokens - s - 1]
            tok = sampled[i]
            if tok is None:
                continue
            r.token_ids.append(tok)
            r.pending_token_ids.append(tok)
            if lps is not None and lps[i] is not None:
                r.pending_logprobs.append(lps[i])
            if r.first_token_time is None:
                r.first_token_time = now
            else:
                r.inter_token_latencies.append(now - r.last_token_time)
            r.last_token_time = now
            sp = r.sampling
            try:
                complete = self.constraints.accept(r, tok)
            except InvalidRequestError as e:  # its constraints cannot go on: the request's own error
                self._fail(r, str(e), e.param)
                continue
            except ValueError as e:
                self._fail(r, str(e))
                continue
            n_out = len(r.token_ids) - len(r.prompt_token_ids)
            if n_out >= sp.min_tokens and ((tok in eos and not sp.ignore_eos) or tok in sp.stop_token_ids):
                # the stop token counts as an output token but adds no text
                self._finish(r, FinishReason.STOP, outputs, stop_reason=None if tok in eos else tok)
                continue
            text = ""
            if sp.detokenize and self.tokenizer is not None:
                if r.detok is None:
                    r.detok = IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, sp.skip_special_tokens,
                                                     sp.stop, sp.include_stop_str_in_output)
                text, hit = r.detok.add(tok)
                if hit is not None:
                    self._finish(r, FinishReason.STOP, outputs, stop_reason=hit, text=text)
                    continue
            if complete:  # the grammar allows nothing more: the output is whole
                self._finish(r, FinishReason.STOP, outputs, text=text)
                continue
            if len(r.token_ids) >= r.max_total_tokens:
                self._finish(r, FinishReason.LENGTH, outputs, text=text)
                continue
            outputs.append(self._delta(r, text))

    def _pool(self, r: Request, sr, part: list[float] | None, now: float, outputs: list[RequestOutput]) -> None:
        """Add an embedding sequence's chunk to its pooled sum; after its prompt's last chunk, end it with the vector
        (its blocks are freed now: it needs no KV beyond its prefill)."""
        r.pooled = accumulate(r.pooled, sr.num_computed_tokens, part)
        if sr.num_computed_tokens + sr.num_new_tokens < r.num_prompt_tokens:
            return
        if r.pooled is None:
            self._fail(r, f"the {self.config.backend.name} backend returned no pooled state")
            return
        r.pooled = finish(r.pooled, sr.pooling, r.num_prompt_tokens, r.pooling)
        r.first_token_time = r.last_token_time = now
        self._finish(r, FinishReason.STOP, outputs)

    def _report_step(self, batch, t0: float, backend_s: float, sampled: int, forwards: int) -> StepMetrics | None:
        if not batch.requests and not batch.preempted_request_ids:
            return None
        self._step_no += 1
        st = self.scheduler.stats()
        c = st.cache
        dq, dh = c.prefix_queries - self._prefix_q, c.prefix_hits - self._prefix_h
        self._prefix_q, self._prefix_h = c.prefix_queries, c.prefix_hits
        step_s = time.perf_counter() - t0
        m = StepMetrics(
            step=self._step_no, timestamp=time.time(), batch_size=len(batch.requests),
            num_scheduled_tokens=batch.num_prefill_tokens + batch.num_decode_tokens,
            num_prefill_tokens=batch.num_prefill_tokens, num_decode_tokens=batch.num_decode_tokens,
            num_running=st.num_running, num_waiting=st.num_waiting,
            num_preempted=len(batch.preempted_request_ids), step_seconds=step_s,
            backend_seconds=backend_s, overhead_seconds=step_s - backend_s,
            kv_cache_usage=c.usage, prefix_cache_queries=dq, prefix_cache_hits=dh, num_output_tokens=sampled,
            num_forwards=forwards,
        )
        self.collector.on_step(m)
        for s in self.metric_sinks:
            s.on_step(m)
            s.on_scheduler_stats(st)
        return m

    # --- reporting ----------------------------------------------------------------------------

    def metrics_snapshot(self) -> dict[str, Any]:
        """Counters and p50/p95/p99 of queue time, TTFT, ITL, e2e latency and step overhead."""
        return self.collector.snapshot()

    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler's typed stats, with its cache's (what benches and tests read)."""
        return self.scheduler.stats()

    def stats(self) -> dict[str, Any]:
        """Queue, running, cache and prefix-cache state plus the metrics snapshot (for /stats)."""
        sched = self.scheduler.stats().to_dict()
        cache = sched.pop("cache")
        return {
            "model": self.config.served_model_name,
            "backend": self.backend.describe(),
            "max_model_len": self.max_model_len,
            "waiting": sched["num_waiting"],
            "running": sched["num_running"],
            "scheduler": sched,
            "cache": cache,
            "threads": self.threads.layout(),
            "metrics": self.metrics_snapshot(),
        }

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | None = None) -> list[list[int]]:
        """Run prompts to completion offline; return each one's output token ids (n=1)."""
        if sampling_params is not None:
            sampling_params.validate()  # add_request trusts its caller to have done this once
        ids = [self.add_request(p, sampling_params) for p in prompts]
        result: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished:
            for o in self.step().outputs:
                result[o.request_id].extend(o.new_token_ids)
        return [result[i] for i in ids]

    def shutdown(self) -> None:
        """Abort what is left and close sinks and backend."""
        for rid in list(self._groups):
            self.abort(rid)
        self._pending.clear()
        for s in self.metric_sinks:
            s.close()
        self.backend.shutdown()
