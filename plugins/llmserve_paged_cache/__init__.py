"""Default KV-cache allocator plugin: paged blocks with automatic prefix caching."""

from llmserve.hookspecs import hookimpl
from llmserve_paged_cache.allocator import BLOCK_KEYS, EVICTIONS, PagedAllocator, block_hash

__all__ = ["PagedAllocator", "block_hash"]

OPTIONS = {"block_key": "sha256"}  # sha256 | builtin (exact tuple keys: a hit compares the tokens)


def _build(config, num_blocks: int) -> PagedAllocator:
    from llmserve.config import check_options
    from llmserve.errors import ConfigError

    o = check_options(config.cache.options, OPTIONS, "cache.options (paged)")
    if o["block_key"] not in BLOCK_KEYS:
        raise ConfigError(f"cache.options.block_key: must be one of {', '.join(BLOCK_KEYS)}, got {o['block_key']!r}")
    if config.cache.eviction not in EVICTIONS:
        raise ConfigError(f"cache.eviction: must be one of {', '.join(EVICTIONS)}, got {config.cache.eviction!r}")
    return PagedAllocator(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, o["block_key"],
                          config.cache.eviction)


@hookimpl
def register_cache_allocators(register):
    """Register the paged allocator as "paged"."""
    register("paged", _build)
