"""FleetActor: one RolloutWorker in its own process, as RolloutFleet runs it (rollout.fleet wraps it with
`ray.remote`; nothing here imports Ray).

Calls speak token ids and plain data: `generate` streams the chunk's rows prompt by prompt as each group completes
(prompt_ids left out: the caller has them), then the worker's metrics snapshot (so the fleet's totals keep what an
actor counted even if it dies before the next `metrics()` call). Weight updates arrive through a transport
(transport.py): `receive` runs the transport's receiving half here and applies what it returns atomically; `connect`
runs its per-actor setup (e.g. joining a torch.distributed group). A model, a peer's state dict and the updates a
replacement replays travel in the shared form of `to_shared` (numpy views of state-dict tensors: Ray stores numpy
arrays in shared memory and hands them to every actor on the node without a copy or unpickling; torch tensors it
would pickle, copy and rebuild per reader). The read-only methods (`info`, `state`, `state_dict`) are meant to run in
a separate concurrency group, so monitoring and restoring a peer never wait behind a generate.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import traceback
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any

import torch

from ..base.config import WorkerConfig
from ..base.env import EpisodeSpec
from ..metrics.snapshot import WorkerMetrics
from ..model import adapters
from ..model.loading import checkpoint_dir, load_tokenizer, model_from_state_dict
from ..moe import Routing, find_routers
from ..worker.worker import RolloutWorker


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
        self.links: dict[type, Any] = {}  # transport -> what its `connect` set up here (e.g. a WeightGroup)
        self.busy = 0  # generate and score calls running
        self._futures: dict[int, list] = {}  # call id -> its generate futures here
        self._lock = threading.Lock()
        self._cancelled: deque[int] = deque(maxlen=1024)  # the latest cancelled call ids
        self.num_calls = 0
        self.num_rows = 0
        self.num_fingerprints = 0

    def info(self) -> dict:
        return dict(pid=os.getpid(), host=socket.gethostname(), device=str(self.worker.model.device),
                    version=self.worker.policy_version, max_request_tokens=self.worker.max_request_tokens,
                    default_stop_ids=tuple(self.worker.default_stop_ids),
                    busy=self.busy, sleeping=self.worker.is_sleeping, num_calls=self.num_calls, num_rows=self.num_rows,
                    num_fingerprints=self.num_fingerprints,
                    torch_threads=torch.get_num_threads())

    # ------------------------------------------------------------------ work
    def generate(self, prompts: list[list[int]], sampling: list, spec: EpisodeSpec | None = None,
                 indices: list[int] | None = None, call_id: int = 0) -> Iterator[tuple[int, list]]:
        """Yields (prompt index local to the chunk, that prompt's rows) as each prompt's group completes, in
        finishing order (a Ray streaming generator on the fleet's side), then (-1, the worker's metrics
        snapshot). `indices` are the chunk's prompts' indices in the fleet's call, which an episode's make_env
        is called with. Several calls run at once (the actor's default group has room for them), each cancelled
        by its `call_id`."""
        with self._lock:
            self.busy += 1
        future = None
        try:
            episodes = {} if spec is None else \
                dict(spec.kwargs(), env=_Reindexed(spec.env, indices or list(range(len(prompts)))))
            future = self.worker.submit(prompts, sampling=sampling, **episodes)
            with self._lock:
                self._futures.setdefault(call_id, []).append(future)
                cancelled = call_id in self._cancelled
            if cancelled:  # its cancel arrived before it started
                future.cancel()
            for group in future.as_completed():
                # the fleet knows each episode's first prompt; a later segment's own prompt travels with its row
                rows = [dataclasses.replace(row, prompt_ids=[]) if row.segment_index == 0 else row
                        for row in group.rows()]
                self.num_rows += len(rows)
                yield int(group.prompt_index[0]), rows
            self.num_calls += 1
            yield -1, self.worker.metrics()
        except CancelledError:  # the fleet cancelled its call (`cancel`): nobody waits for these rows
            return
        finally:
            with self._lock:
                self.busy -= 1
                futures = self._futures.get(call_id, [])
                if future in futures:
                    futures.remove(future)
                if not futures:
                    self._futures.pop(call_id, None)

    def score(self, prompts: list, completions: list, temperature: Any, kwargs: dict) -> list[torch.Tensor]:
        with self._lock:
            self.busy += 1
        try:
            result = self.worker.score(prompts, completions, temperature=temperature, **kwargs)
            if kwargs.get("top_k"):  # per pair, as the fleet collects results: (logprobs, its alternatives)
                return list(zip(*result))
            if not kwargs.get("return_routing"):
                return result
            logprobs, routing = result  # per pair, as the fleet collects results: (logprobs, its experts), the
            return list(zip(logprobs, (row.numpy() for row in routing.rows)))  # experts as numpy (lighter pickles)
        finally:
            with self._lock:
                self.busy -= 1
                self.num_calls += 1

    def routing_layout(self) -> Routing:
        """The layout (layers, experts, top-k; no rows) of the routing this actor's model records; ValueError for a
        model without routers the recorder understands (rollout.moe.find_routers)."""
        routers = find_routers(self.worker.model)
        return Routing(tuple(r.name for r in routers), routers[0].num_experts, routers[0].top_k, ())

    def metrics(self) -> WorkerMetrics:
        """The worker's snapshot (control group: runs beside a generate)."""
        return self.worker.metrics()

    def sleep(self) -> bool:
        self.worker.sleep()
        return True

    def wake(self) -> bool:
        self.worker.wake()
        return True

    # ------------------------------------------------------------------ weights
    def cancel(self, call_id: int | None = None) -> int:
        """Cancel the generate calls in flight of one fleet call (all of them: None); control group, beside them.
        Returns the model tokens they had sampled for groups the cancel threw away (their futures' count)."""
        with self._lock:
            futures = [f for key, fs in self._futures.items() if call_id is None or key == call_id for f in fs]
            if call_id is not None:
                self._cancelled.append(call_id)
        for future in futures:
            future.cancel()
        return sum(future.discarded_tokens for future in futures)

    def receive(self, transport: type, payload: Any, version: int, full: bool = False, in_flight: str = "wait") -> int:
        """One update that came through `transport` (a WeightTransport class), applied under `in_flight` (a generate
        in flight on this actor goes on beside it). A transport that streams (`transport.streamed`) yields bucket
        after bucket, each copied in as it lands (one bucket staged; the fleet validated the whole update before
        sending): if it stops midway this actor holds half-updated weights, so it exits at once, and the fleet
        replaces it as it replaces any dead actor. Otherwise every tensor is staged, then applied atomically."""
        received = transport.receive(self, payload)
        if not getattr(transport, "streamed", False):
            return self.worker.update_weights(received, version=version, full=full, in_flight=in_flight)
        try:
            return self.worker.update_weights_by_bucket(received, version=version, full=full, in_flight=in_flight)
        except BaseException:
            traceback.print_exc()
            os.kill(os.getpid(), signal.SIGKILL)  # dies at once, as a dead actor the fleet knows how to replace
            raise

    def connect(self, transport: type, *args: Any) -> Any:
        """The per-actor setup of `transport` (e.g. joining its process group)."""
        return transport.connect(self, *args)

    def sync(self, version: int, *updates: dict) -> tuple[int, str, dict]:
        """Bring a fresh actor to the fleet's weights: apply `updates` in order (a peer's state dict, or the
        updates the fleet retained), then report (version, fingerprint, info())."""
        for weights in updates:
            self.worker.update_weights(from_shared(weights), version=version)
        if self.worker.policy_version != version:
            self.worker.refresh(version)
        return (*self.state(), self.info())

    def state(self, verify: bool = True) -> tuple[int, str | None]:
        """(version, fingerprint); the fingerprint is None unless `verify`."""
        if not verify:
            return self.worker.policy_version, None
        self.num_fingerprints += 1
        return self.worker.policy_version, self.worker.weights_fingerprint()

    def state_dict(self) -> dict:
        return to_shared(self.worker.state_dict().items())  # never merged adapters: a restored peer gets the base

    def close(self) -> None:
        self.links.clear()
        self.worker.close()


class _Reindexed:
    """make_env called with the fleet call's prompt index rather than the chunk's."""

    def __init__(self, make_env, indices: list[int]) -> None:
        self.make_env, self.indices = make_env, indices

    def __call__(self, prompt_index: int, sample_index: int):
        return self.make_env(self.indices[prompt_index], sample_index)


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
    """A checkpoint path goes to the worker as is (rollout.model.loading loads it); an in-memory model is rebuilt from its
    config and weights, told their dtype: the actor must hold the very weights of the model it copies."""
    if not isinstance(source, InMemoryModel):
        return source
    weights = from_shared(source.state_dict)
    dtype = next((t.dtype for t in weights.values() if t.is_floating_point()), torch.float32)
    return model_from_state_dict(source.config, weights, source.generation_config, dtype=dtype,
                                 wrap=lambda model: with_adapters(model, source))


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
    path = checkpoint_dir(model, "model", "a model object, (config, state_dict)")  # multi-node: a path all nodes see
    from transformers import AutoConfig

    return path, AutoConfig.from_pretrained(path), tokenizer if tokenizer is not None else load_tokenizer(path)
