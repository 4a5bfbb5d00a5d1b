"""The paged decode kernel (rollout/engine/kernels/decode_kernel.py): every decode row's attention read straight from the
cache pages, against an fp64 SDPA over the same keys gathered; built once per machine, and absent (never wrong) where
it cannot be built. The engine's rows through it are checked against a teacher-forced forward in test_attention.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rollout.engine.kernels import decode_kernel, native

needs_kernel = pytest.mark.skipif(decode_kernel.load() is None, reason="no C compiler: the kernel cannot be built")


def _case(rows: int, heads: int, kv_heads: int, dim: int, page: int, lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page) for n in lens) + 3
    keys = torch.randn(num_pages * page, kv_heads, dim, generator=g)
    values = torch.randn(num_pages * page, kv_heads, dim, generator=g)
    order = torch.randperm(num_pages, generator=g)  # a row's pages anywhere in the cache, in any order
    most = max(-(-n // page) for n in lens)
    table, used = torch.empty(rows, most, dtype=torch.int64), 0
    for r, n in enumerate(lens):
        count = -(-n // page)
        table[r, :count] = order[used: used + count]
        table[r, count:] = table[r, count - 1]  # a shorter row repeats its last page, as the engine's table does
        used += count
    steps = rows + 2  # the step has other tokens too: the decode rows' queries sit at scattered positions
    query = torch.randn(1, heads, steps, dim, generator=g)  # the model's [1, H, T, D], read as a [T, H, D] view
    positions = torch.randperm(steps, generator=g)[:rows].contiguous()
    return keys, values, table, torch.tensor(lens), positions, query[0].transpose(0, 1)


def _reference(keys, values, table, lens, positions, q, page, scale):
    out = []
    for r, n in enumerate(lens.tolist()):
        index = (table[r, :, None] * page + torch.arange(page)).flatten()[:n]
        k, v = keys[index].double().transpose(0, 1), values[index].double().transpose(0, 1)
        query = q[positions[r]].double()[:, None]  # [H, 1, D]
        out.append(F.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(out)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 4, 64), (8, 2, 40), (4, 1, 16)],
                         ids=["mha", "gqa-2", "gqa-4-dim-40", "mqa-dim-16"])
@pytest.mark.parametrize("lens", [[1], [15, 16, 17], [1, 2, 31, 32, 33, 100, 64, 7]], ids=["one-key", "page-edges",
                                                                                        "ragged"])
def test_each_row_is_the_fp64_attention_over_its_own_pages(heads, kv_heads, dim, lens):
    page = 16
    keys, values, table, lens_t, positions, q = _case(len(lens), heads, kv_heads, dim, page, lens)
    out = torch.full((q.shape[0], heads, dim), float("nan"))
    scale = 1 / math.sqrt(dim)
    assert decode_kernel.paged_decode(q, keys, values, table, lens_t, positions, out, page, None)
    expected = _reference(keys, values, table, lens_t, positions, q, page, scale)
    assert (out[positions].double() - expected).abs().max().item() < 2e-6
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[positions] = False
    assert torch.isnan(out[others]).all()  # the step's other tokens are not the kernel's to write


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim,page", [(12, 4, 64, 16), (10, 2, 128, 24), (8, 1, 32, 40), (20, 4, 64, 4)],
                         ids=["group-3", "group-5-dim-128-page-24", "group-8-page-40", "group-5-page-4"])
def test_query_groups_and_pages_past_one_register_block_are_exact(heads, kv_heads, dim, page):
    # groups of 3 and 5 query heads split into register blocks of at most 4; pages of 24 and 40 tokens end inside a
    # 16-token score block; a page of 4 is shorter than one
    lens = [1, page - 1, page, page + 1, 3 * page + 5, 97]
    keys, values, table, lens_t, positions, q = _case(len(lens), heads, kv_heads, dim, page, lens, seed=heads)
    out = torch.empty(q.shape[0], heads, dim)
    assert decode_kernel.paged_decode(q, keys, values, table, lens_t, positions, out, page, None)
    expected = _reference(keys, values, table, lens_t, positions, q, page, 1 / math.sqrt(dim))
    assert (out[positions].double() - expected).abs().max().item() < 2e-6


@pytest.mark.skipif("avx512f" not in native.cpuinfo("flags").split(), reason="the AVX-512 path is the only one here")
@pytest.mark.parametrize("heads,kv_heads,dim,page,peak", [(12, 4, 64, 16, 1), (10, 2, 128, 24, 1), (8, 1, 32, 40, 1),
                                                          (20, 4, 64, 4, 1), (8, 4, 64, 16, 40)],
                         ids=["group-3", "group-5-dim-128-page-24", "group-8-dim-32-page-40", "group-5-page-4",
                              "peaked"])
def test_the_avx512_path_gives_the_portable_loops_bits(monkeypatch, heads, kv_heads, dim, page, peak):
    # the same products, sums and exp in the same order: the AVX-512 path changes the speed, never a bit
    portable = decode_kernel.load(("-mno-avx512f",))
    if portable is None or decode_kernel.load() is None:
        pytest.skip("no C compiler: the kernel cannot be built")
    lens = [1, page - 1, page, page + 1, 3 * page + 5, 100]
    keys, values, table, lens_t, positions, q = _case(len(lens), heads, kv_heads, dim, page, lens, seed=dim)
    q = q * peak
    outs = []
    for lib in (decode_kernel.load(), portable):
        monkeypatch.setattr(decode_kernel, "load", lambda flags=(), lib=lib: lib)
        outs.append(torch.empty(q.shape[0], heads, dim))
        assert decode_kernel.paged_decode(q, keys, values, table, lens_t, positions, outs[-1], page, None)
    assert torch.equal(outs[0][positions], outs[1][positions])
    expected = _reference(keys, values, table, lens_t, positions, q, page, 1 / math.sqrt(dim))
    assert (outs[0][positions].double() - expected).abs().max().item() < 2e-6 * peak


@needs_kernel
def test_scores_far_apart_and_a_given_scale_stay_exact():
    page, lens = 4, [9, 30]
    keys, values, table, lens_t, positions, q = _case(2, 4, 2, 32, page, lens, seed=3)
    q = q * 40  # peaked softmax: the online max must rescale earlier pages exactly
    out = torch.empty(q.shape[0], 4, 32)
    assert decode_kernel.paged_decode(q, keys, values, table, lens_t, positions, out, page, 0.3)
    expected = _reference(keys, values, table, lens_t, positions, q, page, 0.3)
    assert (out[positions].double() - expected).abs().max().item() < 1e-5


@needs_kernel
def test_a_layout_past_the_kernels_limits_is_refused_not_computed():
    keys, values, table, lens, positions, q = _case(1, 4, 4, 16, 16, [5])
    out = torch.zeros(q.shape[0], 4, 16)
    assert not decode_kernel.paged_decode(q, keys, values, table.int(), lens, positions, out, 16, None)  # int32 table
    assert not decode_kernel.paged_decode(q.double(), keys, values, table, lens, positions, out, 16, None)
    assert not decode_kernel.usable(torch.device("cpu"), torch.float32, decode_kernel.MAX_PAGE + 1)
    assert not decode_kernel.usable(torch.device("cpu"), torch.bfloat16, 16)
    assert out.abs().sum() == 0


def test_without_a_compiler_there_is_no_kernel_and_a_warning_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ROLLOUT_KERNEL_CACHE", str(tmp_path / "cache"))
    decode_kernel.load.cache_clear()
    native.load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built"):
            assert decode_kernel.load() is None
        assert not decode_kernel.usable(torch.device("cpu"), torch.float32, 16)
    finally:
        decode_kernel.load.cache_clear()
        native.load.cache_clear()


@needs_kernel
def test_the_kernel_is_built_once_per_machine_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLOUT_KERNEL_CACHE", str(tmp_path))
    first = native.build("decode_kernel")
    stamp = first.stat().st_mtime_ns
    assert native.build("decode_kernel") == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no build leftovers


@needs_kernel
@pytest.mark.parametrize("kv_heads,dim,dv", [(4, 64, 64), (1, 16, 16), (2, 40, 24)], ids=["mha", "mqa", "dv-apart"])
def test_the_kv_write_is_the_allocators_index_copy_bit_for_bit(kv_heads, dim, dv):
    g = torch.Generator().manual_seed(kv_heads)
    # a layer's key view of the cache runs one page past its value view (full_attention.py's shifted views)
    keys, values = torch.randn(66, kv_heads, dim, generator=g), torch.randn(50, kv_heads, dv, generator=g)
    k = torch.randn(1, kv_heads, 7, dim, generator=g)[0].transpose(0, 1)  # the model's [1, Hkv, T, D] as [T, Hkv, D]
    v = torch.randn(1, kv_heads, 7, dv, generator=g)[0].transpose(0, 1)
    index = torch.tensor([49, 0, 3, 17, 18, 31, 32])  # both ends of the cache, and page edges of 16
    want_k, want_v = keys.clone().index_copy_(0, index, k), values.clone().index_copy_(0, index, v)
    assert decode_kernel.paged_write(k, v, keys, values, index)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    assert decode_kernel.paged_write(k[:0], v[:0], keys, values, index[:0])  # a step with no tokens of this layer


@needs_kernel
def test_a_kv_write_outside_the_cache_raises_and_writes_nothing():
    keys, values = torch.zeros(12, 2, 16), torch.zeros(8, 2, 16)
    k = v = torch.ones(2, 2, 16)
    with pytest.raises(IndexError, match="outside the cache's 8 rows"):
        decode_kernel.paged_write(k, v, keys, values, torch.tensor([3, 8]))
    assert not keys.any() and not values.any()
    assert not decode_kernel.paged_write(k.double(), v.double(), keys.double(), values.double(), torch.tensor([0, 1]))
