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

The per-step layout (`Plan`, plan.py) depends only on the step's sequence lengths and read indices, so it is built by
the first layer of a forward and reused by the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..kernels import decode_kernel
from ..upstream import ENGINE_THREAD, NAME, PagedAttentionCache, kv_views
from .plan import Decode, Plan, SharedPrefixes, bottom_right_causal, plan_for


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
    plan = plan_for(cache, allocator, kwargs)
    q = query[0].transpose(0, 1)  # token-major view [T, H, D]
    out = q.new_empty(q.shape[0], q.shape[1], value.shape[-1])  # [T, H, Dv]
    if plan.sliding_window is not None:  # the engine's own read (ring buffer), then one SDPA per row
        key, value = cache.update(key_states=key, value_states=value, layer_idx=layer, kwargs=kwargs)
        _sliding_rows(plan, q, key[0].transpose(0, 1), value[0].transpose(0, 1), out, scaling)
        return out.unsqueeze(0), None
    # write the step's new KV ([T, Hkv, D]); an empty read index makes the allocator skip its read-back
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)
    write = kwargs["write_index"][allocator.index] if plan.write_index is None else plan.write_index
    read = _Reader(cache, allocator, layer)
    if not decode_kernel.paged_write(k_new, v_new, read.keys, read.values, write):
        allocator.update(k_new, v_new, layer, write[:0], write)
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
    """All decode rows: one call of the paged decode kernel where it runs (decode_kernel.py); else one SDPA per bucket
    over the rows' own keys, query heads grouped onto their KV head ([n, Hkv, H / Hkv, D], no repeat_kv), then one
    SDPA of every shared prefix, merged in."""
    if plan.kernel is not None:
        rows = plan.kernel
        if not decode_kernel.paged_decode(q, read.keys, read.values, rows.table, rows.lens, rows.positions, out,
                                          read.page, scaling):
            raise RuntimeError(f"{NAME}: the paged decode kernel does not take this layer ({q.shape[1]} query heads, "
                               f"{read.num_kv_heads} KV heads, head dim {q.shape[2]}, page {read.page}). Fix: set "
                               "ROLLOUT_DECODE_KERNEL=0 (the workspace path) or attn_implementation='sdpa'.")
        return
    num_rows, num_heads, head_dim = plan.num_rows, q.shape[1], q.shape[2]
    num_kv_heads = read.num_kv_heads
    qd = q[:num_rows] if plan.query_index is None else q.index_select(0, plan.query_index)
    qd = qd.reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [R, Hkv, rep, D]
    od = qd.new_empty(qd.shape[:-1] + (out.shape[-1],))
    lse = qd.new_empty(qd.shape[:-1], dtype=torch.float32) if plan.prefix else None  # [R, Hkv, rep]
    for b in plan.buckets:
        k, v = read.pages(b.pages)  # [n * L, Hkv, D]
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
    k, v = read.pages(p.pages)  # [G * P, Hkv, D]
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
    """Reads cache rows (`__call__`, by token) or whole pages (`pages`) of one layer into a workspace kept on the cache
    and reused by every read of every layer and step (grown when a read needs more). Each read is consumed by its SDPA
    before the next one, so one buffer for keys and one for values suffice. Fresh tensors per read cost more than the
    copy itself on CPU: buffers of a few MiB come from mmap and are returned at free, so every read page-faulted its
    output in again. A page (page_size consecutive rows) is one copy instead of page_size: 1.5-1.7x faster reads."""

    def __init__(self, cache: PagedAttentionCache, allocator, layer: int) -> None:
        self.keys, self.values = kv_views(allocator, layer)  # [cache rows, Hkv, D] views of the paged cache
        self.page = allocator.tokens_per_page
        self.num_kv_heads = allocator.num_key_value_heads
        spaces = cache.__dict__.setdefault("_rollout_workspace", {})
        self.space = spaces.setdefault(allocator.index, [self.keys.new_empty(0), self.values.new_empty(0)])

    def _workspace(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.space[0].shape[0] < rows:
            size = rows + rows // 4
            self.space[:] = [self.keys.new_empty((size,) + self.keys.shape[1:]),
                             self.values.new_empty((size,) + self.values.shape[1:])]
        return self.space[0][:rows], self.space[1][:rows]

    def __call__(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._workspace(index.numel())
        return (torch.index_select(self.keys, 0, index, out=k), torch.index_select(self.values, 0, index, out=v))

    def pages(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of these pages, in order: [pages * page_size, Hkv, D]."""
        k, v = self._workspace(pages.numel() * self.page)
        shape = (-1, self.page) + self.keys.shape[1:]
        torch.index_select(self.keys.view(shape), 0, pages, out=k.view(shape))
        torch.index_select(self.values.view(shape), 0, pages, out=v.view(shape))
        return k, v


def _attention_with_lse(q, k, v, mask, scaling):
    """SDPA that also returns the log-sum-exp of each query's scores (the CPU flash kernel computes it anyway)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                          scale=scaling)
    return out, lse.float()


def _sliding_rows(plan: Plan, q, k, v, out, scaling) -> None:
    """Sliding-window layers: the engine's read-back keys of each row are its last (window - 1) cached tokens then
    its new ones; one SDPA per row with a bottom-right window mask."""
    gqa = q.shape[1] != k.shape[1]
    for q0, q1, k0, k1 in plan.rows:
        mask = bottom_right_causal(q1 - q0, k1 - k0, q.device, plan.sliding_window)
        orow = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1).unsqueeze(0),
                                              k[k0:k1].transpose(0, 1).unsqueeze(0),
                                              v[k0:k1].transpose(0, 1).unsqueeze(0),
                                              attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[q0:q1] = orow[0].transpose(0, 1)


def engine_mask(*args, **kwargs):
    """The mask interface entry of `rollout_paged`: sdpa's mask for a plain forward; nothing on the engine's loop
    thread, where the packed positions would otherwise make the model build a [tokens, tokens] mask every forward
    that paged attention never reads."""
    if ENGINE_THREAD.active:
        return None
    return sdpa_mask(*args, **kwargs)
