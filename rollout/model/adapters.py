"""LoRA (PEFT) adapters on the rollout side: PEFT's own names for updates, and exact merge-for-generation.

A `peft.PeftModel` is an ordinary model to the engine: its forward adds each adapter's low-rank branch to the
frozen base layer. Two things are specific to it:

- **Names.** `peft.get_peft_model_state_dict(model)` writes adapter tensors without the adapter name
  (`...q_proj.lora_A.weight` for the state-dict entry `...q_proj.lora_A.default.weight`). `peft_names(model)` maps
  those names to the model's own, with PEFT's function itself (matched by tensor identity, so every PEFT method
  and its key rules are covered), for the active adapter; `rollout.model.weights` accepts both spellings.
- **Merging.** `merged(model)` folds the active adapters into the base weights for the duration of a block (PEFT's
  own `merge()`, so the forward skips the low-rank branches) and then puts every base tensor back *bit for bit*:
  `unmerge()` alone subtracts the delta again, which is not exact in floating point, so the original bytes are
  saved before the merge and copied back in place after it (addresses unchanged). Cost: one copy of the targeted
  base weights while merged. Merging pays (benchmarks/features/bench_lora.py): RolloutWorker does it for every generate
  call unless `WorkerConfig(merge_adapters=False)`.

peft is imported only when a model actually carries adapters; nothing here is needed without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..base.errors import logged


def is_peft_model(model: torch.nn.Module) -> bool:
    """True when the model carries PEFT adapters (a `PeftModel`, or a model with adapters injected)."""
    return bool(getattr(model, "peft_config", None))


def active_adapter(model: torch.nn.Module) -> str:
    adapter = None
    with logged("reading the model's active adapter"):  # transformers' adapter integration spells it as a method
        # that raises when its own loader was not used (e.g. a base model PEFT injected adapters into)
        adapter = getattr(model, "active_adapter", None)
        adapter = adapter() if callable(adapter) else adapter
    if adapter is None:
        layers = _tuner_layers(model)
        adapter = layers[0].active_adapter if layers else None
    if isinstance(adapter, (list, tuple)):
        adapter = adapter[0] if len(adapter) == 1 else None
    if not isinstance(adapter, str):
        raise ValueError(f"the model's active adapter is {adapter!r}: PEFT-named updates need exactly one active "
                         "adapter. Fix: model.set_adapter(name), or send the full state-dict names.")
    return adapter


PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the model it wraps


def spellings(name: str) -> tuple[str, str]:
    """The name as given, and as it reads from the other side of a PeftModel wrapper (a PeftModel's names carry
    `base_model.model.`; a model PEFT injected adapters into directly has none)."""
    other = name.removeprefix(PEFT_PREFIX) if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name
    return name, other


def peft_names(model: torch.nn.Module) -> dict[str, str]:
    """PEFT's name of each tensor of the active adapter (as `get_peft_model_state_dict` writes it) -> the model's
    state-dict name. Empty for a model without adapters. Cost: one pass over the state-dict keys."""
    if not is_peft_model(model):
        return {}
    from peft import get_peft_model_state_dict

    live = model.state_dict(keep_vars=True)
    by_id = {id(tensor): name for name, tensor in live.items()}
    exported = get_peft_model_state_dict(model, state_dict=live, adapter_name=active_adapter(model),
                                         save_embedding_layers=False)
    return {name: by_id[id(tensor)] for name, tensor in exported.items() if id(tensor) in by_id}


def adapter_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor]:
    """The active adapter's tensors under PEFT's names (`get_peft_model_state_dict`): what a trainer sends to a
    rollout side that holds the same PEFT model. `state_dict`: the model's full state dict when it was gathered
    elsewhere (e.g. from FSDP shards)."""
    from peft import get_peft_model_state_dict

    state = state_dict if state_dict is not None else model.state_dict()
    return {name: tensor.detach() for name, tensor in
            get_peft_model_state_dict(model, state_dict=state, adapter_name=active_adapter(model),
                                      save_embedding_layers=False).items()}


def _tuner_layers(model: torch.nn.Module) -> list:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@dataclass
class Merge:
    """What `merged` did: how many adapter layers it folded in, and each base parameter's bytes from before."""

    layers: int = 0
    originals: dict[int, torch.Tensor] = field(default_factory=dict)  # id(parameter) -> its bytes before the merge


@contextlib.contextmanager
def merged(model: torch.nn.Module) -> Iterator[Merge]:
    """Merge the active adapters into the base weights inside the block; restore the base bytes exactly after.
    Yields a `Merge` (0 layers for a model without adapters, or one already merged by its owner)."""
    if not is_peft_model(model):
        yield Merge()
        return
    layers = [layer for layer in _tuner_layers(model) if not layer.merged
              and all(p.is_floating_point() for p in layer.get_base_layer().parameters(recurse=False))]  # a
    # quantized base would be dequantized and requantized by a merge: its layers run unmerged
    saved = []  # (parameter, its storage before the merge, a copy of its bytes)
    # no_grad around the merge and the restore only, never across the yield: a worker merges on the thread that
    # submits a call and restores on the engine's supervisor thread, and grad mode is per thread
    with torch.no_grad():
        for layer in layers:
            for param in layer.get_base_layer().parameters(recurse=False):
                saved.append((param, param.data, param.data.clone()))
    try:
        with torch.no_grad():
            for layer in layers:
                layer.merge()
        yield Merge(len(layers), {id(param): original for param, _, original in saved})
    finally:
        with torch.no_grad():
            for layer in layers:
                if layer.merged:
                    layer.unmerge()  # clears PEFT's merged state; the bytes come back from the copies below
            for param, storage, original in saved:
                if param.data.data_ptr() != storage.data_ptr():  # a variant that merged out of place
                    param.data = storage
                storage.copy_(original)


def unmerged_state_dict(model: torch.nn.Module, merge: Merge | None) -> dict[str, torch.Tensor]:
    """The model's state dict as its owner knows it: while `merge` is in effect, merged base weights read as their
    bytes from before the merge (what a peer restoring from this model, or a fingerprint, must see)."""
    if merge is None or not merge.originals:
        return model.state_dict()
    return {name: merge.originals.get(id(t), t).detach() for name, t in model.state_dict(keep_vars=True).items()}
