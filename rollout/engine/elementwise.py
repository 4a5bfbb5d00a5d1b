"""Fused RMSNorm and rotary embedding for the engine's fp32 forward, bit for bit what torch's eager ops compute.

In eager mode transformers' `LlamaRMSNorm` is seven tensor ops (pow, sum, div, add, rsqrt, two products) and
`apply_rotary_pos_emb` ten (four products, two negations, two cats, two sums), each a pass over memory with its own
dispatch: at 128 rows of the 25M model ~25-40 us a norm and ~65-100 us a rotary, against 12-16 and 19-22 us fused
(benchmarks/cpu_kernels/bench_kernels.py), 13 norms and 6 rotaries a forward. elementwise.c does each in one call with the same
roundings in the same order, including the order torch's CPU kernel sums a row (8-lane vectors and a cascade of
accumulators), so the results are the same bits: nothing downstream, the exactness tests included, can tell the two
paths apart.

`install(model)` patches the forward of each RMSNorm class of the model whose code is exactly Llama's (Qwen2, Qwen3,
Mistral and others copy it), and the `apply_rotary_pos_emb` of each modeling module whose code is exactly Llama's. The
patched functions take the fused path only inside `Fused()` on the engine thread (a thread-local flag, as oneDNN's
linears are), for fp32 CPU tensors without autograd, and never while torch.compile traces; everywhere else
(the trainer's forward of the same shared model, other threads, other dtypes) they call the original. A model whose
norm or rotary code differs from Llama's by a character keeps its own.

Where the kernel cannot be built (no compiler; `ROLLOUT_ELEMENTWISE=0`), or where the first call's self-check finds
one bit different from torch on rows of several widths (a CPU or torch build that sums a row in another order),
`load()` is None and the engine keeps torch's ops.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import inspect
import sys
import textwrap
import threading
import warnings

import torch
from transformers.models.llama import modeling_llama

from . import native, openmp

FLAGS = ("-ffp-contract=off",)  # torch rounds a product before it is added: no fused multiply-adds
MAX_WIDTH = 32768  # torch sums one row of at least its grain size (32768) in two passes across threads: not followed
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_local = threading.local()


class Fused:
    """The engine thread's forward takes the fused path inside this context (elementwise.py)."""

    def __enter__(self) -> "Fused":
        _local.on = True
        return self

    def __exit__(self, *exc) -> None:
        _local.on = False


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


# ---------------------------------------------------------------------------------------------------- patching
def _code(fn) -> str:
    """fn's code without its name, decorators and docstring: equal for two functions that compute the same thing."""
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    node.name, node.decorator_list, node.returns = "_", [], None
    if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
        node.body = node.body[1:]
    for arg in node.args.args + node.args.kwonlyargs:
        arg.annotation = None
    return ast.dump(node)


_NORM = _code(modeling_llama.LlamaRMSNorm.forward)
_ROTARY = _code(modeling_llama.apply_rotary_pos_emb)
_ROTATE_HALF = _code(modeling_llama.rotate_half)
_ORIGINAL_ROTARY = modeling_llama.apply_rotary_pos_emb  # the reference of the self-check, whatever is patched later
_patched: set = set()  # classes and modeling modules patched
_rejected: set = set()  # and those whose code is not Llama's (looked at once)
_patch_lock = threading.Lock()


def install(model: torch.nn.Module) -> bool:
    """Patches the Llama-exact RMSNorm classes and rotary functions of model's modules (once each, process-wide);
    True where the model has any, so the engine's forward gains from `Fused()`."""
    if load() is None:
        return False
    found = False
    with _patch_lock:
        for cls in {type(module) for module in model.modules()}:  # each class and modeling module looked at once
            found = _patch_norm(cls) | _patch_rotary(sys.modules.get(cls.__module__)) | found
    return found


def _patch_norm(cls: type) -> bool:
    if cls in _patched:
        return True
    if cls in _rejected or not cls.__name__.endswith("RMSNorm") or not _same(cls.forward, _NORM):
        _rejected.add(cls)
        return False
    original = cls.forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if getattr(_local, "on", False) and not torch.compiler.is_compiling():
            out = rms_norm(hidden_states, self.weight, self.variance_epsilon)
            if out is not None:
                return out
        return original(self, hidden_states)

    forward.__wrapped__ = original
    cls.forward = forward
    _patched.add(cls)
    return True


def _patch_rotary(module) -> bool:
    if module is None:
        return False
    if module in _patched:
        return True
    original, rotate_half = getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None)
    if module in _rejected or original is None or rotate_half is None or not _same(original, _ROTARY) or \
            not _same(rotate_half, _ROTATE_HALF):
        _rejected.add(module)
        return False

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and getattr(_local, "on", False) and not torch.compiler.is_compiling():
            pair = rotary(q, k, cos, sin)
            if pair is not None:
                return pair
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = original
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    _patched.add(module)
    return True


def _same(fn, code: str) -> bool:
    try:
        return _code(fn) == code
    except (OSError, TypeError, SyntaxError, IndexError):  # no source (built-in, compiled, interactive)
        return False


# -------------------------------------------------------------------------------------------------- self-check
def _self_check(lib: ctypes.CDLL) -> str:
    """'' where the kernels give torch's bits on rows of several widths and counts; else what differed."""
    g = torch.Generator().manual_seed(0)
    norm = modeling_llama.LlamaRMSNorm.forward.__dict__.get("__wrapped__", modeling_llama.LlamaRMSNorm.forward)
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
