"""The engine's memory plan under `rollout_paged` (a patch of upstream's PagedAttentionMemoryHandler)."""

from __future__ import annotations

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
