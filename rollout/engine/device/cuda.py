"""What the engine turns on for a CUDA device: flash attention by default, CUDA graphs and async batching (the decode
fast path's block tables: sizing.block_table_width). Nothing here runs on CPU (each choice is off there); none of it has been run on a GPU by this
project's tests, which is why each choice sits behind a guard that names what it needs (`device.type == "cuda"`, a
flash attention) and `WorkerConfig(cuda_graphs="off")` turns the captures off.
"""

from __future__ import annotations

import functools

import torch
from transformers.utils import is_flash_attn_2_available
from transformers.utils.generic import is_flash_attention_requested

FLASH = "flash_attention_2"


@functools.cache
def flash_attn_imports() -> bool:
    """The flash_attn package imports (not just installed: a wheel built for another torch fails here) and
    transformers accepts its version."""
    if not is_flash_attn_2_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception:  # ImportError, or an undefined symbol of a wheel built for another torch
        return False
    return True


def auto_attention(model, current: str, mask_free: str) -> str:
    """The engine's attention under "auto" on CUDA: the model's own if it is a flash implementation, else
    flash_attention_2 when flash_attn imports and the model is fp16 / bf16 (flash has no fp32 kernels), else
    `mask_free` (rollout_paged: PyTorch's own SDPA kernels per bucket of rows, no dense [batch tokens x cache tokens]
    mask). `current`: the attention the model runs now."""
    if is_flash_attention_requested(model.config):
        return current
    if model.dtype in (torch.float16, torch.bfloat16) and flash_attn_imports():
        return FLASH
    return mask_free


def captures(model, config) -> bool:
    """CUDA graphs and async batching, both or neither: on CUDA with a flash attention, unless config.cuda_graphs is
    "off". A captured step must run on the device alone: the sampler does (runner.py), `rollout_paged` does not (it
    plans each step on the host), and under sdpa the dense mask makes padded graph shapes cost more than they save
    (upstream's own rule)."""
    return (model.device.type == "cuda" and config.cuda_graphs == "auto"
            and is_flash_attention_requested(model.config))
