"""Which attention the engine runs, and the one call that registers `rollout_paged` (with the rest of the engine's
hooks) in transformers: `install()` hands upstream/patches.py the attention and mask functions of paged.py."""

from __future__ import annotations

from ..device import cuda
from ..upstream import NAME, current_attn_implementation
from ..upstream import install as install_hooks
from .paged import engine_mask, paged_attention_forward

AUTO = "auto"


def install() -> None:
    """Plug rollout's hooks into transformers (once, process-wide; later calls do nothing): `rollout_paged` and its
    mask entry, the scheduler, the memory plan, the block tables (upstream/patches.py lists each)."""
    install_hooks(paged_attention_forward, engine_mask)


def set_attn_implementation(model, impl: str) -> None:
    """Switch the model's attention (a no-op when it already runs `impl`); `rollout_paged` is registered first."""
    if impl == NAME:
        install()
    if current_attn_implementation(model) != impl:
        model.set_attn_implementation(impl)


def resolve_attn_implementation(requested: str | None, model) -> str | None:
    """What the engine runs: "auto" is `rollout_paged` on CPU, a mask-free one on CUDA (`cuda.auto_attention`: flash
    when it imports, else `rollout_paged`), the model's own elsewhere; None keeps the model's; anything else is used as
    given."""
    if requested != AUTO:
        return requested
    if model.device.type == "cuda":
        return cuda.auto_attention(model, current_attn_implementation(model), mask_free=NAME)
    return NAME if model.device.type == "cpu" else None
