"""Default KV-cache allocator plugin: paged blocks with automatic prefix caching."""

from llmserve.hookspecs import hookimpl
from llmserve_paged_cache.allocator import PagedAllocator, block_hash

__all__ = ["PagedAllocator", "block_hash"]


def _build(config, num_blocks: int) -> PagedAllocator:
    from llmserve.config import check_options

    check_options(config.cache.options, {}, "cache.options (paged)")
    return PagedAllocator(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)


@hookimpl
def register_cache_allocators(register):
    """Register the paged allocator as "paged"."""
    register("paged", _build)
