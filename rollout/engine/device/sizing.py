"""How big the engine's KV cache is: from WorkerConfig's budget (MiB, or a fraction of the device memory free when the
engine is built) to a number of blocks, and the start-up check that one request of `max_request_tokens` fits."""

from __future__ import annotations

import math

import torch
from transformers.utils.generic import is_flash_attention_requested

from ...base.config import WorkerConfig
from ...base.errors import invalid
from ..upstream import NAME, attn_mask_is_needed, current_attn_implementation, planned_memory

MIN_BLOCKS = 4
PLAN_MARGIN = 0.9  # of that, what a fraction budget's KV may take: the rest is the step's tensors and rounding


def kv_bytes_per_token(model) -> int:
    """K and V of one token for every layer, in the model's dtype."""
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize


def free_memory(device: torch.device) -> int:
    """Bytes free on the device now: the CUDA driver's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil  # only here: a GPU machine's Python may lack it

    return psutil.virtual_memory().available


def kv_budget_bytes(config: WorkerConfig, device: torch.device) -> int:
    """config must be resolved for the device (`WorkerConfig.for_device`): exactly one budget is set."""
    if config.kv_cache_memory_mb is not None:
        return config.kv_cache_memory_mb * 2**20
    return int(config.kv_cache_memory_fraction * free_memory(device))


def plan_cap_bytes(model) -> int:
    """The most KV a fraction budget may hold so that upstream's plan accepts the cache: under `rollout_paged` the
    plan charges each cache token its K and V in every layer plus one layer's read-back at the attention peak, so
    the KV is `layers / (layers + 1)` of what a cache token costs."""
    layers = model.config.get_text_config().num_hidden_layers
    return int(PLAN_MARGIN * planned_memory(model.device) * layers / (layers + 1))


def max_useful_tokens(config: WorkerConfig, model) -> int | None:
    """The most tokens the engine can hold at once: max_requests_per_batch requests of the model's longest sequence
    (None when the model states no maximum length)."""
    longest = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return None if not longest else config.max_requests_per_batch * longest


def num_blocks(config: WorkerConfig, model) -> int:
    """Blocks of `page_size` tokens: config.num_blocks, or what the budget holds. A budget that is a fraction of free
    memory stops at what the engine can use at once (`max_useful_tokens`: a small model on a big host would
    otherwise get millions of blocks of bookkeeping) and at what upstream's memory plan accepts (`plan_cap_bytes`);
    a budget in MiB is taken as given. Either is capped at
    max_cache_tokens when the attention allocates a dense mask, which grows with the cache."""
    if config.num_blocks is not None:
        return config.num_blocks
    budget = kv_budget_bytes(config, model.device)
    useful = max_useful_tokens(config, model)
    if config.kv_cache_memory_mb is None:
        budget = min(budget, plan_cap_bytes(model))
        if useful is not None:
            budget = min(budget, useful * kv_bytes_per_token(model))
    by_memory = budget // (kv_bytes_per_token(model) * config.page_size)
    if not attn_mask_is_needed(model.config):  # no dense mask to bound: the memory budget alone sizes it
        return max(MIN_BLOCKS, by_memory)
    return max(MIN_BLOCKS, min(by_memory, config.max_cache_tokens // config.page_size))


def check_request_fits(config: WorkerConfig, model, blocks: int, fits: int) -> None:
    """The ValueError that says what fits, when the cache (`blocks`, holding one request of at most `fits` tokens)
    cannot hold one request of config.max_request_tokens."""
    wanted = config.max_request_tokens
    if wanted is None or fits >= wanted:
        return
    # what the failing cache wastes per request (the allocator's spare pages) is charged to the bigger one as well
    spare = blocks * config.page_size - fits
    need_blocks = math.ceil((wanted + spare) / config.page_size)
    need_mb = math.ceil(need_blocks * config.page_size * kv_bytes_per_token(model) / 2**20)
    cap = "" if not attn_mask_is_needed(model.config) else \
        f", and max_cache_tokens >= {need_blocks * config.page_size} (this attention sizes a dense mask by it)"
    raise invalid("max_request_tokens", wanted,
                  f"the KV cache ({blocks} blocks of {config.page_size} tokens, "
                  f"{kv_bytes_per_token(model)} bytes per token) holds one request of at most {fits} tokens",
                  f"give the cache kv_cache_memory_mb >= {need_mb} (or num_blocks >= {need_blocks}){cap}, or send "
                  f"requests of at most {fits} tokens and set max_request_tokens <= {fits}")


def block_table_width(model, config: WorkerConfig, num_blocks: int) -> int:
    """max_blocks_per_request: the block-table width of upstream's decode fast path, in which a decode-only step passes
    each request's pages instead of per-token read and write indices (building those in Python cost 6% of a step at
    128 rows). On for attentions that read and write pages themselves: `rollout_paged` on any device, flash on CUDA
    (flash_attn_with_kvcache); 0 turns it off. Wide enough for the longest request (config.max_request_tokens, else
    the model's context, within the cache); longer requests decode on the varlen path."""
    pages_itself = current_attn_implementation(model) == NAME or (
        model.device.type == "cuda" and is_flash_attention_requested(model.config))
    if not pages_itself:
        return 0
    longest = config.max_request_tokens or getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if longest is None:
        return num_blocks
    return min(num_blocks, math.ceil(longest / config.page_size) + 1)
