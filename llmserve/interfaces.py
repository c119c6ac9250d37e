"""The small abstract classes that plugins implement.

Hooks only *register* factories (see hookspecs.py); after start-up the engine calls these
objects directly, so no pluggy call sits on the per-token path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmserve.batch import ModelOutput, ScheduledBatch
    from llmserve.metrics import RequestMetrics, StepMetrics
    from llmserve.request import Request


class CacheAllocator(ABC):
    """Hands out KV-cache block ids to sequences; never touches tensors (the backend owns those)."""

    block_size: int
    num_blocks: int

    @abstractmethod
    def lookup_prefix(self, token_ids: Sequence[int]) -> int:
        """Return how many leading tokens are already cached (whole blocks, always < len(token_ids)); no state change."""

    @abstractmethod
    def allocate(self, seq_id: str, token_ids: Sequence[int], num_tokens: int,
                 use_prefix_cache: bool = True) -> int | None:
        """Reserve slots for positions [0, num_tokens) of seq_id; all or nothing.

        On a sequence's first allocation (and when use_prefix_cache), reuse the cached prefix
        blocks first and return how many tokens they cover; later allocations return 0.
        Return None, changing nothing, when there are not enough free blocks.
        """

    @abstractmethod
    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Make the sequence's blocks that are full of computed tokens findable by prefix lookup."""

    @abstractmethod
    def fork(self, parent_id: str, child_id: str) -> None:
        """Give child_id the parent's blocks (shared, ref-counted; a shared partial block is copied on write)."""

    @abstractmethod
    def free(self, seq_id: str) -> None:
        """Release every block the sequence holds (finish, abort or preemption)."""

    @abstractmethod
    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's block ids in position order (the live list: read only)."""

    @abstractmethod
    def take_block_copies(self) -> list[tuple[int, int]]:
        """Return and clear the copy-on-write (src, dst) pairs made since the last call."""

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take now (free plus evictable cached ones)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Used / free / cached blocks, utilization, fragmentation and prefix-cache counters."""

    def reset_prefix_cache(self) -> None:  # noqa: B027 - optional
        """Forget every cached block that no sequence holds."""


class Scheduler(ABC):
    """Decides, each step, which sequences run and how many tokens each computes."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new (WAITING) sequence."""

    @abstractmethod
    def add_running(self, request: Request) -> None:
        """Take a sequence that already holds blocks (a forked child) straight into the running set."""

    @abstractmethod
    def schedule(self) -> ScheduledBatch:
        """Pick this step's work within the token budget; allocate, preempt, and return the batch."""

    @abstractmethod
    def finish(self, request: Request) -> None:
        """Remove a done sequence (finished, failed or aborted) and free its blocks."""

    @abstractmethod
    def get(self, request_id: str) -> Request | None:
        """The queued or running sequence with this id, if any."""

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

    @abstractmethod
    def num_kv_blocks(self, block_size: int) -> int:
        """How many KV blocks of block_size tokens the backend's memory budget holds."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the KV tensors for num_blocks blocks."""

    @abstractmethod
    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one forward over the batch, write K/V through the block tables, sample."""

    def describe(self) -> dict[str, Any]:
        """Facts worth logging and reporting (model, dtype, device, kernel)."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 - optional
        """Release threads, memory and files."""


class Tokenizer(ABC):
    """Text ↔ token ids, plus the chat template."""

    eos_token_id: int | None = None
    vocab_size: int

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (may end in U+FFFD when a multi-byte character is cut)."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render chat messages into one prompt string."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    @property
    def all_special_ids(self) -> set[int]:
        return set() if self.eos_token_id is None else {self.eos_token_id}


class MetricSink(ABC):
    """Receives per-step and per-request measurements from the engine."""

    def on_step(self, metrics: StepMetrics) -> None:  # noqa: B027 - optional
        """Called once per engine step (keep it cheap: it runs inside the step loop)."""

    def on_request_finished(self, metrics: RequestMetrics) -> None:  # noqa: B027 - optional
        """Called once per finished, failed or aborted sequence."""

    def close(self) -> None:  # noqa: B027 - optional
        """Flush and close."""
