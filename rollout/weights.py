"""Weight updates that are atomic, and a fingerprint that proves what the rollout side holds.

`plan_update` validates every incoming tensor (known name, same shape, finite values; all names present when a
full update is asked) before anything is touched; `apply_update` then copies in place with `param.data.copy_`, so
tensor addresses (CUDA graphs, optimizer references, tied weights) stay valid. Names are those of
`model.state_dict()`; tied parameters appear under each of their names and are written once. A model carrying PEFT
adapters also takes its adapter's tensors under PEFT's own names (`get_peft_model_state_dict`, see
rollout.adapters), so an adapter-only update is just the adapter's state dict.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import adapters


@dataclass(frozen=True)
class UpdatePlan:
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (destination in the model, validated source)


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
        missing = sorted(n for n in model.state_dict() if n not in seen)
        if missing:
            raise ValueError(f"weights are missing {len(missing)} tensors, first {missing[0]!r}: a full update needs "
                             "every state-dict entry. Fix: send the whole state dict, or use full=False.")
    return UpdatePlan(copies)


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
    """sha256 over the per-tensor digests (name, dtype, shape and bytes, moved to CPU) of every state-dict tensor,
    in name order. Cost: one read of the weights; a trainer checks it after a sync, not every step. A state dict
    (e.g. gathered from FSDP shards) is hashed as the model that holds it would be."""
    return _fingerprint(model, {})[0]


def _fingerprint(model, known: dict[str, tuple[int, bytes]]) -> tuple[str, dict[str, tuple[int, bytes]]]:
    """(fingerprint, the digests computed); `known`: name -> (data pointer, digest) still valid."""
    digest, fresh = hashlib.sha256(), {}
    state = model if isinstance(model, dict) else model.state_dict()
    for name, tensor in sorted(state.items()):
        hit = known.get(name)
        if hit is None or hit[0] != tensor.data_ptr():
            hit = fresh[name] = (tensor.data_ptr(), _tensor_digest(name, tensor))
        digest.update(hit[1])
    return digest.hexdigest()[:16], fresh


def _tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    t = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
    if t.numel():
        digest.update(t.view(torch.uint8).numpy())  # hashed through the buffer protocol, no bytes copy
    return digest.digest()


class DigestCache:
    """A worker's fingerprint without re-reading unchanged weights: per-tensor digests are kept between calls, and a
    tensor is hashed again only after a write through the worker (`forget(written)`), a `forget()` of everything
    (the owner changed the model in place), or when it moved (its data pointer changed). After an adapter-only
    update only the adapter is hashed again. `forget(())` just fences: a fingerprint being computed concurrently
    keeps its digests to itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: dict[str, tuple[int, bytes]] = {}
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
            if self._epoch == epoch:  # nothing was written meanwhile: what was hashed is still what is held
                self._digests.update(fresh)
        return value
