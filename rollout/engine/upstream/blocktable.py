"""Block tables: how a decode-only step tells `rollout_paged` where each request's keys are.

Upstream's decode fast path describes a step whose every request decodes one token by a block table (each request's
pages, in order) instead of per-token read and write indices; building those indices is a Python list of every
cached position of every request, rebuilt each step. Upstream keeps the path for flash only (flash_attn_with_kvcache
reads and writes pages itself); `rollout_paged` reads and writes pages itself too (plan.py, attention.py), so:

- `keep_block_tables` (installed by `install()`) stands in for upstream's availability check: under `rollout_paged` the path stays on wherever
  every allocator supports block tables (full attention; sliding-window groups do not);
- `RolloutCache.fill_block_table` writes a request's row of the table through a numpy view of the host tensor: the
  same entries as upstream's (pinned by tests/test_upstream_contract.py), without the three small torch ops per
  request that cost ~75 us each on the host (9.6 ms for 128 requests, measured).
"""

from __future__ import annotations

from transformers.generation.continuous_batching import initialization
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from .attention import NAME

UPSTREAM_CHECK = initialization.ensure_decode_fast_path_is_available  # upstream's own, before install() replaces it


def keep_block_tables(config, cb_config, user_requested: bool) -> None:
    if config._attn_implementation != NAME:
        return UPSTREAM_CHECK(config, cb_config, user_requested)
    if not all(initialization.ATTN_TYPE_TO_ALLOCATOR[kind].supports_block_table
               for kind in initialization.group_layers_by_attn_type(config)):
        cb_config.max_blocks_per_request = 0



class RolloutCache(PagedAttentionCache):
    """The paged cache, filling block tables on the host without torch ops per request."""

    @classmethod
    def adopt(cls, cache: PagedAttentionCache) -> None:
        cache.__class__ = cls

    def fill_block_table(self, request_id: str, past_length: int, query_length: int, block_table) -> None:
        if block_table.device.type != "cpu":  # a device table: upstream's own copy
            return super().fill_block_table(request_id, past_length, query_length, block_table)
        rows = block_table.numpy()  # [allocators, width] view of the step's table
        for allocator in self.cache_allocators.values():
            blocks = allocator.block_table[request_id]
            row = rows[allocator.index, : len(blocks)]
            row[:] = blocks
            row *= allocator.block_physical_stride // allocator.tokens_per_page
