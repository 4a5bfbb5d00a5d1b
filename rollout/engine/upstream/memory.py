"""The engine's memory: upstream's memory plan under `rollout_paged`, and a KV cache on the host that costs only the
pages it uses."""

from __future__ import annotations

import numpy
import torch
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.utils import find_num_key_value_heads, get_device_and_memory_breakdown

from .attention import NAME

# upstream's memory plan lets the cache and the step's tensors use this share of the memory it sees as free
# (initialization.resolve_max_memory_percent, with max_memory_percent unset as the engine leaves it)
PLAN_SHARE = {"cpu": 0.6, "mps": 0.6}
PLAN_SHARE_DEFAULT = 0.9


class MemoryPlan:
    """Upstream's memory plan charges every attention but flash for a dense [batch tokens, cache tokens] mask and for
    KV repeated to every query head, so a large KV budget under `rollout_paged` failed the footprint check with a
    MemoryError for a mask that is never allocated (1 GiB of KV for the test model at 4096 batch tokens: 34 GB of
    phantom mask). Under `rollout_paged` the plan charges what it reads: no mask, K and V at their own head count."""

    original_init = PagedAttentionMemoryHandler.__init__

    @staticmethod
    def init(handler, config, *args, **kwargs) -> None:
        MemoryPlan.original_init(handler, config, *args, **kwargs)
        if config._attn_implementation == NAME:
            handler.num_attention_masks = 0
            handler.kv_heads_at_peak = 2 * find_num_key_value_heads(config)



def host_zeros(num_bytes: int) -> torch.Tensor:
    """A zeroed uint8 host tensor whose pages are committed only when first written: calloc (numpy's zeros) maps fresh
    zero pages from the kernel, where `torch.zeros` writes every byte at once (measured: 1.2 s and 1 GiB of resident
    memory per GiB, before a single token is cached)."""
    return torch.from_numpy(numpy.zeros(num_bytes, dtype=numpy.uint8))


class CacheTorch:
    """`torch` as transformers' cache module sees it: the same module, except that the paged cache's one allocation
    (`torch.zeros(bytes, dtype=torch.uint8, device=...)`, PagedAttentionCache.__init__) is `host_zeros` on the CPU.
    A host KV cache then costs the memory its cached tokens fill, not its whole budget, so the CPU default budget can
    be a share of the host's free memory (config.py) and a worker still starts in a fraction of a second."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, dtype=None, device=None, **kwargs) -> torch.Tensor:
        if len(size) == 1 and isinstance(size[0], int) and dtype == torch.uint8 and not kwargs \
                and device is not None and torch.device(device).type == "cpu":
            return host_zeros(size[0])
        return torch.zeros(*size, dtype=dtype, device=device, **kwargs)


def kv_pages(cache) -> tuple[int, int, int]:
    """(total, used, cached) pages of a paged cache, in whole-model pages (`cache.num_blocks`, what
    `WorkerConfig.num_blocks` sizes): used = held by requests; cached = held only by the prefix cache (evicted first
    under pressure); the rest is free. Computed from bytes, so it holds for models mixing attention types."""
    total_bytes = cache.num_sectors * cache.bytes_per_sector
    free_bytes = len(cache.pool.free_sectors) * cache.bytes_per_sector
    cached_bytes = 0
    for allocator in cache.cache_allocators.values():
        free_bytes += allocator.pool.count_free_blocks(allocator.index) * allocator.bytes_per_block
        cached_bytes += len(allocator.ledger.cached_blocks) * allocator.bytes_per_block
    total = cache.num_blocks
    used = (total_bytes - free_bytes - cached_bytes) * total // total_bytes
    return total, used, cached_bytes * total // total_bytes


def planned_memory(device: torch.device) -> int:
    """Bytes upstream's memory plan accepts for the cache with everything it charges beside it (its footprint check
    raises a MemoryError above it). On the host it counts the memory of the process's NUMA nodes, which on some
    virtual machines is far below MemAvailable (seen: 9 GB of nodes on a 24 GB host), less this process's RSS."""
    _, total, reserved, allocated = get_device_and_memory_breakdown()
    return int(PLAN_SHARE.get(device.type, PLAN_SHARE_DEFAULT) * max(0, total - max(allocated, reserved)))
