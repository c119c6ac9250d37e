"""The small abstract classes that plugins implement.

Hooks only *register* factories (see hookspecs.py); after start-up the engine calls these
objects directly, so no pluggy call sits on the per-token path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmserve.batch import Forwards

if TYPE_CHECKING:
    from llmserve.batch import ModelOutput, SchedulerOutput
    from llmserve.metrics import RequestMetrics, StepMetrics
    from llmserve.request import Request, RequestStatus, StructuredOutput
    from llmserve.stats import CacheStats, SchedulerStats


class CacheAllocator(ABC):
    """Hands out KV-cache block ids to sequences for its scheduler; never touches tensors (the backend does)."""

    block_size: int
    num_blocks: int

    @abstractmethod
    def lookup_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Return how many leading tokens are already cached (whole blocks, always < len(token_ids)); no state change."""

    @abstractmethod
    def allocate(self, seq_id: str, token_ids: Sequence[int], num_tokens: int,
                 use_prefix_cache: bool = True, salt: str | None = None) -> int | None:
        """Reserve slots for positions [0, num_tokens) of seq_id; all or nothing.

        On a sequence's first allocation (and when use_prefix_cache), reuse the cached prefix
        blocks of the same salt first and return how many tokens they cover; later allocations
        return 0. Return None, changing nothing, when there are not enough free blocks.
        """

    @abstractmethod
    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Make the sequence's blocks that are full of computed tokens findable by prefix lookup."""

    @abstractmethod
    def free(self, seq_id: str) -> None:
        """Release every block the sequence holds (finish, abort or preemption)."""

    @abstractmethod
    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's block ids in position order (the live list: read only)."""

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take now (free plus evictable cached ones)."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """Used / free / cached blocks, fragmentation, prefix-cache counters and evictions."""

    def reset_prefix_cache(self) -> None:  # noqa: B027 - optional
        """Forget every cached block that no sequence holds."""

    def held_block_keys(self) -> list[bytes]:
        """The sha256 keys of the full blocks whose KV it holds (what a prefix-aware router reads); [] if none."""
        return []


class Scheduler(ABC):
    """Owns the waiting and running sequences and their KV blocks; decides each step's work.

    The scheduler alone moves a sequence between its queues and sets its status on the way (WAITING, PREFILL,
    DECODE); the engine only ends sequences, through end()."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new sequence as WAITING; raise InvalidRequestError (naming the field) for one this policy cannot
        take."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within the token budget: admit WAITING sequences (PREFILL), allocate, preempt
        (back to WAITING, listed in preempted_request_ids), and return it."""

    @abstractmethod
    def update_from_output(self, output: SchedulerOutput, model_output: ModelOutput) -> None:
        """After the forward: advance each scheduled sequence's computed tokens, cache its full blocks, and move one
        that sampled (ScheduledRequest.do_sample) to DECODE."""

    @abstractmethod
    def finish(self, request_ids: Iterable[str]) -> None:
        """Drop ended sequences from either queue and free their blocks; unknown ids are ignored."""

    def end(self, request: Request, status: RequestStatus) -> None:
        """End a sequence with the engine's verdict (FINISHED or FAILED): set its status, then finish() it."""
        request.status = status
        self.finish((request.request_id,))

    @abstractmethod
    def stats(self) -> SchedulerStats:
        """Queue lengths, preemptions and the cache's stats, as declared types."""

    def limit_forwards(self, forwards: Forwards) -> None:  # noqa: B027 - optional
        """Offer a batch of decodes only the forwards the backend runs (its ModelBackend.forwards); default: one."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Sequences waiting for admission (new or preempted)."""

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Sequences holding KV blocks and being computed."""

    @property
    def has_unfinished(self) -> bool:
        return self.num_waiting + self.num_running > 0


class ModelBackend(ABC):
    """Computes tokens: one forward over a flattened batch, then sampling."""

    vocab_size: int
    max_model_len: int
    eos_token_id: int | None = None
    # every id that ends a sequence, where a model declares several (generation_config.json, a GGUF's eot)
    eos_token_ids: frozenset[int] = frozenset()
    # the model's default SamplingParams fields (generation_config.json): requests that leave them out get these
    generation_defaults: dict[str, Any] = {}  # noqa: RUF012 - read only
    # where generation_defaults came from (a file, a model card), for /v1/models; None: nowhere
    generation_defaults_source: str | None = None
    default_tokenizer: str | None = None  # the registered tokenizer that tokenizer "auto" means for this model
    # a local directory of tokenizer files the backend's model source produced (a GGUF's, say); the engine
    # hands it to the tokenizer as model.tokenizer when the config names none
    tokenizer_path: str | None = None
    # the forwards one execute() may run on a batch of decodes (llmserve.batch.Forwards); one a step by default.
    # Read after init_kv_cache
    forwards: Forwards = Forwards()
    # set by the engine around an execute() of several forwards: called as on_forward(j, tokens) with forward j's
    # tokens (one a sequence; j = 0, 1, ... in order) as soon as they exist, while execute() still runs (from
    # another thread; never after execute() returns); a backend that cannot simply never calls it
    on_forward: Callable[[int, list[int]], None] | None = None
    # embeddings (llmserve/pooling.py): the pooling a sequence with ScheduledRequest.pooling gets by default (last |
    # mean | cls); None: this backend cannot pool, and the engine refuses embedding requests
    pooling: str | None = None
    hidden_size: int | None = None  # the length of a pooled vector
    generates: bool = True  # False: an encoder, which answers embedding requests only
    causal: bool = True  # False: bidirectional attention, so a prompt is computed in one step (never chunked)

    @abstractmethod
    def num_kv_blocks(self, block_size: int) -> int:
        """How many KV blocks of block_size tokens the backend's memory budget holds."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the KV tensors for num_blocks blocks."""

    @abstractmethod
    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """Run one forward over the batch, write K/V through the block tables, sample; for the sequences with
        `pooling`, return their chunk's pooled sum in ModelOutput.pooled instead (llmserve.pooling.pooled_rows)."""

    def describe(self) -> dict[str, Any]:
        """Facts worth logging and reporting (model, dtype, device, kernel)."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 - optional
        """Release threads, memory and files."""


class Tokenizer(ABC):
    """Text ↔ token ids, plus the chat template."""

    eos_token_id: int | None = None
    vocab_size: int
    chat_template: str | None = None  # the chat template's Jinja text, if it has one (tool parser auto reads it)

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (may end in U+FFFD when a multi-byte character is cut)."""

    def vocab_bytes(self) -> list[bytes]:
        """Every token id's exact bytes, in id order (grammar engines build their token trie from it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its vocabulary")

    def apply_chat_template(self, messages: list[dict[str, Any]], /, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False, **kwargs) -> str:
        """Render chat messages into one prompt string; tools (OpenAI's shape) and kwargs are the template's."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    @property
    def all_special_ids(self) -> set[int]:
        return set() if self.eos_token_id is None else {self.eos_token_id}


class GrammarMatcher(ABC):
    """One sequence's position in a compiled grammar: which tokens may come next, and the ones taken."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into int32 bitmask[row] (bit t % 32 of word t // 32 set = allowed).

        Raise ValueError when the grammar cannot go on (an engine limit): that sequence alone fails.
        """

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it, ValueError where the grammar
        reaches the engine's limits (the request fails with a 400 naming its constraint)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the grammar is complete and allows no further token (the sequence ends with STOP)."""


class GrammarEngine(ABC):
    """Compiles constraints (JSON schema, regex, choice, Lark grammar) against one tokenizer's vocabulary."""

    @abstractmethod
    def compile(self, spec: StructuredOutput) -> Any:
        """A compiled grammar for spec (thread-safe, cached by the caller); InvalidRequestError naming spec.param if bad."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one tool call: its name in the first piece of the call, then pieces of its JSON arguments."""

    index: int  # which call of the choice, from 0
    name: str | None = None
    arguments: str = ""


class ToolParser(ABC):
    """Splits one choice's generated text into content and tool calls as it streams; one instance per choice."""

    @abstractmethod
    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """Take the next piece of text (final: the last); return the content to send now and the call pieces."""


class ReasoningParser(ABC):
    """Splits one choice's generated text into reasoning and content as it streams; one instance per choice."""

    @abstractmethod
    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Take the next piece of text (final: the last); return the (reasoning, content) to send now."""


class MetricSink(ABC):
    """Receives per-step and per-request measurements from the engine."""

    def on_step(self, metrics: StepMetrics) -> None:  # noqa: B027 - optional
        """Called once per engine step (keep it cheap: it runs inside the step loop)."""

    def on_request_finished(self, metrics: RequestMetrics) -> None:  # noqa: B027 - optional
        """Called once per finished, failed or aborted sequence."""

    def on_scheduler_stats(self, stats: SchedulerStats) -> None:  # noqa: B027 - optional
        """Called whenever running, waiting or cache usage change: after each step, abort, and when idle."""

    def close(self) -> None:  # noqa: B027 - optional
        """Flush and close."""


@dataclass(slots=True)
class ReplicaLoad:
    """What a router knows of one engine replica: its id, requests in flight, the block keys it holds."""

    replica_id: str
    in_flight: int = 0
    keys: frozenset[int] = frozenset()  # llmserve_ray.prefix.short_key of each held block


class Router(ABC):
    """Picks the replica for a request from the request's leading block keys and the replicas' loads."""

    @abstractmethod
    def rank(self, keys: Sequence[int], replicas: Sequence[ReplicaLoad]) -> list[list[int]]:
        """Indices into replicas in ranks, best first; a rank's members are equally good (the least loaded wins)."""

    def routed(self, keys: Sequence[int], replica_id: str) -> None:  # noqa: B027 - optional
        """The request went to replica_id (a router may remember its keys until the replica reports them)."""


class ResponseStore(ABC):
    """Keeps POST /v1/responses' stored answers by id, each a JSON-able record; called from worker threads, so an
    implementation guards its own state."""

    @abstractmethod
    def put(self, response_id: str, record: dict[str, Any]) -> None:
        """Store (or replace) the record of response_id; a store with a cap may drop older records to make room."""

    @abstractmethod
    def get(self, response_id: str) -> dict[str, Any] | None:
        """The record of response_id, or None when it was never stored, was deleted or was dropped."""

    @abstractmethod
    def delete(self, response_id: str) -> bool:
        """Forget response_id; whether it was there."""
