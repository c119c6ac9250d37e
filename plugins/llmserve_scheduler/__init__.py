"""Default scheduler plugin: continuous batching; scheduler.policy picks the order (fcfs, priority)."""

from llmserve.hookspecs import hookimpl
from llmserve_scheduler.continuous import ContinuousScheduler, PriorityScheduler

__all__ = ["ContinuousScheduler", "PriorityScheduler"]

POLICIES = {"fcfs": ContinuousScheduler, "priority": PriorityScheduler}


def _build(config, allocator) -> ContinuousScheduler:
    from llmserve.config import check_options
    from llmserve.errors import ConfigError

    s = config.scheduler
    check_options(s.options, {}, "scheduler.options (continuous)")
    cls = POLICIES.get(s.policy)
    if cls is None:
        raise ConfigError(f"{config.source}: scheduler.policy: the continuous scheduler knows "
                          f"{', '.join(map(repr, POLICIES))}, got {s.policy!r}")
    return cls(allocator, max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
               enable_chunked_prefill=s.enable_chunked_prefill, num_scheduler_steps=s.num_scheduler_steps)


@hookimpl
def register_schedulers(register):
    """Register continuous batching as "continuous" (scheduler.policy picks fcfs or priority)."""
    register("continuous", _build)
