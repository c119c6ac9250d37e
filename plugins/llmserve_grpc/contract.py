"""llmserve's step data ↔ the worker contract's messages (worker.proto), both directions, in one place."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from llmserve.batch import ModelOutput, ScheduledRequest, SchedulerOutput
from llmserve.interfaces import ModelBackend
from llmserve.pooling import POOLING_TYPES
from llmserve.request import Logprob, SamplingParams
from llmserve_grpc import worker_pb2 as pb

PROTOCOL = 1  # bump when a change to worker.proto means an older peer would misread it
# how a worker's FAILED_PRECONDITION begins when it no longer holds the calling server's KV cache (it restarted, or
# another server initialised it): the server's engine then stops until it is restarted (BackendLostError)
NO_SESSION = "this worker has no KV cache"

# SamplingParams fields the server keeps to itself (stops, fan-out, text, constraints: the bitmask carries those);
# every other field travels in pb.Sampling (tests/grpc/test_contract.py holds the two lists to the dataclass)
SERVER_ONLY = frozenset({"stop", "include_stop_str_in_output", "n", "skip_special_tokens", "detokenize", "structured",
                         "allowed_token_ids", "bad_words_token_ids"})
_OPTIONAL = ("seed", "logprobs", "prompt_logprobs", "max_tokens")  # None ↔ unset


# --- model facts -------------------------------------------------------------------------------


def model_info(backend: ModelBackend, name: str, model: str, worker_id: str) -> pb.ModelInfo:
    """What a worker tells a connecting server about the backend it hosts."""
    info = pb.ModelInfo(protocol=PROTOCOL, worker_id=worker_id, backend=name, model=model,
                        vocab_size=backend.vocab_size, max_model_len=backend.max_model_len,
                        eos_token_ids=sorted(backend.eos_token_ids),
                        generation_defaults_json=json.dumps(backend.generation_defaults or {}),
                        generation_defaults_source=backend.generation_defaults_source or "",
                        default_tokenizer=backend.default_tokenizer or "", tokenizer_path=backend.tokenizer_path or "",
                        pooling=backend.pooling or "", hidden_size=backend.hidden_size or 0,
                        encoder_only=not backend.generates, bidirectional=not backend.causal)
    if backend.eos_token_id is not None:
        info.eos_token_id = backend.eos_token_id
    return info


# --- the batch ---------------------------------------------------------------------------------


def sampling_to_proto(sp: SamplingParams) -> pb.Sampling:
    """The backend's share of a request's sampling parameters."""
    fields = {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp) if f.name not in SERVER_ONLY}
    bias = fields.pop("logit_bias") or {}
    msg = pb.Sampling(**{k: v for k, v in fields.items() if v is not None})
    msg.logit_bias.update({int(t): float(b) for t, b in bias.items()})
    return msg


def sampling_from_proto(msg: pb.Sampling) -> SamplingParams:
    """SamplingParams with the server-only fields at their defaults."""
    kw: dict[str, Any] = {f.name: getattr(msg, f.name) for f in pb.Sampling.DESCRIPTOR.fields
                          if f.name not in _OPTIONAL and f.name != "logit_bias"}
    kw.update({name: getattr(msg, name) if msg.HasField(name) else None for name in _OPTIONAL})
    kw["stop_token_ids"] = list(msg.stop_token_ids)
    kw["logit_bias"] = dict(msg.logit_bias) or None
    return SamplingParams(**kw)


def batch_to_proto(batch: SchedulerOutput, session: str, held: dict[str, int]) -> pb.Batch:
    """The step as a message; `held` (request id → token ids the worker holds) says which ids to send."""
    msg = pb.Batch(session=session, num_prefill_tokens=batch.num_prefill_tokens,
                   num_decode_tokens=batch.num_decode_tokens, block_size=batch.block_size,
                   finished_request_ids=batch.finished_request_ids, preempted_request_ids=batch.preempted_request_ids,
                   bitmask_rows=batch.bitmask_rows)
    for r in batch.requests:
        start = held.get(r.request_id, 0)
        msg.requests.append(pb.Sequence(
            request_id=r.request_id, start=start, new_token_ids=r.token_ids[start:],
            num_computed_tokens=r.num_computed_tokens, num_new_tokens=r.num_new_tokens, block_table=r.block_table,
            sampling=sampling_to_proto(r.sampling), do_sample=r.do_sample, num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens, pooling=r.pooling or ""))
    if batch.token_bitmask is not None:
        msg.token_bitmask = np.ascontiguousarray(batch.token_bitmask.numpy(), dtype="<i4").tobytes()
    return msg


class SequenceTokens:
    """A worker's copy of each live sequence's token ids, grown by what each batch sends."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def apply(self, seq: pb.Sequence) -> list[int]:
        """The sequence's token ids after this message; LookupError if it starts past what this worker holds."""
        have = self.tokens.setdefault(seq.request_id, [])
        if seq.start > len(have):
            raise LookupError(f"sequence {seq.request_id!r}: the batch sends its tokens from {seq.start}, this worker "
                              f"holds {len(have)}")
        del have[seq.start:]  # (a step the server retried sends what an earlier try already added)
        have.extend(seq.new_token_ids)
        return have

    def drop(self, request_ids) -> None:
        """Forget ended sequences."""
        for rid in request_ids:
            self.tokens.pop(rid, None)


def batch_from_proto(msg: pb.Batch, tokens: SequenceTokens, vocab_size: int) -> SchedulerOutput:
    """The SchedulerOutput a hosted backend executes; ValueError naming what is malformed."""
    tokens.drop(msg.finished_request_ids)
    reqs, seen = [], set()
    for s in msg.requests:
        # what the server checked for its own requests, checked again: a worker answers whoever reaches its port
        if s.request_id in seen:
            raise ValueError(f"sequence {s.request_id!r} appears twice in the batch")
        seen.add(s.request_id)
        if s.new_token_ids and (min(s.new_token_ids) < 0 or max(s.new_token_ids) >= vocab_size):
            raise ValueError(f"sequence {s.request_id!r}: a token id outside the vocabulary [0, {vocab_size})")
        if s.pooling and s.pooling not in POOLING_TYPES:
            raise ValueError(f"sequence {s.request_id!r}: pooling {s.pooling!r} is not one of {sorted(POOLING_TYPES)}")
        sampling = sampling_from_proto(s.sampling)
        sampling.validate()  # (InvalidRequestError is a ValueError: INVALID_ARGUMENT)
        ids = tokens.apply(s)
        if s.num_computed_tokens + s.num_new_tokens > len(ids) or s.num_prompt_tokens > len(ids):
            raise ValueError(f"sequence {s.request_id!r}: computes up to token "
                             f"{s.num_computed_tokens + s.num_new_tokens} of {len(ids)}")
        reqs.append(ScheduledRequest(
            request_id=s.request_id, token_ids=ids, num_computed_tokens=s.num_computed_tokens,
            num_new_tokens=s.num_new_tokens, block_table=list(s.block_table),
            sampling=sampling, do_sample=s.do_sample, num_prompt_tokens=s.num_prompt_tokens,
            num_output_tokens=s.num_output_tokens, pooling=s.pooling or None))
    bitmask = None
    if msg.bitmask_rows:
        import torch  # the backends read the mask as a torch tensor (llmserve/constraints.py)

        words = -(-vocab_size // 32)
        if len(msg.token_bitmask) != 4 * words * len(msg.bitmask_rows) or max(msg.bitmask_rows) >= len(reqs):
            raise ValueError(f"token_bitmask: {len(msg.token_bitmask)} bytes for {len(msg.bitmask_rows)} rows of "
                             f"{words} words, or a row past the batch's {len(reqs)} sequences")
        rows = np.frombuffer(msg.token_bitmask, dtype="<i4").reshape(len(msg.bitmask_rows), words)
        bitmask = torch.from_numpy(rows.astype(np.int32))
    return SchedulerOutput(requests=reqs, num_prefill_tokens=msg.num_prefill_tokens,
                           num_decode_tokens=msg.num_decode_tokens, block_size=msg.block_size or 16,
                           finished_request_ids=list(msg.finished_request_ids),
                           preempted_request_ids=list(msg.preempted_request_ids), token_bitmask=bitmask,
                           bitmask_rows=list(msg.bitmask_rows))


# --- the answer --------------------------------------------------------------------------------


def _logprob_to_proto(lp: Logprob) -> pb.Logprob:
    return pb.Logprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                      top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def _logprob_from_proto(msg: pb.Logprob) -> Logprob:
    return Logprob(msg.token_id, msg.logprob, msg.rank, [(t.token_id, t.logprob) for t in msg.top])


def output_to_proto(out: ModelOutput, n: int) -> pb.StepResult:
    """A backend's answer to an n-sequence batch as a message (one forward: more_token_ids is never asked for)."""
    msg = pb.StepResult()
    for i in range(n):
        res = msg.results.add()
        tok = out.sampled_token_ids[i]
        if tok is not None:
            res.token_id = tok
        if out.logprobs is not None and out.logprobs[i] is not None:
            res.logprob.CopyFrom(_logprob_to_proto(out.logprobs[i]))
        if out.prompt_logprobs is not None and out.prompt_logprobs[i] is not None:
            res.has_prompt_logprobs = True
            for lp in out.prompt_logprobs[i]:
                entry = res.prompt_logprobs.add()
                if lp is not None:
                    entry.value.CopyFrom(_logprob_to_proto(lp))
        if out.pooled is not None and out.pooled[i] is not None:
            res.has_pooled = True
            res.pooled.extend(out.pooled[i])
    return msg


def output_from_proto(msg: pb.StepResult, n: int) -> ModelOutput:
    """The ModelOutput of an n-sequence batch; ValueError when the worker answered another number of sequences."""
    if len(msg.results) != n:
        raise ValueError(f"the worker answered {len(msg.results)} sequences of a batch of {n}")
    res = msg.results
    logprobs = [_logprob_from_proto(r.logprob) if r.HasField("logprob") else None for r in res]
    plps = [[_logprob_from_proto(p.value) if p.HasField("value") else None for p in r.prompt_logprobs]
            if r.has_prompt_logprobs else None for r in res]
    pooled = [list(r.pooled) if r.has_pooled else None for r in res]
    return ModelOutput(sampled_token_ids=[r.token_id if r.HasField("token_id") else None for r in res],
                       logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
                       prompt_logprobs=plps if any(p is not None for p in plps) else None,
                       pooled=pooled if any(p is not None for p in pooled) else None)
