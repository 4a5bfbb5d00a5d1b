"""The layout of one forward step's attention under `rollout_paged` (see attention.py for the kernels).

A `Plan` depends only on the step's sequence lengths and read indices, so the first layer of a forward builds it and
the others reuse it (`plan_for`, keyed on the identity of the step's `cu_seq_lens_q` tensor and `read_index` list).
Decode rows are ordered into buckets of similar key length; rows that share their first cache rows (forked samples,
prefix-cache hits) get a `SharedPrefixes` grid; each prefill row gets its own causal or bottom-right causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache

# Decode rows are bucketed by key length. A row joins the current bucket when padding the bucket to its length costs
# fewer key reads than one more SDPA call (CALL_TOKENS, in key tokens per row) and the bucket's KV stays small enough
# to be read straight back from the CPU cache by the SDPA that follows (BUCKET_BYTES).
CALL_TOKENS = 64
BUCKET_BYTES = 4 * 2**20


@dataclass
class DecodeBucket:
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
    buckets: list[DecodeBucket] = field(default_factory=list)
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


def plan_for(cache: PagedAttentionCache, allocator, kwargs) -> Plan:
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
            mask = None if lq == lk else bottom_right_causal(lq, lk, device)
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
        plan.buckets.append(DecodeBucket(start, start + n, read_index[grid.flatten()], max_len,
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


def bottom_right_causal(q_len: int, k_len: int, device, window: int = 0) -> torch.Tensor:
    """[q, k] bool, True = attend: query i sits at key position k_len - q_len + i (and sees `window` keys back when
    window > 0)."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window > 0:
        mask &= k_pos > q_pos - window
    return mask
