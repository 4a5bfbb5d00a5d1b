"""The engine's attention: `rollout_paged`, the mask-free paged attention that reads the KV cache where it lies, and
which attention the engine runs on each device.

- paged.py: the attention forward and its mask entry (registered in transformers by `install()`);
- plan.py: one step's layout (decode buckets, shared prefixes, prefill rows), built by the first layer;
- choice.py: `install()`, `resolve_attn_implementation` ("auto" per device) and `set_attn_implementation`.

May import: the engine's `upstream` (the cache class and its views, the registered name), `kernels` (the paged decode
kernel) and `device` (what a CUDA device offers). Nothing here changes transformers on import.
"""

from .choice import AUTO, install, resolve_attn_implementation, set_attn_implementation
from .paged import engine_mask, paged_attention_forward

__all__ = ["AUTO", "engine_mask", "install", "paged_attention_forward", "resolve_attn_implementation",
           "set_attn_implementation"]
