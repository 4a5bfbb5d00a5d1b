"""oneDNN linears: the engine's fp32 `nn.Linear` forwards on oneDNN's matmul instead of the BLAS torch links (MKL).

PyTorch's CPU build computes an fp32 `nn.Linear` with MKL's sgemm. MKL picks its kernels by CPU vendor: on AMD cores
with AVX-512 it runs its AVX2 ones, at about half the machine's fp32 rate (measured on a 2-core EPYC: 190 GFLOP/s at
128 x 512 x 1536, where oneDNN's AVX-512 kernels reach 450; results/kernels.md, "oneDNN linears"). oneDNN (also in every
torch CPU build, `torch.ops.mkldnn`) picks kernels by instruction set. `OneDNNLinears` is a context entered on the
engine thread around its forward only (a thread-local flag read by the patched `nn.Linear.forward`), so the trainer's
forward of the same shared model keeps torch's own kernels. Linears called as `F.linear` outside an `nn.Linear` (some
MoE experts) keep torch's. It reads each weight packed once in oneDNN's layout, packed again whenever the weight may
have changed (see "Packed weights" below): in-place updates, LoRA merges and the fleet's broadcasts are seen at the
next step, as with torch's own linear.

The product is the same fp32 product summed in another order: measured against a float64 product, oneDNN's error is
~2x MKL's (~2e-6 against ~1e-6 on unit-scale inputs at K = 512-1536), far inside the logprob rule (1e-5 of the fp32
teacher-forced forward), but it is not the trainer's product bit for bit, so `choose` takes oneDNN only where MKL is
known to be slow (a rule, so a seeded row is the same in every process on the machine).
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass

import torch

from . import native


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# oneDNN builds (JIT-compiles) a kernel for every (rows, out, in) shape it is called with and keeps it in two caches of
# 1024 entries each (torch's ideep cache and oneDNN's primitive cache), ~0.55 MiB a kernel whatever the shape (measured
# with mallinfo). The engine's row count is its step's token count, which varies step to step (1 to max_batch_tokens),
# so unbucketed it would build a kernel per count seen: +380 MiB over 120 varied calls on the tiny model. Rows are
# therefore padded up to one of BUCKETS and run in CHUNK-row pieces above that: at most len(BUCKETS) kernels per
# linear shape. Above 8 rows the buckets are 4 to an octave, so padding adds under 25% rows, ~10% on average, and a
# linear's time is nearly linear in its rows from 16 up (oneDNN at 256 rows runs at its 2048-row rate per row).
CHUNK = 256


def bucket(rows: int) -> int:
    """The padded row count a linear of `rows` (1..CHUNK) runs at: 1, 2, 4, 8, then 4 steps an octave (10, 12, 14,
    16, 20, 24, ..., 224, 256)."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


BUCKETS = tuple(sorted({bucket(r) for r in range(1, CHUNK + 1)}))


def _bucketed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`_linear` of x's rows, in CHUNK-row pieces and a tail padded with zero rows to its bucket; a row's output
    depends on that row alone, so the padding is sliced off unread."""
    flat = x.reshape(-1, x.shape[-1])
    pieces = [_padded(flat[start:start + CHUNK], weight, bias) for start in range(0, flat.shape[0], CHUNK)]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out.view(*x.shape[:-1], weight.shape[0])


def _padded(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    count, size = rows.shape[0], bucket(rows.shape[0])
    if size == count:
        return _linear(rows, weight, bias)
    return _linear(torch.cat([rows, rows.new_zeros(size - count, rows.shape[1])]), weight, bias)[:count]


class OneDNNLinears:
    """Inside this context, this thread's `nn.Linear` forwards run on oneDNN for fp32 CPU tensors without autograd,
    reading the weights packed in `packs` (the engine's own); every other thread, and everything else, as usual.

    `nn.Linear.forward` is patched once, process-wide (`upstream.install_linear(FLAG, linear)`, which the engine calls
    when it chooses oneDNN), to look at a thread-local flag: a TorchFunctionMode would do the same for `F.linear`, but
    it is called for every torch op of the forward (views, products, norms), ~2 us of Python each: 7% of a 64-token
    forward of the 25M model (16.0 against 17.2 ms, measured). The patched forward costs the trainer's linears one flag
    read, and takes torch's own path while torch.compile traces."""

    def __init__(self, packs: "PackedWeights | None" = None) -> None:
        self.packs = PackedWeights() if packs is None else packs  # the engine's own; a set of its own otherwise

    def __enter__(self) -> "OneDNNLinears":
        FLAG.on, FLAG.packs = True, self.packs
        return self

    def __exit__(self, *exc) -> None:
        FLAG.on, FLAG.packs = False, None


FLAG = threading.local()  # `on` (and the engine's `packs`) while the engine thread's forward runs in OneDNNLinears


def linear(module: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor | None:
    """The patched `nn.Linear.forward`'s first try inside `OneDNNLinears`: oneDNN on the packed weight, or None for an
    input it does not take (torch's forward then runs)."""
    if not _eligible(input, module.weight, module.bias):
        return None
    return _bucketed_linear(input, FLAG.packs.packed(module.weight), module.bias)


# Packed weights. oneDNN reads a weight in its own blocked layout; handed the plain [out, in] tensor, it reorders it on
# every call. A copy packed once (torch.ops.mkldnn._reorder_linear_weight) saves that: 1.15x at 64 rows, 1.45x at 16 and
# 2x at 4 on the 25M model's shapes (benchmarks/cpu_kernels/bench_kernels.py; results/kernels.md), with the same bits as the live weight
# from 2 rows up. The copy costs the linear weights' memory once more. It is the weight's value when packed, so it is
# packed again when the weight may have changed: its version counter or storage moved (an in-place op, a `copy_`, a new
# tensor), or `weights_changed()` was called (the worker calls it on every refresh, update and adapter merge, which may
# write through `.data` or a fused optimizer that leaves the counter alone), or `check()` (the engine calls it as each
# call is accepted) found a sampled element that differs from the weight's. Each engine keeps its own packs: one
# worker's weight change repacks only what that worker packed.
PACK_ROWS = 64  # the row count oneDNN is told to pack for; measured alike at 16, 64 and 256 rows
PROBES = 64  # elements of each weight compared by check


@dataclass
class _Pack:
    weight: weakref.ref
    packed: torch.Tensor
    version: int
    address: int
    epoch: int
    probe: torch.Tensor  # PROBES elements of the weight, spread over it, as packed


class PackedWeights:
    """One engine's weights packed for oneDNN (each dropped with its weight)."""

    def __init__(self) -> None:
        self._packs: dict[int, _Pack] = {}  # id(weight) -> its packed copy
        self._epoch = 0

    def __len__(self) -> int:
        return len(self._packs)

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        """weight packed for oneDNN, as it is now (packed again where it may have changed)."""
        entry = self._packs.get(id(weight))
        if entry is not None and entry.weight() is weight and entry.epoch == self._epoch and \
                entry.version == weight._version and entry.address == weight.data_ptr():
            return entry.packed
        with torch.no_grad():
            entry = _Pack(weakref.ref(weight, functools.partial(_dropped, weakref.ref(self), id(weight))),
                          torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS), weight._version,
                          weight.data_ptr(), self._epoch, _probe(weight))
        self._packs[id(weight)] = entry
        return entry.packed

    def weights_changed(self) -> None:
        """Every packed weight is packed again at its next use."""
        self._epoch += 1

    def check(self) -> bool:
        """Whether every packed weight still holds its weight's sampled elements; if not, all are packed again at their
        next use. ~0.1 ms for the 25M model: it catches weights changed without a refresh (a contract the README
        states)."""
        for entry in list(self._packs.values()):
            weight = entry.weight()
            if weight is not None and entry.epoch == self._epoch and \
                    not torch.equal(_probe(weight).view(torch.int32), entry.probe.view(torch.int32)):  # NaN bits too
                self.weights_changed()
                return False
        return True

    def forget(self, weights) -> None:
        """Drops the packed copies of these weights (a worker sleeping or closing): their memory goes back."""
        for weight in weights:
            entry = self._packs.get(id(weight))
            if entry is not None and entry.weight() is weight:
                del self._packs[id(weight)]

    def holds(self, weight: torch.Tensor) -> bool:
        entry = self._packs.get(id(weight))
        return entry is not None and entry.weight() is weight

    def dead(self) -> int:
        """Entries whose weight is gone (0: a weight's copy dies with it)."""
        return sum(entry.weight() is None for entry in self._packs.values())



def _dropped(packs_ref: weakref.ref, key: int, ref: weakref.ref) -> None:
    """A packed weight's weight died: its copy goes too (the packs are reached weakly, so no cycle keeps the copies of
    a dropped engine alive)."""
    packs = packs_ref()
    entry = None if packs is None else packs._packs.get(key)
    if entry is not None and entry.weight is ref:
        del packs._packs[key]


def _probe(weight: torch.Tensor) -> torch.Tensor:
    flat = weight.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // PROBES)][:PROBES].clone()


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return False
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return bias is None or (bias.dtype == torch.float32 and bias.dim() == 1)


def choose(choice: str, model: torch.nn.Module) -> bool:
    """Whether the engine's forward runs its fp32 linears on oneDNN: "onednn" yes, "blas" no, "auto" where MKL is
    known to run its slow kernels: an x86 core with AVX-512 that is not Intel's (MKL dispatches its AVX-512 kernels on
    Intel CPUs only). A rule, not a timing at start, so the same machine always takes the same kernels and a seeded
    row is the same in every process."""
    if choice == "blas" or not available() or not _has_fp32_linear(model):
        return False
    return choice == "onednn" or slow_blas()


def slow_blas() -> bool:
    """An x86 CPU with AVX-512 whose vendor is not Intel, where torch's BLAS is MKL."""
    return torch.backends.mkl.is_available() and torch.backends.cpu.get_cpu_capability() == "AVX512" \
        and cpu_vendor() not in ("GenuineIntel", "")


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("" where there is none)."""
    return native.cpuinfo("vendor_id")


def _has_fp32_linear(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
               for m in model.modules())
