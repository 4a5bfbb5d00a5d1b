"""What `rollout_paged` (rollout/engine/attention/) needs of transformers' private state: the name it is registered
under, the config field that says which attention a model runs, the paged cache's per-layer views it reads from, and
the engine thread's mark (no mask is built there). The attention's own algorithm lives in the engine's attention room;
it is registered by `install()` (patches.py), which the engine hands it to."""

from __future__ import annotations

import threading

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache

NAME = "rollout_paged"


class _EngineThread(threading.local):
    active = False


ENGINE_THREAD = _EngineThread()  # set by RolloutManager's loop (manager.py) while it runs on this thread


def current_attn_implementation(model) -> str:
    """The attention the model runs now (transformers keeps it on a private config field, with no public getter)."""
    return model.config._attn_implementation


def kv_views(allocator, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[cache rows, Hkv, D] views of one layer's keys and values in the paged cache, by the allocator's indices."""
    return allocator._kv_token_views[layer]


__all__ = ["ENGINE_THREAD", "NAME", "PagedAttentionCache", "current_attn_implementation", "kv_views"]
