"""The paged decode kernel: fp32 decode attention read straight from the paged KV cache (decode_kernel.c).

Without it, `rollout_paged` reads each decode bucket's keys and values out of the cache pages into a workspace, then
runs one SDPA per bucket and one over the shared prefixes, merged by log-sum-exp: at 64 rows of the 25M model that is
1.4 ms a layer, 30% of a GRPO step, almost all of it copies and per-call overhead (the arithmetic is ~25 MFLOP). The
kernel reads every row's keys where they lie, page by page, with an online softmax in fp32 (each page's scores, their
max, then exp and the value sum): no copy, no padding, no merge, one call per layer for every decode row of the step.
Work is split over rows (and a row's KV heads when rows are few) on `torch.get_num_threads()` threads: the engine
thread's own OpenMP team where torch runs on libgomp (openmp.py), whose workers spin between the forward's parallel
ops, else POSIX threads of its own.

It is C, compiled once per machine on first use (native.py); where it cannot be built, or with
`ROLLOUT_DECODE_KERNEL=0`, `load()` is None and the engine keeps its workspace path, same results to fp32 rounding.
Where the compiler targets AVX-512 and head sizes are multiples of 16, each page runs in AVX-512 registers: a head's
scores 16 tokens at a time (a transpose-and-add network in place of one reduction per score), the softmax on 16 lanes,
and 1-4 query heads of a KV head accumulate their outputs in registers over a page, loading each value row once; the
next page is prefetched while one is computed (a page spans several 4 KiB memory pages, where hardware prefetchers
stop). The portable loop, which compilers vectorise at the width their tuning prefers (128 bits for gcc 12's guess at
this project's AMD cores), serves every other case. Both paths round the same products, sums and exp in the same
order, so the AVX-512 path gives the portable loop's bits (tested); per layer of a 12-layer cache it is 1.3-1.9x
faster at ~160 keys a row and 1.13-1.19x at ~500, where memory bounds both (bench_kernels.py).
Exactness: the same fp32 products, summed in another order; exp is Cephes' polynomial (within 2 ulp of expf).
tests/test_decode_kernel.py checks it against an fp64 SDPA over the gathered keys, and test_attention.py the engine's
rows against a teacher-forced forward.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from . import native, openmp

MAX_PAGE = 256  # decode_kernel.c's limits; past them the engine keeps its workspace path
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.lru_cache(maxsize=None)
def load(flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be had here (then the engine keeps its workspace path). `flags` are
    extra compiler flags (tests build the portable loop alone with `("-mno-avx512f",)`)."""
    lib = native.load("decode_kernel", flags)
    if lib is not None:
        lib.paged_decode.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                     _I64, _I64, ctypes.c_float, _PTR, _I64, _I64, _I64]
        lib.paged_decode.restype = ctypes.c_int
        lib.paged_write.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64]
        lib.paged_write.restype = ctypes.c_int
        openmp.hand_over(lib)  # the kernel's threads are the engine thread's OpenMP team (decode_kernel.c)
    return lib


def usable(device: torch.device, dtype: torch.dtype, page: int) -> bool:
    """Whether a paged cache of this device, dtype and page size is read by the kernel."""
    return device.type == "cpu" and dtype == torch.float32 and page <= MAX_PAGE and load() is not None


def paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                 positions: torch.Tensor, out: torch.Tensor, page: int, scaling: float | None) -> bool:
    """out[positions[r]] = attention of q[positions[r]] ([T, H, D], any strides of the last dim 1) over the first
    lens[r] keys of pages table[r] (int64 [R, most pages]) of keys / values ([cache rows, Hkv, D], contiguous). out is
    [T, H, Dv] with its last dim contiguous. False where the shapes are past the kernel's limits (nothing written)."""
    lib = load()
    num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
    if lib is None or q.stride(-1) != 1 or out.stride(-1) != 1 or q.shape[1] % num_kv_heads or \
            not (keys.is_contiguous() and values.is_contiguous()) or q.dtype != torch.float32 or \
            any(t.dtype != torch.int64 or not t.is_contiguous() for t in (table, lens, positions)):
        return False
    scale = 1.0 / math.sqrt(head_dim) if scaling is None else float(scaling)
    code = lib.paged_decode(q.data_ptr(), q.stride(0), q.stride(1), keys.data_ptr(), values.data_ptr(),
                            table.data_ptr(), table.shape[1], lens.data_ptr(), positions.data_ptr(), table.shape[0],
                            num_kv_heads, q.shape[1] // num_kv_heads, head_dim, values.shape[2], page, scale,
                            out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads())
    if code == -2:
        raise MemoryError("rollout: the paged decode kernel could not allocate its 128 KiB of scratch per thread")
    return code == 0


def paged_write(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                index: torch.Tensor) -> bool:
    """keys[index[t]] = k[t] and values[index[t]] = v[t]: the step's new KV ([T, Hkv, D], last dim contiguous) into the
    cache's token rows ([cache rows, Hkv, D], contiguous), the same copy as the allocator's index_copy_. False where the
    kernel does not take these tensors (nothing written); IndexError where an index is outside the cache."""
    lib = load()
    if lib is None or k.device.type != "cpu" or keys.device.type != "cpu" or \
            any(t.dtype != torch.float32 for t in (k, v, keys, values)) or k.stride(-1) != 1 or v.stride(-1) != 1 or \
            not (keys.is_contiguous() and values.is_contiguous()) or index.dtype != torch.int64 or \
            not index.is_contiguous() or k.shape[0] != index.numel() or v.shape[0] != index.numel() or \
            k.shape[1:] != keys.shape[1:] or v.shape[1:] != values.shape[1:]:
        return False
    rows = min(keys.shape[0], values.shape[0])  # a layer's key view runs one page past its value view
    code = lib.paged_write(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                           keys.data_ptr(), values.data_ptr(), index.data_ptr(), index.numel(), keys.shape[1],
                           keys.shape[2], values.shape[2], rows)
    if code == -1:
        raise IndexError(f"rollout: a KV write index is outside the cache's {rows} rows")
    return True
