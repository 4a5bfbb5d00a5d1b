"""FleetActor: one RolloutWorker in its own process, as RolloutFleet runs it (rollout.fleet wraps it with
`ray.remote`; nothing here imports Ray).

Calls speak token ids and plain data: `generate` returns the chunk's rows grouped by its prompts (prompt_ids left
out: the caller has them), weights arrive as numpy views of state-dict tensors (`to_shared`: Ray stores numpy arrays
in shared memory and hands them to every actor on the node without a copy or unpickling; torch tensors it would
pickle, copy and rebuild per reader) or over a WeightGroup (torch.distributed). The read-only methods (`info`,
`state`, `state_dict`) are meant to run in a separate concurrency group, so monitoring and restoring a peer never
wait behind a generate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .. import adapters
from .collective import Bucket, WeightGroup
from ..config import WorkerConfig
from ..worker import RolloutWorker


@dataclass(frozen=True)
class InMemoryModel:
    """A model that exists only in memory, shipped as (config, state dict as `to_shared` makes it, generation
    config); for a PEFT model also its adapters' configs (name -> PeftConfig) and the active adapter, so the actor
    rebuilds the same PeftModel and takes adapter-only updates."""

    config: Any
    state_dict: dict
    generation_config: Any = None
    peft_config: dict | None = None
    active_adapter: str | None = None


def with_adapters(model: Any, source: Any) -> Any:
    """The base model wrapped with the source's PEFT adapters (as `get_peft_model` wraps it); unchanged without."""
    peft_config = getattr(source, "peft_config", None)
    if not peft_config:
        return model
    from peft import get_peft_model

    names = list(peft_config)
    model = get_peft_model(model, peft_config[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, peft_config[name])
    model.set_adapter(source.active_adapter or names[0])
    return model


class FleetActor:
    def __init__(self, source: Any, config: WorkerConfig, tokenizer: Any = None,
                 torch_threads: int | None = None) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.worker = RolloutWorker(_model(source), config=config, tokenizer=tokenizer)
        self.group: WeightGroup | None = None
        self.busy = False
        self.num_calls = 0
        self.num_rows = 0

    def info(self) -> dict:
        return dict(pid=os.getpid(), host=socket.gethostname(), device=str(self.worker.model.device),
                    version=self.worker.policy_version, max_request_tokens=self.worker.engine.max_request_tokens,
                    busy=self.busy, num_calls=self.num_calls, num_rows=self.num_rows,
                    torch_threads=torch.get_num_threads())

    # ------------------------------------------------------------------ work
    def generate(self, prompts: list[list[int]], sampling: list) -> list[list]:
        """Rows of each prompt of the chunk, in the chunk's order; prompt_index is local to the chunk."""
        self.busy = True
        try:
            batch = self.worker.generate(prompts, sampling=sampling)
        finally:
            self.busy = False
        grouped: list[list] = [[] for _ in prompts]
        for row in batch.rows():
            grouped[row.prompt_index].append(dataclasses.replace(row, prompt_ids=[]))
        self.num_calls += 1
        self.num_rows += len(batch)
        return grouped

    def score(self, prompts: list, completions: list, temperature: Any, kwargs: dict) -> list[torch.Tensor]:
        self.busy = True
        try:
            return self.worker.score(prompts, completions, temperature=temperature, **kwargs)
        finally:
            self.busy = False
            self.num_calls += 1

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: dict, version: int, full: bool = False) -> int:
        return self.worker.update_weights(from_shared(weights), version=version, full=full)

    def sync(self, version: int, *updates: dict) -> tuple[int, str]:
        """Bring a fresh actor to the fleet's weights: apply `updates` in order (a peer's state dict, or the
        updates the fleet retained), then report (version, fingerprint)."""
        for weights in updates:
            self.worker.update_weights(from_shared(weights), version=version)
        if self.worker.policy_version != version:
            self.worker.refresh(version)
        return self.state()

    def state(self) -> tuple[int, str]:
        return self.worker.policy_version, self.worker.weights_fingerprint()

    def state_dict(self) -> dict:
        return to_shared(self.worker.state_dict().items())  # never merged adapters: a restored peer gets the base

    def join_group(self, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> int:
        self.group = None  # leave any previous group first (its membership is stale)
        self.group = WeightGroup(backend, host, port, rank, world_size, timeout_s)
        return rank

    def receive_weights(self, buckets: list[Bucket], version: int, full: bool = False) -> int:
        if self.group is None:
            raise RuntimeError("receive_weights before join_group: this actor is in no weight group")
        return self.worker.update_weights(self.group.receive(buckets), version=version, full=full)

    def close(self) -> None:
        self.group = None
        self.worker.close()


def to_shared(items) -> dict[str, tuple[Any, torch.dtype]]:
    """(name, tensor) pairs -> name -> (numpy view of the CPU tensor, dtype). Dtypes numpy lacks (bfloat16, fp8)
    travel as same-width integers."""
    out = {}
    for name, tensor in items:
        t = tensor.detach().to("cpu").contiguous()
        raw = t if t.dtype in _NUMPY_DTYPES else t.view(_SAME_WIDTH_INT[t.element_size()])
        out[name] = (raw.numpy(), t.dtype)
    return out


def from_shared(weights: dict) -> dict[str, torch.Tensor]:
    """Inverse of to_shared, zero-copy (the arrays may be read-only shared memory: only ever read from)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": the tensors are copy sources only
        for name, value in weights.items():
            if isinstance(value, torch.Tensor):
                out[name] = value
            else:
                array, dtype = value
                t = torch.from_numpy(array)
                out[name] = t if t.dtype == dtype else t.view(dtype)
    return out


_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool, torch.complex64, torch.complex128}
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _model(source: Any) -> Any:
    """A checkpoint path goes to the worker as is; an in-memory model is rebuilt from its config and weights."""
    if not isinstance(source, InMemoryModel):
        return source
    from transformers import AutoModelForCausalLM

    weights = from_shared(source.state_dict)
    dtype = next((t.dtype for t in weights.values() if t.is_floating_point()), torch.float32)
    model = AutoModelForCausalLM.from_config(source.config, dtype=dtype, attn_implementation="sdpa")  # the
    # owner's attention, as a checkpoint is loaded; the worker switches to the engine's (WorkerConfig) itself
    model = with_adapters(model, source)
    model.load_state_dict(weights)
    if source.generation_config is not None:
        model.generation_config = source.generation_config
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def model_source(model: Any, tokenizer: Any) -> tuple[Any, Any, Any]:
    """On the caller's side: (what the actors load, the model config, the caller's tokenizer). A checkpoint path
    must be visible to every node; a model object or (config, state_dict) travels as an InMemoryModel."""
    if isinstance(model, tuple) and len(model) == 2:
        from transformers import GenerationConfig

        config, state_dict = model
        source = InMemoryModel(config, to_shared(state_dict.items()), GenerationConfig.from_model_config(config))
        return source, config, tokenizer
    if hasattr(model, "forward"):
        peft_config = dict(model.peft_config) if adapters.is_peft_model(model) else None
        source = InMemoryModel(model.config, to_shared(model.state_dict().items()), model.generation_config,
                               peft_config, adapters.active_adapter(model) if peft_config else None)
        return source, model.config, tokenizer
    path = os.fspath(model)
    if not os.path.isdir(path):
        raise ValueError(f"model={path!r} is invalid: not a model object, (config, state_dict) nor a local checkpoint "
                         "directory. Fix: pass a PreTrainedModel or the directory written by save_pretrained (on a "
                         "multi-node cluster, a path every node sees).")
    from transformers import AutoConfig, AutoTokenizer

    if tokenizer is None:
        with contextlib.suppress(Exception):
            tokenizer = AutoTokenizer.from_pretrained(path)
    return path, AutoConfig.from_pretrained(path), tokenizer
