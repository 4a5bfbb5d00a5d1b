"""Loading a model for the rollout side: one place, one dtype rule.

Every path that turns "a checkpoint directory" (or the weights of a live model) into a model goes through here: the
worker (`RolloutWorker(path)`), re-scoring (`rollout.score(path, ...)`), the CLI, and the fleet's actors. A model
object is always used as it is.

The dtype rule: an explicit `dtype` wins; otherwise fp32 on the CPU (bf16 / fp16 matmuls there are slow and far
from a trainer's fp32 forward), and the checkpoint's own dtype on a GPU ("auto": bf16 stays bf16, fp32 stays fp32).
A fleet actor rebuilding a live model from its state dict is told that state dict's dtype, so it holds the very
weights its source holds.

The attention a model is loaded with is the owner's ("sdpa" unless asked otherwise); the engine switches to its
own attention itself (`WorkerConfig.attn_implementation`) and back after each call.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from ..base.errors import invalid

LOADING_ATTENTION = "sdpa"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(device: torch.device | str, dtype: torch.dtype | None = None) -> torch.dtype | str:
    """The dtype rule (module docstring): `dtype` if given, else fp32 on CPU and "auto" (the checkpoint's) on GPU."""
    if dtype is not None:
        return dtype
    return torch.float32 if torch.device(device).type == "cpu" else "auto"


def loading_attention(requested: str | None) -> str:
    """The attention a checkpoint is loaded with, given `WorkerConfig.attn_implementation`: the one asked for, or
    sdpa for "auto" / None (the engine resolves "auto" itself once the model is on its device)."""
    return LOADING_ATTENTION if requested in (None, "auto") else requested


def load_model(model_or_path: Any, tokenizer: Any = None, dtype: torch.dtype | None = None,
               attn_implementation: str = LOADING_ATTENTION, device: torch.device | str | None = None,
               field: str = "model_or_path") -> tuple[Any, Any]:
    """(model, tokenizer). A model object (anything with `forward`) comes back as it is, with `tokenizer`. A local
    checkpoint directory is loaded on `device` (default: CUDA when present) under the dtype rule, with the tokenizer
    saved next to it when `tokenizer` is None (None if there is none: token-id inputs still work). Anything else
    is a ValueError naming `field`; nothing is ever downloaded."""
    if hasattr(model_or_path, "forward"):
        return model_or_path, tokenizer
    path = checkpoint_dir(model_or_path, field)
    from transformers import AutoModelForCausalLM

    device = torch.device(device) if device is not None else default_device()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(device, dtype),
                                                 attn_implementation=attn_implementation)
    model.to(device)
    return model, tokenizer if tokenizer is not None else load_tokenizer(path)


def model_from_state_dict(config: Any, state_dict: dict[str, torch.Tensor], generation_config: Any = None,
                          dtype: torch.dtype | None = None, attn_implementation: str = LOADING_ATTENTION,
                          device: torch.device | str | None = None, wrap: Any = None) -> Any:
    """A model rebuilt from its config and weights (a fleet actor's copy of a live model), under the dtype rule.
    `wrap(model) -> model` runs before the weights load (e.g. to add the PEFT adapters the weights include)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device) if device is not None else default_device()
    resolved = resolve_dtype(device, dtype)
    if resolved == "auto":  # no checkpoint to read a dtype from: the weights' own
        resolved = next((t.dtype for t in state_dict.values() if t.is_floating_point()), torch.float32)
    model = AutoModelForCausalLM.from_config(config, dtype=resolved, attn_implementation=attn_implementation)
    if wrap is not None:
        model = wrap(model)
    model.load_state_dict(state_dict)
    if generation_config is not None:
        model.generation_config = generation_config
    return model.to(device)


def checkpoint_dir(path: Any, field: str = "model_or_path", others: str = "a model object") -> str:
    """`path` as a string if it is a local directory, else the ValueError naming `field` (and `others`, what else
    the caller accepts)."""
    try:
        text = os.fspath(path)
    except TypeError:
        text = None
    if text is None or not os.path.isdir(text):
        raise invalid(field, text if text is not None else type(path).__name__,
                      f"not {others} nor a local checkpoint directory",
                      "pass a PreTrainedModel or the directory written by save_pretrained (nothing is downloaded)")
    return text


def load_tokenizer(path: str) -> Any:
    """The tokenizer saved in a checkpoint directory, or None when it holds none."""
    from transformers import AutoTokenizer

    with contextlib.suppress(OSError, ValueError, KeyError):
        return AutoTokenizer.from_pretrained(path)
    return None


def pad_token_id(tokenizer: Any) -> int:
    """The id that pads rows: the tokenizer's pad token, or 0 without a tokenizer or pad token (padding positions
    are masked, never read as tokens)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0
