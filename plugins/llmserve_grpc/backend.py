"""GrpcBackend: the server's side of the worker contract — every ModelBackend call becomes a call to a worker."""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc

from llmserve.batch import ModelOutput, SchedulerOutput
from llmserve.config import EngineConfig, ModelConfig, check_options
from llmserve.errors import BackendLostError, BackendUnavailableError, ConfigError, LLMServeError
from llmserve.interfaces import ModelBackend
from llmserve_grpc import worker_pb2 as pb
from llmserve_grpc import worker_pb2_grpc as pb_grpc
from llmserve_grpc.contract import NO_SESSION, PROTOCOL, batch_to_proto, output_from_proto

log = logging.getLogger("llmserve.grpc")

OPTIONS = {
    "address": None,  # the worker's host:port (required)
    "connect_timeout_s": 10.0,  # how long start-up waits for the worker to answer
    "timeout_s": 600.0,  # the longest one step may take on the worker before the step fails
}

# a long prompt's token ids, a large vocabulary's constraint mask or logprobs: beyond gRPC's default 4 MiB
MESSAGE_BYTES = 256 * 2**20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MESSAGE_BYTES), ("grpc.max_receive_message_length", MESSAGE_BYTES)]


class WorkerError(LLMServeError):
    """The worker is unreachable, too slow, or refused or failed a call; the message names its address."""


class WorkerUnavailable(WorkerError, BackendUnavailableError):
    """The worker is unreachable or silent: the step's requests fail with 503 (a retry may find it back)."""


class WorkerLost(WorkerError, BackendLostError):
    """The worker no longer holds this server's KV cache: what the scheduler believes computed is gone there."""


class GrpcBackend(ModelBackend):
    """A model served by `llmserve worker` (or any server of worker.proto) at backend.options.address."""

    def __init__(self, config: EngineConfig):
        o = check_options(config.backend.options, OPTIONS, "backend.options (grpc backend)")
        if not isinstance(o["address"], str) or not o["address"]:
            raise ConfigError("backend.options.address: the grpc backend needs its worker's host:port, e.g. "
                              "--set backend.options.address=127.0.0.1:50051 (start one with `llmserve worker`)")
        for key in ("connect_timeout_s", "timeout_s"):
            if isinstance(o[key], bool) or not isinstance(o[key], int | float) or not o[key] > 0:
                raise ConfigError(f"backend.options.{key}: must be a number of seconds > 0, got {o[key]!r}")
        self.address = o["address"]
        self.timeout_s = float(o["timeout_s"])
        self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.ModelWorkerStub(self.channel)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=float(o["connect_timeout_s"]))
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise WorkerError(f"no llmserve worker answers at {self.address} (waited {o['connect_timeout_s']:g} s): "
                              "start one with `llmserve worker --model M --host H --port P`, or correct "
                              "backend.options.address") from None
        self.session = ""
        self.held: dict[str, int] = {}  # request id → how many of its token ids the worker holds
        self._down = False  # a failure was logged; the next success logs the recovery
        info = self._call(self.stub.Connect, pb.ConnectRequest(protocol=PROTOCOL), self.timeout_s)
        if info.protocol != PROTOCOL:
            raise WorkerError(f"the worker at {self.address} speaks contract version {info.protocol}, this server "
                              f"{PROTOCOL}: run the same llmserve version on both")
        self.info = info
        if config.model.model == ModelConfig().model and info.model:
            # no --model: the worker's model names the served model and, for the tokenizer, where its files are (the
            # server reads the same config); what a server on another machine must then name itself
            config.model.model = info.model
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.eos_token_id = info.eos_token_id if info.HasField("eos_token_id") else None
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.generation_defaults = json.loads(info.generation_defaults_json or "{}")
        self.generation_defaults_source = info.generation_defaults_source or None
        self.default_tokenizer = info.default_tokenizer or None
        # the worker's tokenizer files are of use only where this server can read the same path
        self.tokenizer_path = info.tokenizer_path or None
        self.pooling = info.pooling or None  # embeddings: what the worker's backend pools, if anything
        self.hidden_size = info.hidden_size or None
        self.generates, self.causal = not info.encoder_only, not info.bidirectional
        log.info("connected to the llmserve worker at %s: %s backend, model %s", self.address, info.backend,
                 info.model)

    def _call(self, method, request, timeout: float):
        """One call to the worker, its failure as a WorkerError that names the address and what went wrong."""
        try:
            reply = method(request, timeout=timeout)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            if code == grpc.StatusCode.UNAVAILABLE:
                why = f"the llmserve worker at {self.address} is unreachable ({details})"
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                why = f"the llmserve worker at {self.address} did not answer within {timeout:g} s"
            elif code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(NO_SESSION):
                # it restarted, or another server initialised it: every KV block (prefix cache too) is gone there
                raise WorkerLost(f"the llmserve worker at {self.address} lost this server's KV cache ({details})") \
                    from None
            else:  # it answered: the engine logs the failed sequences with this message
                raise WorkerError(f"the llmserve worker at {self.address} answered {code.name}: {details}") from None
            if not self._down:  # once per outage: every sequence of a failed step reports it too
                log.error("%s; requests fail until it answers again", why)
                self._down = True
            raise WorkerUnavailable(why) from None
        if self._down:
            log.info("the llmserve worker at %s answers again", self.address)
            self._down = False
        return reply

    def num_kv_blocks(self, block_size: int) -> int:
        """What the worker's KV budget holds."""
        return self._call(self.stub.NumKvBlocks, pb.NumKvBlocksRequest(block_size=block_size),
                          self.timeout_s).num_blocks

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Have the worker allocate its KV cache; the session it returns names every later step."""
        reply = self._call(self.stub.InitKvCache, pb.InitKvCacheRequest(num_blocks=num_blocks, block_size=block_size),
                           self.timeout_s)
        self.session = reply.session
        self.held.clear()

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """Send the step, with only the token ids the worker does not hold yet, and read its tokens back."""
        for rid in batch.finished_request_ids:
            self.held.pop(rid, None)
        if not batch.requests and not batch.finished_request_ids:
            return ModelOutput(sampled_token_ids=[])
        reply = self._call(self.stub.Execute, batch_to_proto(batch, self.session, self.held), self.timeout_s)
        out = output_from_proto(reply, len(batch.requests))
        for r in batch.requests:
            self.held[r.request_id] = len(r.token_ids)
        return out

    def describe(self) -> dict[str, Any]:
        """The address and the worker's own report (its backend's describe()), or why it could not be read."""
        d: dict[str, Any] = {"backend": "grpc", "address": self.address, "worker_backend": self.info.backend,
                             "worker_id": self.info.worker_id, "model": self.info.model}
        try:
            d["worker"] = json.loads(self._call(self.stub.Describe, pb.DescribeRequest(), 5.0).json)
        except WorkerError as e:
            d["worker"] = {"error": str(e)}
        return d

    def shutdown(self) -> None:
        """Close the channel (the worker keeps running for the next server)."""
        self.channel.close()
