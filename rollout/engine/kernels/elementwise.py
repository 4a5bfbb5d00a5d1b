"""Fused RMSNorm and rotary embedding for the engine's fp32 forward, bit for bit what torch's eager ops compute.

In eager mode transformers' `LlamaRMSNorm` is seven tensor ops (pow, sum, div, add, rsqrt, two products) and
`apply_rotary_pos_emb` ten (four products, two negations, two cats, two sums), each a pass over memory with its own
dispatch: at 128 rows of the 25M model ~25-40 us a norm and ~65-100 us a rotary, against 12-16 and 19-22 us fused
(benchmarks/cpu_kernels/bench_kernels.py), 13 norms and 6 rotaries a forward. elementwise.c does each in one call with the same
roundings in the same order, including the order torch's CPU kernel sums a row (8-lane vectors and a cascade of
accumulators), so the results are the same bits: nothing downstream, the exactness tests included, can tell the two
paths apart.

The engine has the forward of each RMSNorm class of the model whose code is exactly Llama's (Qwen2, Qwen3, Mistral
and others copy it), and the `apply_rotary_pos_emb` of each modeling module whose code is exactly Llama's, call these
kernels (`upstream.install_fused(model, FLAG, rms_norm, rotary)`: the one room for process-wide patches). The patched
functions take the fused path only inside `Fused()` on the engine thread (the thread-local `FLAG`, as oneDNN's
linears have), for fp32 CPU tensors without autograd, and never while torch.compile traces; everywhere else
(the trainer's forward of the same shared model, other threads, other dtypes) they call the original. A model whose
norm or rotary code differs from Llama's by a character keeps its own.

Where the kernel cannot be built (no compiler; `ROLLOUT_ELEMENTWISE=0`), or where the first call's self-check finds
one bit different from torch on rows of several widths (a CPU or torch build that sums a row in another order),
`load()` is None and the engine keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings

import torch
from transformers.models.llama import modeling_llama

from . import native, openmp

FLAGS = ("-ffp-contract=off",)  # torch rounds a product before it is added: no fused multiply-adds
MAX_WIDTH = 32768  # torch sums one row of at least its grain size (32768) in two passes across threads: not followed
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
FLAG = threading.local()  # `on` while the engine thread's forward runs inside `Fused()`


class Fused:
    """The engine thread's forward takes the fused path inside this context (elementwise.py)."""

    def __enter__(self) -> "Fused":
        FLAG.on = True
        return self

    def __exit__(self, *exc) -> None:
        FLAG.on = False


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The built kernels, checked against torch on this machine, or None (then torch's ops run)."""
    lib = native.load("elementwise", FLAGS)
    if lib is None:
        return None
    lib.rms_norm.argtypes = [_PTR, _I64, _PTR, ctypes.c_float, _PTR, _I64, _I64, _I64, _I64]
    lib.rms_norm.restype = None
    lib.rotary.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64]
    lib.rotary.restype = None
    openmp.hand_over(lib)  # rows split over the engine thread's OpenMP team (elementwise.c)
    differs = _self_check(lib)
    if differs:
        warnings.warn(f"rollout: the fused RMSNorm / rotary kernels differ from torch's ops on this machine "
                      f"({differs}); the engine keeps torch's ops (correct, slower).", RuntimeWarning, stacklevel=2)
        return None
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib: ctypes.CDLL | None = None
             ) -> torch.Tensor | None:
    """LlamaRMSNorm's forward (weight * (x * rsqrt(mean(x^2) + eps))) of a contiguous fp32 CPU tensor, or None where
    the kernel does not take it."""
    lib = lib or load()
    n = x.shape[-1] if x.dim() else 0
    if lib is None or not 0 < n < MAX_WIDTH or x.dtype != torch.float32 or weight.dtype != torch.float32 or \
            x.device.type != "cpu" or weight.device.type != "cpu" or weight.shape != (n,) or \
            not (x.is_contiguous() and weight.is_contiguous()) or _tracked(x, weight):
        return None
    out = torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), n, weight.data_ptr(), eps, out.data_ptr(), n, x.numel() // n, n, torch.get_num_threads())
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lib: ctypes.CDLL | None = None
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """apply_rotary_pos_emb(q, k, cos, sin) for q [1, H, T, D], k [1, Hkv, T, D] (any strides, last dim contiguous)
    and cos / sin [1, T, D] (contiguous), all fp32 on CPU; None where the kernel does not take them."""
    lib = lib or load()
    if lib is None or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return None
    tokens, dim = cos.shape[1], cos.shape[2]
    if cos.shape[0] != 1 or q.shape[0] != 1 or k.shape[0] != 1 or q.shape[2:] != (tokens, dim) or \
            k.shape[2:] != (tokens, dim) or dim % 2 or \
            any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (q, k, cos, sin)) or \
            q.stride(-1) != 1 or k.stride(-1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()) or \
            _tracked(q, k, cos, sin):
        return None
    return _rotate(lib, q, cos, sin), _rotate(lib, k, cos, sin)


def _rotate(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)  # x's layout: the projection's [1, T, H, D] seen as [1, H, T, D]
    lib.rotary(x.data_ptr(), x.stride(2), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), out.stride(2),
               out.stride(1), x.shape[2], x.shape[1], x.shape[3], torch.get_num_threads())
    return out


def _tracked(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


_ORIGINAL_NORM = modeling_llama.LlamaRMSNorm.forward  # the references of the self-check, whatever is patched later
_ORIGINAL_ROTARY = modeling_llama.apply_rotary_pos_emb


# -------------------------------------------------------------------------------------------------- self-check
def _self_check(lib: ctypes.CDLL) -> str:
    """'' where the kernels give torch's bits on rows of several widths and counts; else what differed."""
    g = torch.Generator().manual_seed(0)
    norm = _ORIGINAL_NORM
    with torch.no_grad():
        widths = [(w, (1, 3, 130)) for w in (8, 17, 64, 100, 256, 512, 768, 1000, 2048, 4096, 5120)]
        widths += [(8192, (8,)), (30000, (2,))]  # fewer rows than width past torch's grain: still split by rows
        for width, rows_of_width in widths:
            for rows in rows_of_width:
                x = torch.randn(rows, width, generator=g) * (0.02 + width % 7)
                layer = modeling_llama.LlamaRMSNorm(width, eps=1e-6)
                layer.weight.normal_(1.0, 0.1, generator=g)
                if not torch.equal(rms_norm(x, layer.weight, layer.variance_epsilon, lib), norm(layer, x)):
                    return f"RMSNorm of {rows} x {width}"
        for heads, kv_heads, tokens, dim in ((4, 2, 1, 64), (8, 8, 37, 16), (3, 1, 300, 128)):
            q = torch.randn(1, tokens, heads, dim, generator=g).transpose(1, 2)
            k = torch.randn(1, tokens, kv_heads, dim, generator=g).transpose(1, 2)
            angles = torch.randn(1, tokens, dim, generator=g) * 10
            want = _ORIGINAL_ROTARY(q, k, angles.cos(), angles.sin())
            got = rotary(q, k, angles.cos(), angles.sin(), lib)
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                return f"rotary of {heads} heads x {tokens} tokens x {dim}"
    return ""
