"""Weight updates that are atomic, and a fingerprint that proves what the rollout side holds.

`plan_update` validates every incoming tensor (known name, same shape, finite values; all names present when a
full update is asked) before anything is touched; `apply_update` then copies in place with `param.data.copy_`, so
tensor addresses (CUDA graphs, optimizer references, tied weights) stay valid. Names are those of
`model.state_dict()`; tied parameters appear under each of their names and are written once. A model carrying PEFT
adapters also takes its adapter's tensors under PEFT's own names (`get_peft_model_state_dict`, see
rollout.model.adapters), so an adapter-only update is just the adapter's state dict. `fingerprint` hashes every tensor where
it lives (a checksum per tensor on the device, sha256 over those on the host); a worker's `DigestCache` keeps the
per-tensor checksums between calls and recomputes only those of tensors written since.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..base.errors import check_int
from ..engine.sampling.streams import spread
from . import adapters


@dataclass(frozen=True)
class UpdatePlan:
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (destination in the model, validated source)


def check_version(version: int | None) -> None:
    """The version an update or refresh is tagged with: None (increment) or an int >= 0. Checked before anything
    changes (by the worker and, on the caller's side, the fleet), so a bad version leaves weights and version as they
    were."""
    if version is not None:
        check_int("version", version, 0, "pass e.g. the trainer's step number, or None to increment")


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict name of the model -> the live tensor it names (parameters and persistent buffers), plus
    non-persistent buffers (e.g. rotary inv_freq) under their module path."""
    live = dict(model.state_dict(keep_vars=True))
    for name, buf in model.named_buffers():
        live.setdefault(name, buf)
    return {name: (t.data if isinstance(t, torch.nn.Parameter) else t) for name, t in live.items()}


def resolve_names(model: torch.nn.Module, weights, targets: dict | None = None):
    """(name, tensor) pairs with every name spelled as the model's state dict spells it (PEFT's adapter names are
    translated, with or without PeftModel's `base_model.model.` prefix; unknown names pass through for plan_update
    to reject). Yields lazily, so a stream stays a stream."""
    targets = named_tensors(model) if targets is None else targets
    aliases = None
    for item in (weights.items() if isinstance(weights, dict) else weights):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"weights item {item!r:.60} is invalid: must be a (name, tensor) pair. Fix: pass a "
                             "state dict or an iterable of (name, tensor).")
        name, tensor = item
        if name not in targets:
            aliases = adapters.peft_names(model) if aliases is None else aliases  # built once, on the first miss
            name = next((aliases.get(n, n) for n in adapters.spellings(name) if aliases.get(n, n) in targets), name)
        yield name, tensor


def plan_update(model: torch.nn.Module, weights, full: bool = False) -> UpdatePlan:
    targets = named_tensors(model)
    copies, seen = [], set()
    for name, tensor in resolve_names(model, weights, targets):
        copies.append((_target(targets, name), _checked(name, tensor, targets)))
        seen.add(name)
    if full:
        check_complete(model, seen)
    return UpdatePlan(copies)


def check_complete(model: torch.nn.Module, seen: set[str]) -> None:
    """The ValueError of a full update that misses a state-dict entry."""
    missing = sorted(n for n in model.state_dict() if n not in seen)
    if missing:
        raise ValueError(f"weights are missing {len(missing)} tensors, first {missing[0]!r}: a full update needs "
                         "every state-dict entry. Fix: send the whole state dict, or use full=False.")


def apply_by_bucket(model: torch.nn.Module, buckets) -> set[str]:
    """Validate and copy in each bucket (a dict or (name, tensor) pairs) before taking the next, so only one bucket is
    ever staged; a bad bucket raises after the earlier ones were applied. Returns the names applied."""
    seen: set[str] = set()
    for bucket in buckets:
        items = list(bucket.items() if isinstance(bucket, dict) else bucket)
        apply_update(plan_update(model, items))
        seen.update(name for name, _ in items)
    return seen


def _target(targets: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in targets:
        close = [n for n in targets if n.split(".")[-1] == str(name).split(".")[-1]][:3]
        hint = ""
        if "lora_" in str(name) and not any("lora_" in n for n in targets):
            hint = ("; it names a LoRA adapter tensor but this model has no adapters: build the rollout side from "
                    "the PEFT model (get_peft_model(...)), or send merged full weights")
        raise ValueError(f"weights[{name!r}] is invalid: the model has no tensor of that name. Fix: use the names of "
                         f"model.state_dict() or, for an adapter, get_peft_model_state_dict(model)"
                         f"{'; similar: ' + ', '.join(close) if close else ''}{hint}.")
    return targets[name]


def _checked(name: str, tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
    target = targets[name]
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"weights[{name!r}] is invalid: got {type(tensor).__name__}, not a tensor. Fix: pass "
                         "torch tensors.")
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"weights[{name!r}] has shape {tuple(tensor.shape)} but the model's is "
                         f"{tuple(target.shape)}. Fix: send the tensor of the same architecture.")
    if tensor.is_floating_point() and tensor.numel() and not _finite(tensor):
        raise ValueError(f"weights[{name!r}] contains NaN or Inf. Fix: check the trainer's step (loss scale, "
                         "learning rate) before sending weights.")
    return tensor.detach()


def _finite(tensor: torch.Tensor) -> bool:
    """One reduction pass, no full-size boolean temporary: NaN propagates through min/max, and +-Inf is an end."""
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def apply_update(plan: UpdatePlan) -> None:
    with torch.no_grad():
        for dst, src in plan.copies:
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype, non_blocking=True))
    if any(dst.is_cuda for dst, _ in plan.copies):
        torch.cuda.synchronize()


def fingerprint(model: torch.nn.Module | dict[str, torch.Tensor]) -> str:
    """A short hash of every state-dict tensor: sha256, on the host, over each tensor's name, dtype, shape and
    `checksum` (computed where the tensor lives). What crosses to the host is 8 bytes per tensor, not the weights;
    the same weights give the same fingerprint on any device. A state dict (e.g. gathered from FSDP shards) is hashed
    as the model that holds it would be."""
    return _fingerprint(model, {})[0]


def _fingerprint(model, known: dict[str, tuple[int, int]]) -> tuple[str, dict[str, tuple[int, int]]]:
    """(fingerprint, the checksums computed); `known`: name -> (data pointer, checksum) still valid."""
    state = model if isinstance(model, dict) else model.state_dict()
    items = sorted(state.items())
    missing = [(name, t) for name, t in items if known.get(name, (None,))[0] != t.data_ptr()]
    sums = [checksum(t) for _, t in missing]
    values = (torch.stack(sums).tolist() if len({s.device for s in sums}) == 1 else [int(s) for s in sums]) \
        if sums else []
    fresh = {name: (t.data_ptr(), value) for (name, t), value in zip(missing, values)}
    digest = hashlib.sha256()
    for name, t in items:
        value = (fresh.get(name) or known[name])[1]
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{value}".encode())
    return digest.hexdigest()[:16], fresh


class DigestCache:
    """A worker's fingerprint without re-reading unchanged weights: per-tensor checksums are kept between calls, and a
    tensor is summed again only after a write through the worker (`forget(written)`), a `forget()` of everything
    (the owner changed the model in place), or when it moved (its data pointer changed). After an adapter-only
    update only the adapter is summed again. `forget(())` just fences: a fingerprint being computed concurrently
    keeps its checksums to itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: dict[str, tuple[int, int]] = {}
        self._epoch = 0

    def forget(self, written: Iterable[torch.Tensor] | None = None) -> None:
        with self._lock:
            self._epoch += 1
            if written is None:
                self._digests.clear()
                return
            pointers = {t.data_ptr() for t in written}
            self._digests = {n: d for n, d in self._digests.items() if d[0] not in pointers}

    def fingerprint(self, model: torch.nn.Module) -> str:
        with self._lock:
            epoch, known = self._epoch, dict(self._digests)
        value, fresh = _fingerprint(model, known)
        with self._lock:
            if self._epoch == epoch:  # nothing was written meanwhile: what was summed is still what is held
                self._digests.update(fresh)
        return value


# Words per pass. A GPU takes large passes (few kernel launches, 128 MiB temporaries); a CPU small ones, whose
# temporaries stay in its caches (2^24 took ~7 s for 27M fp32 words on 2 cores, 2^14 0.23 s: fresh large buffers are
# page-faulted in on every pass). Any size gives the same checksum.
CHECKSUM_WORDS = {"cuda": 2**24, "cpu": 2**14}
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A 64-bit checksum of a tensor's bits, on its device (int64, 0-dim): the sum mod 2^64 of every element's bit
    pattern mixed with its index by splitmix64 (engine.streams.spread). A change of any one element changes it (the
    mix is a bijection); unrelated changes cancel with probability ~2^-64. No host copy, no synchronisation."""
    words = tensor.detach().contiguous().reshape(-1)
    words = words.view(_WORDS[words.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    step = CHECKSUM_WORDS.get(words.device.type, CHECKSUM_WORDS["cpu"])
    for start in range(0, words.numel(), step):
        total += spread(words[start: start + step].to(torch.int64), start + 1).sum()
    return total
