"""The engine's memory: upstream's memory plan under `rollout_paged`, and a KV cache on the host that costs only the
pages it uses."""

from __future__ import annotations

import numpy
import torch
from transformers.generation.continuous_batching import cache as cache_module
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.utils import find_num_key_value_heads

from .attention import NAME


class _MemoryPlan:
    """Upstream's memory plan charges every attention but flash for a dense [batch tokens, cache tokens] mask and for
    KV repeated to every query head, so a large KV budget under `rollout_paged` failed the footprint check with a
    MemoryError for a mask that is never allocated (1 GiB of KV for the test model at 4096 batch tokens: 34 GB of
    phantom mask). Under `rollout_paged` the plan charges what it reads: no mask, K and V at their own head count."""

    original_init = PagedAttentionMemoryHandler.__init__

    @staticmethod
    def init(handler, config, *args, **kwargs) -> None:
        _MemoryPlan.original_init(handler, config, *args, **kwargs)
        if config._attn_implementation == NAME:
            handler.num_attention_masks = 0
            handler.kv_heads_at_peak = 2 * find_num_key_value_heads(config)


PagedAttentionMemoryHandler.__init__ = _MemoryPlan.init


def host_zeros(num_bytes: int) -> torch.Tensor:
    """A zeroed uint8 host tensor whose pages are committed only when first written: calloc (numpy's zeros) maps fresh
    zero pages from the kernel, where `torch.zeros` writes every byte at once (measured: 1.2 s and 1 GiB of resident
    memory per GiB, before a single token is cached)."""
    return torch.from_numpy(numpy.zeros(num_bytes, dtype=numpy.uint8))


class _CacheTorch:
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


cache_module.torch = _CacheTorch()
