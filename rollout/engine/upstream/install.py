"""install(): what rollout changes in transformers' module state, done once, explicitly, by the engine.

Importing rollout changes nothing in transformers (tests/test_upstream_contract.py checks it in a fresh process);
`install()` is called by the engine before it builds a manager and by `set_attn_implementation` before a model is
switched to `rollout_paged`. It is idempotent and thread-safe. What it changes, each listed in hooks.py:
- registers `rollout_paged` with transformers' `AttentionInterface` and `AttentionMaskInterface` (attention.py);
- registers `RolloutScheduler` in upstream's `SCHEDULER_MAPPING` under `SCHEDULER_NAME` (scheduler.py);
- replaces `initialization.ensure_decode_fast_path_is_available` by `keep_block_tables` (blocktable.py), which
  defers to upstream's own check for every attention but `rollout_paged`;
- wraps `PagedAttentionMemoryHandler.__init__` (`MemoryPlan.init`, memory.py), which changes nothing for other
  attentions;
- gives transformers' `continuous_batching.cache` module a `torch` whose host `zeros` of the cache's one allocation
  is lazily zeroed (`CacheTorch`, memory.py); every other call is torch's own.
"""

from __future__ import annotations

import threading

from transformers import AttentionInterface
from transformers.generation.continuous_batching import cache as cache_module
from transformers.generation.continuous_batching import initialization
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING
from transformers.masking_utils import AttentionMaskInterface

from .attention import NAME, engine_mask, paged_attention_forward
from .blocktable import keep_block_tables
from .memory import CacheTorch, MemoryPlan
from .scheduler import SCHEDULER_NAME, RolloutScheduler

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Plug rollout's hooks into transformers (once; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        AttentionInterface.register(NAME, paged_attention_forward)
        AttentionMaskInterface.register(NAME, engine_mask)
        SCHEDULER_MAPPING[SCHEDULER_NAME] = RolloutScheduler
        initialization.ensure_decode_fast_path_is_available = keep_block_tables
        PagedAttentionMemoryHandler.__init__ = MemoryPlan.init
        cache_module.torch = CacheTorch()
        _installed = True


def is_installed() -> bool:
    return _installed
