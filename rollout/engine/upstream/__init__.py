"""The one room for transformers' private continuous-batching code: every hook rollout has on it lives here.

Only this subpackage imports `transformers.generation.continuous_batching` (tests/test_layout.py); every private
upstream name it uses is listed in `HOOKS` (hooks.py: symbol, file, why), which tests/test_upstream_contract.py checks
against the source and pins behaviour by behaviour. Nothing here changes transformers when imported: `install()`
(install.py) does, once, explicitly, and the engine calls it.

- attention.py, plan.py: `rollout_paged`, the mask-free paged attention, and its per-step layout;
- blocktable.py: the decode fast path's block tables under `rollout_paged`;
- memory.py: upstream's memory plan under `rollout_paged`, the lazily zeroed host cache, page counts;
- manager.py: the manager with every hook plugged in at construction (`Hooks`), its daemon loop thread;
- runner.py: per-row sampling with both logprobs, in the model runner's sampling step;
- scheduler.py: FIFO scheduling minus the 1-token fork crash; router.py: one output callback;
- preemption.py: counting soft resets under KV pressure; switch.py: what a weight switch does to cached KV;
- state.py: what a RequestState holds, read the one way that survives a soft reset.
"""

from transformers.generation.continuous_batching.requests import GenerationOutput, RequestState, RequestStatus
from transformers.generation.continuous_batching.utils import attn_mask_is_needed

from . import switch
from .attention import (NAME, current_attn_implementation, resolve_attn_implementation,
                        set_attn_implementation)
from .hooks import HOOKS, Hook
from .install import install, is_installed
from .manager import Hooks, RolloutManager
from .memory import kv_pages, planned_memory
from .runner import RowSlotArgs, TopReader
from .scheduler import CHILD_SEPARATOR, SCHEDULER_NAME

__all__ = ["CHILD_SEPARATOR", "HOOKS", "NAME", "SCHEDULER_NAME", "GenerationOutput", "Hook", "Hooks", "RequestState",
           "RequestStatus", "RolloutManager", "RowSlotArgs", "TopReader", "attn_mask_is_needed",
           "current_attn_implementation", "install", "is_installed", "kv_pages", "planned_memory",
           "resolve_attn_implementation", "set_attn_implementation", "switch"]
