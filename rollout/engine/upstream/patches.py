"""Every change rollout makes to process-wide state (transformers' registries and modules, torch's `nn.Linear`), each
done once, explicitly, by the engine, with what it plugs in handed in by the engine's rooms.

Importing rollout changes nothing (tests/test_upstream_contract.py checks it in a fresh process). Each function here
is idempotent and thread-safe:
- `install(attention, mask)` (the engine calls it, through `rollout.engine.attention.install`, before it builds a
  manager or switches a model to `rollout_paged`):
  - registers `rollout_paged` with transformers' `AttentionInterface` and `AttentionMaskInterface` (the forward and
    mask entry of rollout/engine/attention/paged.py);
  - registers `RolloutScheduler` in upstream's `SCHEDULER_MAPPING` under `SCHEDULER_NAME` (scheduler.py);
  - replaces `initialization.ensure_decode_fast_path_is_available` by `keep_block_tables` (blocktable.py), which
    defers to upstream's own check for every attention but `rollout_paged`;
  - wraps `PagedAttentionMemoryHandler.__init__` (`MemoryPlan.init`, memory.py), which changes nothing for other
    attentions;
  - gives transformers' `continuous_batching.cache` module a `torch` whose host `zeros` of the cache's one
    allocation is lazily zeroed (`CacheTorch`, memory.py); every other call is torch's own.
- `install_linear(flag, linear)` (an engine that runs its linears on oneDNN): `torch.nn.Linear.forward` asks
  `linear(module, input)` first on a thread whose `flag.on` is set (never while torch.compile traces); where that
  is unset or `linear` returns None, the forward that was there before runs.
- `install_fused(model, flag, rms_norm, rotary)` (an engine on a CPU with the fused kernels): the forward of each
  RMSNorm class of the model whose code is exactly Llama's, and the `apply_rotary_pos_emb` of each modeling module
  whose code is exactly Llama's, take the fused kernels the same way.
Wrapping once means a wrapper put over ours later (a profiler's timer) stays on top.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import threading
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.generation.continuous_batching import cache as cache_module
from transformers.generation.continuous_batching import initialization
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.llama import modeling_llama

from .attention import NAME
from .blocktable import keep_block_tables
from .memory import CacheTorch, MemoryPlan
from .scheduler import SCHEDULER_NAME, RolloutScheduler

_lock = threading.Lock()
_installed = False
_linear_installed = False


def install(attention: Callable, mask: Callable) -> None:
    """Plug rollout's hooks into transformers (once; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, mask)
        SCHEDULER_MAPPING[SCHEDULER_NAME] = RolloutScheduler
        initialization.ensure_decode_fast_path_is_available = keep_block_tables
        PagedAttentionMemoryHandler.__init__ = MemoryPlan.init
        cache_module.torch = CacheTorch()
        _installed = True


def is_installed() -> bool:
    return _installed


# ---------------------------------------------------------------------------------------------------- the linears
LinearForward = Callable[[torch.nn.Linear, torch.Tensor], "torch.Tensor | None"]


def install_linear(flag: threading.local, linear: LinearForward) -> None:
    """`nn.Linear.forward`, patched once: on a thread whose `flag.on` is set, `linear(self, input)` runs first; where
    it returns None (an input it does not take), or anywhere else, the forward that was there before (torch's, or
    whatever a profiler or library put there first). The trainer's linears pay one flag read."""
    global _linear_installed
    with _lock:
        if _linear_installed:
            return
        before = torch.nn.Linear.forward

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if getattr(flag, "on", False) and not torch.compiler.is_compiling():
                out = linear(self, input)
                if out is not None:
                    return out
            return before(self, input)

        forward.__wrapped__ = before
        torch.nn.Linear.forward = forward
        _linear_installed = True


def linear_is_installed() -> bool:
    return _linear_installed


# ------------------------------------------------------------------------------------------ norms and rotary
def _code(fn) -> str:
    """fn's code without its name, decorators and docstring: equal for two functions that compute the same thing."""
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    node.name, node.decorator_list, node.returns = "_", [], None
    if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
        node.body = node.body[1:]
    for arg in node.args.args + node.args.kwonlyargs:
        arg.annotation = None
    return ast.dump(node)


LLAMA_NORM = _code(modeling_llama.LlamaRMSNorm.forward)
LLAMA_ROTARY = _code(modeling_llama.apply_rotary_pos_emb)
LLAMA_ROTATE_HALF = _code(modeling_llama.rotate_half)
LLAMA_NORM_FORWARD = modeling_llama.LlamaRMSNorm.forward  # the references, whatever is patched later
LLAMA_APPLY_ROTARY = modeling_llama.apply_rotary_pos_emb
_patched: set = set()  # classes and modeling modules patched
_rejected: set = set()  # and those whose code is not Llama's (looked at once)

Norm = Callable[[torch.Tensor, torch.Tensor, float], "torch.Tensor | None"]
Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"]


def same_code(fn, code: str) -> bool:
    """Whether fn's code is `code` (one of LLAMA_*), names, docstrings and annotations aside."""
    try:
        return _code(fn) == code
    except (OSError, TypeError, SyntaxError, IndexError):  # no source (built-in, compiled, interactive)
        return False


def install_fused(model: torch.nn.Module, flag: threading.local, rms_norm: Norm, rotary: Rotary) -> bool:
    """Patches the Llama-exact RMSNorm classes and rotary functions of model's modules (once each, process-wide) to
    call `rms_norm(x, weight, eps)` / `rotary(q, k, cos, sin)` first on a thread whose `flag.on` is set (their None:
    the original runs); True where the model has any."""
    found = False
    with _lock:
        for cls in {type(module) for module in model.modules()}:  # each class and modeling module looked at once
            found = _patch_norm(cls, flag, rms_norm) | _patch_rotary(sys.modules.get(cls.__module__), flag, rotary) \
                | found
    return found


def _patch_norm(cls: type, flag: threading.local, rms_norm: Norm) -> bool:
    if cls in _patched:
        return True
    if cls in _rejected or not cls.__name__.endswith("RMSNorm") or not same_code(cls.forward, LLAMA_NORM):
        _rejected.add(cls)
        return False
    original = cls.forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if getattr(flag, "on", False) and not torch.compiler.is_compiling():
            out = rms_norm(hidden_states, self.weight, self.variance_epsilon)
            if out is not None:
                return out
        return original(self, hidden_states)

    forward.__wrapped__ = original
    cls.forward = forward
    _patched.add(cls)
    return True


def _patch_rotary(module, flag: threading.local, rotary: Rotary) -> bool:
    if module is None:
        return False
    if module in _patched:
        return True
    original, rotate_half = getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None)
    if module in _rejected or original is None or rotate_half is None or not same_code(original, LLAMA_ROTARY) or \
            not same_code(rotate_half, LLAMA_ROTATE_HALF):
        _rejected.add(module)
        return False

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and getattr(flag, "on", False) and not torch.compiler.is_compiling():
            pair = rotary(q, k, cos, sin)
            if pair is not None:
                return pair
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = original
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    _patched.add(module)
    return True
