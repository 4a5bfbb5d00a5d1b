"""`rollout_paged`: paged attention for transformers' continuous-batching engine without a dense mask.

With "sdpa", the engine gathers the KV of every sequence in the step into one tensor and runs one SDPA of all the
step's queries against all of it under a dense [batch tokens, cache tokens] mask: each decode query pays for every
other sequence's context, the KV heads are repeated for GQA, and the mask buffer is allocated and refilled every
step. Here, registered under the name `rollout_paged` through transformers' `AttentionInterface`:

- the engine allocates no mask (`attn_mask_is_needed` is false for any name but "sdpa" / "paged|eager");
- the cache write goes through `PagedAttentionCache.update` as with sdpa, but the read index is re-laid out once per
  forward step so the single read (`index_select`) returns the decode rows already padded into a
  [rows, max_len] grid, followed by the prefill rows, one after the other;
- all decode rows (one query token each) of a step run as one batched SDPA with a key-padding mask, their query
  heads grouped onto their KV heads (no `repeat_kv`); rows are bucketed by length so padding stays small;
- each prefill or prefill-chunk row runs its own SDPA: causal when it starts at position 0, bottom-right causal
  (a [q, k] mask) when it continues a chunk or a prefix-cache hit; GQA through SDPA's `enable_gqa`.
- Sliding-window layer groups read through the engine's own index and run one SDPA per row with a window mask.

Outside the engine (a plain forward, no paged cache) the function is transformers' sdpa, and the mask interface
entry is sdpa's: a trainer forward while `rollout_paged` is set is an ordinary sdpa forward. On the engine's loop
thread no mask is built at all.

The per-step layout (`Plan`) depends only on the step's sequence lengths and read indices, so it is built by the first
layer of a forward and reused by the others.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "rollout_paged"
AUTO = "auto"
# Bucketing of decode rows: a new bucket starts when padding the next (longer) row into the current bucket would
# cost more key reads than a fixed per-call overhead, expressed in key tokens.
BUCKET_OVERHEAD_TOKENS = 2048


@dataclass
class DecodeGroup:
    """Decode rows (one query token each) run as one SDPA over a [n, max_len] key grid."""

    query_index: torch.Tensor | None  # [n] positions of the rows' query tokens; None: the first n tokens, in order
    key_start: int  # offset of the grid in the read-back keys
    num_rows: int
    max_len: int
    mask: torch.Tensor | None  # [n, 1, 1, max_len] bool, True = attend; None when every row has max_len keys


@dataclass
class PrefillRow:
    """One sequence with several query tokens: its own SDPA."""

    query_start: int
    query_end: int
    key_start: int
    key_end: int
    mask: torch.Tensor | None  # [q, k] bool bottom-right causal; None means plain causal (q == k)


@dataclass
class Plan:
    """How one forward step's attention is laid out for one layer type (built once, used by every layer)."""

    read_index: list[torch.Tensor] | None  # replacement for kwargs["read_index"]; None keeps the engine's
    decode: list[DecodeGroup] = field(default_factory=list)
    prefill: list[PrefillRow] = field(default_factory=list)
    sliding_window: int | None = None
    rows: list[tuple[int, int, int, int]] = field(default_factory=list)  # sliding layers: (q0, q1, k0, k1) per row


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, cache: PagedAttentionCache | None = None, **kwargs):
    """query [1, H, T, D], key / value [1, Hkv, T, D] (T = the step's query tokens, packed); returns [1, T, H, D]."""
    if not isinstance(cache, PagedAttentionCache):  # a plain forward: transformers' sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if getattr(module, "sinks", None) is not None or kwargs.get("softcap") is not None or \
            kwargs.get("position_bias") is not None:
        raise NotImplementedError(f"{NAME} supports neither attention sinks, softcap nor position bias. Fix: use "
                                  "WorkerConfig(attn_implementation='sdpa') for this model.")
    allocator = cache.layer_to_allocator[module.layer_idx]
    plan = _plan_for(cache, allocator, kwargs)
    update_kwargs = dict(kwargs)
    if plan.read_index is not None:
        update_kwargs["read_index"] = plan.read_index
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=update_kwargs)
    # token-major views of the same memory: q [T, H, D], k / v [N, Hkv, D]
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    out = q.new_empty(q.shape[0], num_heads, v.shape[2])  # [T, H, Dv]
    if plan.sliding_window is not None:
        _sliding_rows(plan, q, k, v, out, scaling)
        return out.unsqueeze(0), None
    for g in plan.decode:  # one SDPA per bucket; query heads grouped onto their KV head: [n, Hkv, H / Hkv, D]
        qg = q[: g.num_rows] if g.query_index is None else q.index_select(0, g.query_index)
        qg = qg.reshape(g.num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
        grid = slice(g.key_start, g.key_start + g.num_rows * g.max_len)
        kg = k[grid].view(g.num_rows, g.max_len, num_kv_heads, -1).transpose(1, 2)  # [n, Hkv, L, D]
        vg = v[grid].view(g.num_rows, g.max_len, num_kv_heads, -1).transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scaling)
        og = og.reshape(g.num_rows, num_heads, -1)
        if g.query_index is None:
            out[: g.num_rows] = og
        else:
            out.index_copy_(0, g.query_index, og)
    gqa = num_heads != num_kv_heads
    for r in plan.prefill:
        qr = q[r.query_start: r.query_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        kr = k[r.key_start: r.key_end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, k, D]
        vr = v[r.key_start: r.key_end].transpose(0, 1).unsqueeze(0)
        orow = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=r.mask, is_causal=r.mask is None,
                                              scale=scaling, enable_gqa=gqa)
        out[r.query_start: r.query_end] = orow[0].transpose(0, 1)
    return out.unsqueeze(0), None


# ---------------------------------------------------------------------------------------------------- step layout
def _plan_for(cache: PagedAttentionCache, allocator, kwargs) -> Plan:
    """The step's layout for this allocator, built by the first layer of a forward. A forward is recognised by the
    identity of its `cu_seq_lens_q` tensor and `read_index` list, both created afresh for every forward."""
    stamp = (kwargs["cu_seq_lens_q"], kwargs["read_index"])
    cached = getattr(cache, "_rollout_plans", None)
    if cached is None or cached[0][0] is not stamp[0] or cached[0][1] is not stamp[1]:
        cached = (stamp, {})
        cache._rollout_plans = cached
    plan = cached[1].get(allocator.index)
    if plan is None:
        plan = _build_plan(allocator, kwargs)
        cached[1][allocator.index] = plan
    return plan


def _build_plan(allocator, kwargs) -> Plan:
    cu_q = kwargs["cu_seq_lens_q"].tolist()
    cu_k = kwargs["cu_seq_lens_k"][allocator.layer_type].tolist()
    read_index = kwargs["read_index"][allocator.index]
    # padded sequences (CUDA-graph padding) have zero query tokens: drop them
    lengths = [(cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]) for i in range(len(cu_q) - 1)
               if cu_q[i + 1] > cu_q[i]]
    starts_q = [cu_q[i] for i in range(len(cu_q) - 1) if cu_q[i + 1] > cu_q[i]]
    starts_k = [cu_k[i] for i in range(len(cu_q) - 1) if cu_q[i + 1] > cu_q[i]]
    if allocator.layer_type != "full_attention":
        window = getattr(allocator, "sliding_window", None) or 0
        rows = [(sq, sq + lq, sk, sk + lk) for sq, sk, (lq, lk) in zip(starts_q, starts_k, lengths)]
        return Plan(read_index=None, sliding_window=window, rows=rows)
    if read_index.numel() == 0:
        # no cache reads: the keys are the step's own tokens, laid out like the queries; every row is a fresh prefill
        rows = [PrefillRow(sq, sq + lq, sq, sq + lq, None) for sq, (lq, _) in zip(starts_q, lengths)]
        return Plan(read_index=None, prefill=rows)
    device = read_index.device
    decode_rows = [i for i, (lq, _) in enumerate(lengths) if lq == 1]
    prefill_rows = [i for i, (lq, _) in enumerate(lengths) if lq > 1]
    pieces, plan, offset = [], Plan(read_index=None), 0
    for bucket in _buckets(sorted(decode_rows, key=lambda i: lengths[i][1]), lengths):
        n, max_len = len(bucket), lengths[bucket[-1]][1]
        key_len = torch.tensor([lengths[i][1] for i in bucket], device=device)
        key_start = torch.tensor([starts_k[i] for i in bucket], device=device)
        pos = torch.arange(max_len, device=device)
        valid = pos[None, :] < key_len[:, None]  # [n, L]
        # padding reads repeat the row's last key (finite data), masked out below
        grid = key_start[:, None] + torch.minimum(pos[None, :], key_len[:, None] - 1)
        pieces.append(read_index[grid.flatten()])
        query_pos = [starts_q[i] for i in bucket]
        in_order = query_pos == list(range(n))
        plan.decode.append(DecodeGroup(
            query_index=None if in_order else torch.tensor(query_pos, device=device),
            key_start=offset, num_rows=n, max_len=max_len,
            mask=None if bool(valid.all()) else valid[:, None, None, :]))
        offset += n * max_len
    for i in prefill_rows:
        (lq, lk), sk = lengths[i], starts_k[i]
        pieces.append(read_index[sk: sk + lk])
        mask = None if lq == lk else _bottom_right_causal(lq, lk, device)
        plan.prefill.append(PrefillRow(starts_q[i], starts_q[i] + lq, offset, offset + lk, mask))
        offset += lk
    new_index = list(kwargs["read_index"])
    new_index[allocator.index] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    plan.read_index = new_index
    return plan


def _buckets(rows: list[int], lengths: list[tuple[int, int]]) -> list[list[int]]:
    """Split decode rows sorted by key length into buckets: a row joins the current bucket unless the extra padding
    that costs (the bucket's rows grown to its length) exceeds the fixed cost of one more SDPA call."""
    buckets: list[list[int]] = []
    for i in rows:
        length = lengths[i][1]
        if buckets:
            bucket = buckets[-1]
            extra_padding = len(bucket) * (length - lengths[bucket[-1]][1])
            if extra_padding <= BUCKET_OVERHEAD_TOKENS:
                bucket.append(i)
                continue
        buckets.append([i])
    return buckets


def _bottom_right_causal(q_len: int, k_len: int, device, window: int = 0) -> torch.Tensor:
    """[q, k] bool, True = attend: query i sits at key position k_len - q_len + i (and sees `window` keys back when
    window > 0)."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window > 0:
        mask &= k_pos > q_pos - window
    return mask


def _sliding_rows(plan: Plan, q, k, v, out, scaling) -> None:
    """Sliding-window layers: the engine's read-back keys of each row are its last (window - 1) cached tokens then
    its new ones; one SDPA per row with a bottom-right window mask."""
    gqa = q.shape[1] != k.shape[1]
    for q0, q1, k0, k1 in plan.rows:
        mask = _bottom_right_causal(q1 - q0, k1 - k0, q.device, plan.sliding_window)
        orow = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1).unsqueeze(0),
                                              k[k0:k1].transpose(0, 1).unsqueeze(0),
                                              v[k0:k1].transpose(0, 1).unsqueeze(0),
                                              attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[q0:q1] = orow[0].transpose(0, 1)


# ---------------------------------------------------------------------------------------------------- engine glue
class RolloutManager(ContinuousBatchingManager):
    """transformers' manager, accepting `rollout_paged` (upstream accepts only sdpa, paged|eager and flash), and
    marking its loop thread so that the model's mask creation is skipped there (see `engine_mask`)."""

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        if model.config._attn_implementation == NAME:
            return
        super().switch_to_cb_friendly_attn(model, auto_switch_to_flash)

    def _run_generation_loop(self, *args, **kwargs):
        _ENGINE_THREAD.active = True
        try:
            return super()._run_generation_loop(*args, **kwargs)
        finally:
            _ENGINE_THREAD.active = False


class _EngineThread(threading.local):
    active = False


_ENGINE_THREAD = _EngineThread()


def engine_mask(*args, **kwargs):
    """The mask interface entry of `rollout_paged`: sdpa's mask for a plain forward; nothing on the engine's loop
    thread, where the packed positions would otherwise make the model build a [tokens, tokens] mask every forward
    that paged attention never reads."""
    if _ENGINE_THREAD.active:
        return None
    return sdpa_mask(*args, **kwargs)


def resolve_attn_implementation(requested: str | None, model) -> str | None:
    """What the engine runs: "auto" is `rollout_paged` on CPU and the model's own attention elsewhere (flash or sdpa,
    whichever it was loaded with); None keeps the model's; anything else is used as given."""
    if requested != AUTO:
        return requested
    return NAME if model.device.type == "cpu" else None


AttentionInterface.register(NAME, paged_attention_forward)
AttentionMaskInterface.register(NAME, engine_mask)
