"""The one room for transformers' private continuous-batching code, and for every change rollout makes to
process-wide state: it subclasses and hooks upstream's classes, and nothing else.

Only this subpackage imports `transformers.generation.continuous_batching` (tests/test_layout.py); every private
upstream name it uses is listed in `HOOKS` (hooks.py: symbol, file, why), which tests/test_upstream_contract.py checks
against the source and pins behaviour by behaviour. Nothing here changes anything when imported: the functions of
patches.py do, once each, explicitly, called by the engine.

May import: transformers, torch and rollout's `base`; nothing of the engine outside it. What a hook runs that is the
engine's own (the paged attention, the step's sampling, verification, the kernels' forwards) is handed in at
construction or to `install*()`, typed here by the protocol it must follow (`runner.StepSampling`).

- patches.py: every process-wide change (listed in `PATCHES`: the attention and scheduler registries, the memory plan,
  the block tables, `nn.Linear.forward`, Llama-exact norms and rotary), each once; hooks.py: both tables;
- attention.py: what `rollout_paged` needs of upstream (its name, the model's attention, the cache's views);
- blocktable.py: the decode fast path's block tables under `rollout_paged`;
- memory.py: upstream's memory plan under `rollout_paged`, the lazily zeroed host cache, page counts;
- manager.py: the manager with every hook plugged in at construction (`Hooks`), its daemon loop thread;
- runner.py: the model runner's step with the engine's sampling plugged in, and its output rows;
- processor.py: verify rows settled after upstream's update; the pages a rollback frees;
- scheduler.py: FIFO scheduling minus the 1-token fork crash; router.py: one output callback;
- preemption.py: counting soft resets under KV pressure; switch.py: what a weight switch does to cached KV;
- state.py: what a RequestState holds, read the one way that survives a soft reset.
"""

from transformers.generation.continuous_batching.requests import GenerationOutput, RequestState, RequestStatus
from transformers.generation.continuous_batching.utils import attn_mask_is_needed

from . import switch
from .attention import ENGINE_THREAD, NAME, PagedAttentionCache, current_attn_implementation, kv_views
from .hooks import HOOKS, PATCHES, Hook, Patch
from .patches import install, install_fused, install_linear, is_installed
from .manager import Hooks, RolloutManager
from .memory import kv_pages, planned_memory
from .processor import complete_blocks, release_pages_past
from .runner import RowSlotArgs, StepSampling, TopReader
from .scheduler import CHILD_SEPARATOR, SCHEDULER_NAME
from .state import history, stop_ids

__all__ = ["CHILD_SEPARATOR", "ENGINE_THREAD", "HOOKS", "NAME", "PATCHES", "SCHEDULER_NAME", "GenerationOutput", "Hook",
           "Hooks", "PagedAttentionCache", "Patch", "RequestState", "RequestStatus", "RolloutManager", "RowSlotArgs",
           "StepSampling", "TopReader", "attn_mask_is_needed", "complete_blocks", "current_attn_implementation",
           "history", "install", "install_fused", "install_linear", "is_installed", "kv_pages", "kv_views",
           "planned_memory", "release_pages_past", "stop_ids", "switch"]
