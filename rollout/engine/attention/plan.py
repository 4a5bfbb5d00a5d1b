"""The layout of one forward step's attention under `rollout_paged` (see attention.py for the kernels).

A `Plan` depends only on the step's sequence lengths and read indices, so the first layer of a forward builds it and
the others reuse it (`plan_for`, keyed on the identity of the step's `cu_seq_lens_q` tensor and `read_index` list).
Decode rows are ordered into buckets of similar key length; rows that share their first cache rows (forked samples,
prefix-cache hits) get a `SharedPrefixes` grid; each prefill row gets its own causal or bottom-right causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from ..upstream import PagedAttentionCache

from ..kernels import decode_kernel

# Decode rows are bucketed by key length. A row joins the current bucket when padding the bucket to its length costs
# fewer key reads than one more SDPA call (CALL_TOKENS, in key tokens per row) and the bucket's KV stays small enough
# to be read straight back from the CPU cache by the SDPA that follows (BUCKET_BYTES).
CALL_TOKENS = 64
BUCKET_BYTES = 4 * 2**20
# Rows of up to this many query tokens run on the paged decode kernel where it runs, one kernel row per query token:
# a verify row (a next token and up to 32 drafts) or a short prefill chunk then costs what as many decode rows cost,
# instead of an SDPA call of its own over keys read into the workspace.
KERNEL_QUERY_TOKENS = 33
# On a GPU (no kernel there), rows of up to this many query tokens join the decode buckets the same way, one bucket
# row per query token over the keys up to its position: a step of many verify rows then makes a few SDPA calls a
# layer, not one per row (each a launch-bound call on a GPU). Each query token reads its row's keys again, so longer
# rows (prefill chunks) keep one SDPA of their own. On a CPU without the kernel (bf16 caches, ROLLOUT_DECODE_KERNEL=0)
# a row keeps its own SDPA: there, splitting it lost at 1-4 verify rows a step (the shared-prefix merge it brings)
# and gained at 16-64 (benchmarks/results/gpu.md, "The first H200 run").
SDPA_QUERY_TOKENS = 9


def decode_query_tokens(device: torch.device, kernel: bool) -> int:
    """The most query tokens of a row that runs as decode rows, one per query token."""
    if kernel:
        return KERNEL_QUERY_TOKENS
    return 1 if device.type == "cpu" else SDPA_QUERY_TOKENS


@dataclass
class DecodeBucket:
    """Decode rows start:end (of the step's decode order) run as one SDPA over a [n, max_len] key grid."""

    start: int
    end: int
    pages: torch.Tensor  # [n * max_len / page] cache pages of the grid (padding repeats a row's last page)
    max_len: int  # keys per row read: whole pages
    mask: torch.Tensor | None  # [n, 1, 1, max_len] additive (0 / -inf); None when every row has max_len keys


@dataclass
class SharedPrefixes:
    """Groups of decode rows whose first keys are the very same cache rows (forked samples of one prompt, prefix-cache
    hits): each group's shared keys are read and attended once for all its rows, every group in one SDPA over a
    [groups, max_len] key grid, then merged with each row's own keys by log-sum-exp.

    Queries sit in a [groups, group_size] slot grid (a smaller group repeats one of its rows in its spare slots, whose
    outputs are dropped)."""

    pages: torch.Tensor  # [G * max_len / page] cache pages (padding repeats a group's last shared page)
    max_len: int
    mask: torch.Tensor | None  # [G, 1, 1, max_len] additive (0 / -inf); None when every group has max_len keys
    num_groups: int
    group_size: int
    slots: torch.Tensor | None  # [G * group_size] decode row of each query slot; None: slot i is row i
    row_slot: torch.Tensor | None  # [R] slot of each decode row, G * group_size for a row in no group; None: identity


@dataclass
class KernelRows:
    """Every decode row of a step as the paged decode kernel reads them (rollout/engine/kernels/decode_kernel.py), in step
    order: no buckets, no shared prefixes, the keys read where they lie."""

    table: torch.Tensor  # int64 [R, most pages] each row's pages in order (a shorter row repeats its last page)
    lens: torch.Tensor  # int64 [R] keys per row
    positions: torch.Tensor  # int64 [R] the rows' query tokens in the step


@dataclass
class Decode:
    """Every decode row (one query token) of a step: for the paged decode kernel (`kernel`), or ordered so that
    each bucket is a contiguous range."""

    query_index: torch.Tensor | None  # [R] positions of the rows' query tokens; None: the first R tokens, in order
    buckets: list[DecodeBucket] = field(default_factory=list)
    prefix: SharedPrefixes | None = None
    kernel: KernelRows | None = None

    @property
    def num_rows(self) -> int:
        return self.kernel.lens.numel() if self.kernel is not None else self.buckets[-1].end


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
    write_index: torch.Tensor | None = None  # block-table steps: the cache row of each row's new key and value


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
    table = kwargs.get("block_table")
    if table is not None:  # a decode-only step described by block tables (upstream's decode fast path)
        return _plan_block_table(table[allocator.index], live, starts_q, [lk for _, lk in lengths], allocator)
    if read_index.numel() == 0:
        # no cache reads: the keys are the step's own tokens, laid out like the queries; every row is a fresh prefill
        return Plan(prefill=[PrefillRow(sq, sq + lq, None, None) for sq, (lq, _) in zip(starts_q, lengths)])
    device = read_index.device
    plan = Plan()
    # rows of a few query tokens (speculative verify rows, short prefill chunks) go to the kernel or the buckets as
    # one decode row per query token, each over the keys up to its own position (bottom-right causal)
    kernel = decode_kernel.usable(device, allocator.cache_dtype, allocator.tokens_per_page)
    most = decode_query_tokens(device, kernel)
    decode_rows = [i for i, (lq, _) in enumerate(lengths) if lq <= most]
    if decode_rows:
        rows = [(starts_q[i] + j, starts_k[i], lengths[i][1] - lengths[i][0] + 1 + j)
                for i in decode_rows for j in range(lengths[i][0])]  # (query position, first key, keys)
        key_lens = [keys for _, _, keys in rows]
        pages = _row_pages([first for _, first, _ in rows], key_lens, read_index, allocator.tokens_per_page)
        plan.decode = _plan_decode(pages, key_lens, [position for position, _, _ in rows], allocator, kernel)
    for i, (lq, lk) in enumerate(lengths):
        if lq > most:
            mask = None if lq == lk else bottom_right_causal(lq, lk, device)
            plan.prefill.append(PrefillRow(starts_q[i], starts_q[i] + lq, read_index[starts_k[i]: starts_k[i] + lk],
                                           mask))
    return plan


def _plan_block_table(table: torch.Tensor, live: list[int], starts_q: list[int], key_lens: list[int],
                      allocator) -> Plan:
    """Every row decodes one token. `table` [sequences, width] holds each row's pages in order (upstream fills it: -1
    past a row's last page), indices of the pages of a layer's cache view as `_row_pages` gives them; the step's new
    key and value of a row go to its position key_len - 1."""
    device = table.device
    page = allocator.tokens_per_page
    cols = _page_columns(key_lens, page, device)
    pages = table[torch.tensor(live, device=device), : cols.shape[1]].long().gather(1, cols)  # [R, most pages]
    last = torch.tensor(key_lens, device=device) - 1
    write = pages.gather(1, (last // page)[:, None]).squeeze(1) * page + last % page
    kernel = decode_kernel.usable(device, allocator.cache_dtype, page)
    return Plan(decode=_plan_decode(pages, key_lens, starts_q, allocator, kernel), write_index=write)


def _plan_decode(pages: torch.Tensor, key_lens: list[int], starts_q: list[int], allocator, kernel: bool) -> Decode:
    """Decode rows (one query token each) whose keys are in `pages` ([R, most pages], a shorter row repeating its
    last page): all of them for the paged decode kernel if `kernel` (it runs: fp32 on CPU); else shared prefixes
    first (CPU only: merging needs the log-sum-exp that the CPU flash kernel returns), then buckets over each row's own
    keys, sorted by their number. Keys are read by whole pages."""
    device = pages.device
    page = allocator.tokens_per_page
    if kernel:
        return Decode(query_index=None, kernel=KernelRows(pages.long().contiguous(), torch.tensor(key_lens),
                                                          torch.tensor(starts_q)))
    num_rows = len(key_lens)
    shared = [0] * num_rows  # pages of a row read through its group's shared prefix
    groups = _shared_groups(pages, key_lens, page) if device.type == "cpu" and num_rows > 1 else []
    for members, common in groups:
        for r in members:
            shared[r] = common
    own = [key_lens[r] - shared[r] * page for r in range(num_rows)]  # own keys, from a page boundary
    order = sorted(range(num_rows), key=lambda r: own[r])
    query_pos = [starts_q[r] for r in order]
    plan = Decode(query_index=None if query_pos == list(range(len(order))) else torch.tensor(query_pos, device=device))
    bytes_per_page = 2 * page * allocator.num_key_value_heads * allocator.head_dim * allocator.cache_dtype.itemsize
    padded = {r: -(-own[r] // page) * page for r in order}  # what a row reads: its own keys to the end of a page
    start = 0
    for bucket in _buckets(order, padded, bytes_per_page // page):
        n, num_pages = len(bucket), padded[bucket[-1]] // page
        index = torch.tensor(bucket, device=device)
        first = torch.tensor([shared[r] for r in bucket], device=device)
        count = torch.tensor([padded[r] // page for r in bucket], device=device)
        # padding pages repeat the row's last page (finite data), masked out with the rest of that page
        cols = first[:, None] + torch.minimum(torch.arange(num_pages, device=device)[None, :], count[:, None] - 1)
        plan.buckets.append(DecodeBucket(start, start + n, pages[index[:, None], cols].flatten(), num_pages * page,
                                         _padding_mask(torch.tensor([own[r] for r in bucket], device=device),
                                                       num_pages * page, allocator.cache_dtype)))
        start += n
    if groups:
        plan.prefix = _plan_prefixes(groups, order, pages, page, allocator.cache_dtype)
    return plan


def _row_pages(starts_k: list[int], key_lens: list[int], read_index: torch.Tensor, page: int) -> torch.Tensor:
    """[R, most pages] the pages holding each row's keys, in order (a shorter row repeats its last page). A page is
    `page` consecutive rows of a layer's cache view starting at a multiple of `page` (upstream's paged layout,
    tests/test_upstream_contract.py), so a row's j-th page is the one holding its key j * page."""
    device = read_index.device
    j = _page_columns(key_lens, page, device)
    physical = read_index[torch.tensor(starts_k, device=device)[:, None] + j * page]
    if bool((physical % page).any()):
        raise RuntimeError("rollout_paged: a cache page does not start at a multiple of the page size; the paged "
                           "cache layout of this transformers version is not the one rollout_paged reads")
    return physical // page


def _page_columns(key_lens: list[int], page: int, device) -> torch.Tensor:
    """[R, most pages] for each row, the index of its page holding keys j * page ... (j + 1) * page - 1, a shorter
    row repeating its last page."""
    count = torch.tensor([-(-n // page) for n in key_lens], device=device)
    return torch.minimum(torch.arange(int(count.max()), device=device)[None, :], count[:, None] - 1)


def _shared_groups(pages: torch.Tensor, key_lens: list[int], page: int) -> list[tuple[list[int], int]]:
    """Rows whose first pages are the very same pages (forked samples, prefix-cache hits), with the number of pages
    they share; only groups where the reads saved pay for one more SDPA call."""
    by_first: dict[int, list[int]] = {}
    for r, f in enumerate(pages[:, 0].tolist()):
        by_first.setdefault(f, []).append(r)
    groups = []
    for members in by_first.values():
        span = (min(key_lens[r] for r in members) - 1) // page  # every row keeps its newest key's page
        if len(members) < 2 or span * page * (len(members) - 1) < CALL_TOKENS:
            continue
        seg = pages[members, :span]  # [n, span]
        common = int((seg == seg[0]).all(0).int().cumprod(0).sum())
        if common and common * page * (len(members) - 1) >= CALL_TOKENS:  # the reads saved pay for one more call
            groups.append((members, common))
    return groups


def _plan_prefixes(groups: list[tuple[list[int], int]], order: list[int], pages: torch.Tensor, page: int,
                   dtype: torch.dtype) -> SharedPrefixes:
    """Lay the shared-prefix groups out as one SDPA: page grid [G, most pages], query slots [G, group_size], groups in
    decode order, so that lock-step samples (contiguous groups of equal size) need no reordering at all."""
    device = pages.device
    position = {r: k for k, r in enumerate(order)}
    groups = sorted((sorted(position[r] for r in members), members[0], common) for members, common in groups)
    size, most = max(len(slots) for slots, _, _ in groups), max(common for _, _, common in groups)
    slots, grid, row_slot = [], [], [size * len(groups)] * len(order)
    for members, first, common in groups:
        for row in members:
            row_slot[row] = len(slots)
            slots.append(row)
        slots += [members[0]] * (size - len(members))  # spare slots: any row of the group, outputs dropped
        grid.append(pages[first, torch.clamp(torch.arange(most, device=device), max=common - 1)])
    mask = _padding_mask(torch.tensor([common * page for _, _, common in groups], device=device), most * page, dtype)
    identity = list(range(len(order)))
    exact = len(slots) == len(order)  # every row in a group, no spare slot: the slot grid is the decode order
    return SharedPrefixes(pages=torch.stack(grid).flatten(), max_len=most * page, mask=mask, num_groups=len(groups),
                          group_size=size, slots=None if exact and slots == identity else torch.tensor(slots, device=device),
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
