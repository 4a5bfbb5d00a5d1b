"""`rollout_paged`: paged attention for transformers' continuous-batching engine without a dense mask.

With "sdpa", the engine gathers the KV of every sequence in the step into one tensor and runs one SDPA of all the
step's queries against all of it under a dense [batch tokens, cache tokens] mask: each decode query pays for every
other sequence's context, the KV heads are repeated for GQA, and the mask buffer is allocated and refilled every
step. Here, registered under the name `rollout_paged` through transformers' `AttentionInterface`:

- the engine allocates no mask (`attn_mask_is_needed` is false for any name but "sdpa" / "paged|eager");
- the step's new KV is written into the paged cache by the engine's cache allocator as with sdpa, and read back per
  bucket of rows (not once for the whole step), so each bucket's keys are still in the CPU cache when its SDPA runs;
- decode rows (one query token each) are bucketed by key length; each bucket runs one SDPA with a key-padding mask
  (none when its rows have equal lengths, as the lock-step samples of one prompt do), query heads grouped onto their
  KV heads, so no `repeat_kv`;
- decode rows whose first keys are the same cache rows (the n forked samples of a prompt share its full pages; a
  prefix-cache hit shares them across requests) attend to that shared prefix once per group, every group of the step
  in one SDPA over a padded [groups, prefix] key grid, and to their own keys in their bucket; the two halves are
  merged by log-sum-exp in one vectorised pass (CPU: the flash kernel returns the log-sum-exp);
- every cache read lands in a workspace reused across reads, layers and steps (see `_Reader`);
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
from transformers.generation.continuous_batching.cache import PagedAttentionCache, PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.generation.continuous_batching.utils import find_num_key_value_heads
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "rollout_paged"
AUTO = "auto"
# Decode rows are bucketed by key length. A row joins the current bucket when padding the bucket to its length costs
# fewer key reads than one more SDPA call (CALL_TOKENS, in key tokens per row) and the bucket's KV stays small enough
# to be read straight back from the CPU cache by the SDPA that follows (BUCKET_BYTES).
CALL_TOKENS = 64
BUCKET_BYTES = 4 * 2**20


@dataclass
class Bucket:
    """Decode rows start:end (of the step's decode order) run as one SDPA over a [n, max_len] key grid."""

    start: int
    end: int
    read_index: torch.Tensor  # [n * max_len] physical cache rows of the grid (padding repeats a row's last key)
    max_len: int
    mask: torch.Tensor | None  # [n, 1, 1, max_len] additive (0 / -inf); None when every row has max_len keys


@dataclass
class SharedPrefixes:
    """Groups of decode rows whose first keys are the very same cache rows (forked samples of one prompt, prefix-cache
    hits): each group's shared keys are read and attended once for all its rows, every group in one SDPA over a
    [groups, max_len] key grid, then merged with each row's own keys by log-sum-exp.

    Queries sit in a [groups, group_size] slot grid (a smaller group repeats one of its rows in its spare slots, whose
    outputs are dropped)."""

    read_index: torch.Tensor  # [G * max_len] physical cache rows (padding repeats a group's last shared key)
    max_len: int
    mask: torch.Tensor | None  # [G, 1, 1, max_len] additive (0 / -inf); None when every group has max_len keys
    num_groups: int
    group_size: int
    slots: torch.Tensor | None  # [G * group_size] decode row of each query slot; None: slot i is row i
    row_slot: torch.Tensor | None  # [R] slot of each decode row, G * group_size for a row in no group; None: identity


@dataclass
class Decode:
    """Every decode row (one query token) of a step, ordered so that each bucket is a contiguous range."""

    query_index: torch.Tensor | None  # [R] positions of the rows' query tokens; None: the first R tokens, in order
    buckets: list[Bucket] = field(default_factory=list)
    prefix: SharedPrefixes | None = None

    @property
    def num_rows(self) -> int:
        return self.buckets[-1].end


@dataclass
class PrefillRow:
    """One sequence with several query tokens: its own SDPA."""

    query_start: int
    query_end: int
    read_index: torch.Tensor | None  # [k] physical cache rows of its keys; None: its keys are the step's own tokens
    mask: torch.Tensor | None  # [q, k] bool bottom-right causal; None means plain causal (q == k)


@dataclass
class Plan:
    """How one forward step's attention is laid out for one layer group (built once, used by every layer)."""

    decode: Decode | None = None
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
    layer = module.layer_idx
    allocator = cache.layer_to_allocator[layer]
    plan = _plan_for(cache, allocator, kwargs)
    q = query[0].transpose(0, 1)  # token-major view [T, H, D]
    out = q.new_empty(q.shape[0], q.shape[1], value.shape[-1])  # [T, H, Dv]
    if plan.sliding_window is not None:  # the engine's own read (ring buffer), then one SDPA per row
        key, value = cache.update(key_states=key, value_states=value, layer_idx=layer, kwargs=kwargs)
        _sliding_rows(plan, q, key[0].transpose(0, 1), value[0].transpose(0, 1), out, scaling)
        return out.unsqueeze(0), None
    # write the step's new KV ([T, Hkv, D]); an empty read index makes the allocator skip its read-back
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)
    no_read = kwargs["write_index"][allocator.index][:0]
    allocator.update(k_new, v_new, layer, no_read, kwargs["write_index"][allocator.index])
    read = _Reader(cache, allocator, layer)
    if plan.decode is not None:
        _decode(plan.decode, read, q, out, scaling)
    gqa = q.shape[1] != k_new.shape[1]
    for r in plan.prefill:
        if r.read_index is None:
            kr, vr = k_new[r.query_start: r.query_end], v_new[r.query_start: r.query_end]
        else:
            kr, vr = read(r.read_index)
        orow = F.scaled_dot_product_attention(q[r.query_start: r.query_end].transpose(0, 1).unsqueeze(0),
                                              kr.transpose(0, 1).unsqueeze(0), vr.transpose(0, 1).unsqueeze(0),
                                              attn_mask=r.mask, is_causal=r.mask is None, scale=scaling,
                                              enable_gqa=gqa)
        out[r.query_start: r.query_end] = orow[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _decode(plan: Decode, read: "_Reader", q: torch.Tensor, out: torch.Tensor, scaling: float | None) -> None:
    """All decode rows: one SDPA per bucket over the rows' own keys, query heads grouped onto their KV head
    ([n, Hkv, H / Hkv, D], no repeat_kv); then one SDPA of every shared prefix, merged in."""
    num_rows, num_heads, head_dim = plan.num_rows, q.shape[1], q.shape[2]
    num_kv_heads = read.num_kv_heads
    qd = q[:num_rows] if plan.query_index is None else q.index_select(0, plan.query_index)
    qd = qd.reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [R, Hkv, rep, D]
    od = qd.new_empty(qd.shape[:-1] + (out.shape[-1],))
    lse = qd.new_empty(qd.shape[:-1], dtype=torch.float32) if plan.prefix else None  # [R, Hkv, rep]
    for b in plan.buckets:
        k, v = read(b.read_index)  # [n * L, Hkv, D]
        k = k.view(b.end - b.start, b.max_len, num_kv_heads, -1).transpose(1, 2)  # [n, Hkv, L, D]
        v = v.view(b.end - b.start, b.max_len, num_kv_heads, -1).transpose(1, 2)
        if lse is None:
            od[b.start: b.end] = F.scaled_dot_product_attention(qd[b.start: b.end], k, v, attn_mask=b.mask,
                                                                scale=scaling)
        else:
            od[b.start: b.end], lse[b.start: b.end] = _attention_with_lse(qd[b.start: b.end], k, v, b.mask, scaling)
    if plan.prefix is not None:
        op, lp = _shared_prefixes(plan.prefix, read, qd, scaling)
        # merged in float64: a few thousand values per layer, and the two halves' fp32 rounding no longer adds up
        lse, lp = lse.double(), lp.double()
        total = torch.logaddexp(lse, lp)
        od = (od.double() * (lse - total).exp()[..., None] + op.double() * (lp - total).exp()[..., None]).to(qd.dtype)
    od = od.view(num_rows, num_heads, -1)
    if plan.query_index is None:
        out[:num_rows] = od
    else:
        out.index_copy_(0, plan.query_index, od)


def _shared_prefixes(p: SharedPrefixes, read: "_Reader", qd: torch.Tensor, scaling: float | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every decode row over its group's shared keys: (out [R, Hkv, rep, Dv], lse [R, Hkv, rep]), with
    lse = -inf and out = 0 for a row in no group."""
    num_rows, num_kv_heads, rep, head_dim = qd.shape
    groups, size = p.num_groups, p.group_size
    k, v = read(p.read_index)  # [G * P, Hkv, D]
    k = k.view(groups, p.max_len, num_kv_heads, -1).transpose(1, 2)  # [G, Hkv, P, D]
    v = v.view(groups, p.max_len, num_kv_heads, -1).transpose(1, 2)
    slots = qd if p.slots is None else qd.index_select(0, p.slots)  # [G * size, Hkv, rep, D]
    qp = slots.view(groups, size, num_kv_heads, rep, head_dim).transpose(1, 2).reshape(groups, num_kv_heads,
                                                                                       size * rep, head_dim)
    op, lp = _attention_with_lse(qp, k, v, p.mask, scaling)  # [G, Hkv, size * rep, Dv], [G, Hkv, size * rep]
    op = op.reshape(groups, num_kv_heads, size, rep, -1).transpose(1, 2).reshape(groups * size, num_kv_heads, rep, -1)
    lp = lp.reshape(groups, num_kv_heads, size, rep).transpose(1, 2).reshape(groups * size, num_kv_heads, rep)
    if p.row_slot is None:
        return op, lp
    # one extra slot for rows in no group: weight exp(-inf) = 0 on a zero output
    op = torch.cat([op, op.new_zeros((1,) + op.shape[1:])])
    lp = torch.cat([lp, lp.new_full((1,) + lp.shape[1:], float("-inf"))])
    return op.index_select(0, p.row_slot), lp.index_select(0, p.row_slot)


class _Reader:
    """Reads cache rows of one layer into a workspace kept on the cache and reused by every read of every layer and
    step (grown when a read needs more). Each read is consumed by its SDPA before the next one, so one buffer for
    keys and one for values suffice. Fresh tensors per read cost more than the copy itself on CPU: buffers of a few
    MiB come from mmap and are returned at free, so every read page-faulted its output in again."""

    def __init__(self, cache: PagedAttentionCache, allocator, layer: int) -> None:
        self.keys, self.values = allocator._kv_token_views[layer]  # [cache rows, Hkv, D] views of the paged cache
        self.num_kv_heads = allocator.num_key_value_heads
        spaces = cache.__dict__.setdefault("_rollout_workspace", {})
        self.space = spaces.setdefault(allocator.index, [self.keys.new_empty(0), self.values.new_empty(0)])

    def __call__(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = index.numel()
        if self.space[0].shape[0] < rows:
            size = rows + rows // 4
            self.space[:] = [self.keys.new_empty((size,) + self.keys.shape[1:]),
                             self.values.new_empty((size,) + self.values.shape[1:])]
        return (torch.index_select(self.keys, 0, index, out=self.space[0][:rows]),
                torch.index_select(self.values, 0, index, out=self.space[1][:rows]))


def _attention_with_lse(q, k, v, mask, scaling):
    """SDPA that also returns the log-sum-exp of each query's scores (the CPU flash kernel computes it anyway)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                          scale=scaling)
    return out, lse.float()


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
    live = [i for i in range(len(cu_q) - 1) if cu_q[i + 1] > cu_q[i]]
    starts_q, starts_k = [cu_q[i] for i in live], [cu_k[i] for i in live]
    lengths = [(cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]) for i in live]  # (query, key) tokens per row
    if allocator.layer_type != "full_attention":
        window = getattr(allocator, "sliding_window", None) or 0
        rows = [(sq, sq + lq, sk, sk + lk) for sq, sk, (lq, lk) in zip(starts_q, starts_k, lengths)]
        return Plan(sliding_window=window, rows=rows)
    if read_index.numel() == 0:
        # no cache reads: the keys are the step's own tokens, laid out like the queries; every row is a fresh prefill
        return Plan(prefill=[PrefillRow(sq, sq + lq, None, None) for sq, (lq, _) in zip(starts_q, lengths)])
    device = read_index.device
    plan = Plan()
    decode_rows = [i for i, (lq, _) in enumerate(lengths) if lq == 1]
    if decode_rows:
        plan.decode = _plan_decode(decode_rows, starts_q, starts_k, [lk for _, lk in lengths], read_index, allocator)
    for i, (lq, lk) in enumerate(lengths):
        if lq > 1:
            mask = None if lq == lk else _bottom_right_causal(lq, lk, device)
            plan.prefill.append(PrefillRow(starts_q[i], starts_q[i] + lq, read_index[starts_k[i]: starts_k[i] + lk],
                                           mask))
    return plan


def _plan_decode(rows: list[int], starts_q: list[int], starts_k: list[int], key_lens: list[int],
                 read_index: torch.Tensor, allocator) -> Decode:
    """Shared prefixes first (CPU only: merging needs the log-sum-exp that the CPU flash kernel returns), then
    buckets over each row's own keys, sorted by their number."""
    device = read_index.device
    offset = dict.fromkeys(rows, 0)  # keys of a row before `offset` are read through its shared prefix
    groups = []
    if device.type == "cpu" and len(rows) > 1:
        by_first: dict[int, list[int]] = {}
        first = read_index[torch.tensor([starts_k[i] for i in rows], device=device)].tolist()
        for i, f in zip(rows, first):
            by_first.setdefault(f, []).append(i)
        for members in by_first.values():
            span = min(key_lens[i] for i in members) - 1  # every row keeps at least its newest key
            if len(members) < 2 or span * (len(members) - 1) < CALL_TOKENS:
                continue
            seg = torch.stack([read_index[starts_k[i]: starts_k[i] + span] for i in members])  # [n, span]
            common = int((seg == seg[0]).all(0).int().cumprod(0).sum())
            if common * (len(members) - 1) >= CALL_TOKENS:  # the reads saved pay for one more call
                groups.append((members, common))
                offset.update(dict.fromkeys(members, common))
    own = {i: key_lens[i] - offset[i] for i in rows}
    order = sorted(rows, key=lambda i: own[i])
    query_pos = [starts_q[i] for i in order]
    plan = Decode(query_index=None if query_pos == list(range(len(order))) else torch.tensor(query_pos, device=device))
    bytes_per_token = 2 * allocator.num_key_value_heads * allocator.head_dim * allocator.cache_dtype.itemsize
    start = 0
    for bucket in _buckets(order, own, bytes_per_token):
        n, max_len = len(bucket), own[bucket[-1]]
        key_len = torch.tensor([own[i] for i in bucket], device=device)
        key_start = torch.tensor([starts_k[i] + offset[i] for i in bucket], device=device)
        pos = torch.arange(max_len, device=device)
        # padding reads repeat the row's last key (finite data), masked out
        grid = key_start[:, None] + torch.minimum(pos[None, :], key_len[:, None] - 1)
        plan.buckets.append(Bucket(start, start + n, read_index[grid.flatten()], max_len,
                                   _padding_mask(key_len, max_len, allocator.cache_dtype)))
        start += n
    if groups:
        plan.prefix = _plan_prefixes(groups, order, starts_k, read_index, allocator.cache_dtype)
    return plan


def _plan_prefixes(groups: list[tuple[list[int], int]], order: list[int], starts_k: list[int],
                   read_index: torch.Tensor, dtype: torch.dtype) -> SharedPrefixes:
    """Lay the shared-prefix groups out as one SDPA: key grid [G, max_len], query slots [G, group_size], groups in
    decode order, so that lock-step samples (contiguous groups of equal size) need no reordering at all."""
    device = read_index.device
    position = {i: r for r, i in enumerate(order)}
    groups = sorted((sorted(position[i] for i in members), common) for members, common in groups)
    size, max_len = max(len(rows) for rows, _ in groups), max(common for _, common in groups)
    slots, grid, row_slot = [], [], [size * len(groups)] * len(order)
    for rows, common in groups:
        for row in rows:
            row_slot[row] = len(slots)
            slots.append(row)
        slots += [rows[0]] * (size - len(rows))  # spare slots: any row of the group, outputs dropped
        first_key = starts_k[order[rows[0]]]
        grid += list(range(first_key, first_key + common)) + [first_key + common - 1] * (max_len - common)
    mask = _padding_mask(torch.tensor([common for _, common in groups], device=device), max_len, dtype)
    identity = list(range(len(order)))
    exact = len(slots) == len(order)  # every row in a group, no spare slot: the slot grid is the decode order
    return SharedPrefixes(read_index=read_index[torch.tensor(grid, device=device)], max_len=max_len, mask=mask,
                          num_groups=len(groups), group_size=size,
                          slots=None if exact and slots == identity else torch.tensor(slots, device=device),
                          row_slot=None if exact and row_slot == identity else torch.tensor(row_slot, device=device))


def _padding_mask(lengths: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """[n, 1, 1, max_len] additive key mask (0 for each row's first `lengths` keys, -inf after); None when no row is
    padded."""
    valid = torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]  # [n, max_len]
    if bool(valid.all()):
        return None
    mask = torch.zeros(lengths.numel(), 1, 1, max_len, dtype=dtype, device=lengths.device)
    return mask.masked_fill_(~valid[:, None, None, :], float("-inf"))


def _buckets(rows: list[int], key_lengths: dict[int, int], bytes_per_token: int) -> list[list[int]]:
    """Split decode rows sorted by key length into buckets (see CALL_TOKENS and BUCKET_BYTES)."""
    buckets: list[list[int]] = []
    for i in rows:
        length = key_lengths[i]
        if buckets:
            bucket = buckets[-1]
            padding = len(bucket) * (length - key_lengths[bucket[-1]])
            if padding <= CALL_TOKENS and (len(bucket) + 1) * length * bytes_per_token <= BUCKET_BYTES:
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


class _MemoryPlan:
    """Upstream's memory plan charges every attention but flash for a dense [batch tokens, cache tokens] mask and for
    KV repeated to every query head, so a large KV budget under `rollout_paged` failed the footprint check with a
    MemoryError for a mask that is never allocated (1 GiB of KV for the test model at 4096 batch tokens: 34 GB of
    phantom mask). Under `rollout_paged` the plan charges what it reads: no mask, K and V at their own head count."""

    original_init = PagedAttentionMemoryHandler.__init__

    @staticmethod
    def init(handler, config, *args, **kwargs) -> None:
        _MemoryPlan.original_init(handler, config, *args, **kwargs)
        if config._attn_implementation == NAME:
            handler.num_attention_masks = 0
            handler.kv_heads_at_peak = 2 * find_num_key_value_heads(config)


PagedAttentionMemoryHandler.__init__ = _MemoryPlan.init
AttentionInterface.register(NAME, paged_attention_forward)
AttentionMaskInterface.register(NAME, engine_mask)
