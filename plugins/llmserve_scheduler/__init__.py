"""Default scheduler plugin: continuous batching with FCFS or priority order."""

from llmserve.hookspecs import hookimpl
from llmserve_scheduler.continuous import ContinuousScheduler

__all__ = ["ContinuousScheduler"]


def _build(config, allocator) -> ContinuousScheduler:
    from llmserve.config import check_options

    s = config.scheduler
    check_options(s.options, {}, "scheduler.options (continuous)")
    return ContinuousScheduler(
        allocator,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        policy=s.policy,
        enable_chunked_prefill=s.enable_chunked_prefill,
    )


@hookimpl
def register_schedulers(register):
    """Register continuous batching as "continuous" (scheduler.policy picks fcfs or priority)."""
    register("continuous", _build)
