"""RolloutWorker: what a trainer calls every step.

    worker = RolloutWorker(model_or_path, config=WorkerConfig(...), tokenizer=None)
    batch = worker.generate(prompts, sampling=SamplingParams(n=8, temperature=1.0))
    ...  # optimizer.step() on the same model
    worker.refresh()                           # shared model: fence, cache invalidation, version bump
    worker.update_weights(state_dict)          # own copy: atomic, validated, in-place copy
    worker.sleep(); ...train...; worker.wake() # colocated with a trainer: the KV cache is freed while it trains

One persistent engine per worker (started once; rebuilt when it wakes from `sleep`). A shared model is used in
place: generate leaves its training flag and attention implementation as it found them, and never touches its
gradients or the global RNG.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .batch import RolloutBatch
from .config import WorkerConfig
from .engine import (Call, Engine, Sample, current_attn_implementation, resolve_attn_implementation,
                     set_attn_implementation)
from .prompts import prepare_call
from .params import SamplingParams
from . import weights as weights_mod

_LIVE_WORKERS: "weakref.WeakSet[RolloutWorker]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # the engine thread is a daemon, so exit never hangs; stopping it here still lets
    # it finish its step before the interpreter tears down the modules it runs on
    for worker in list(_LIVE_WORKERS):
        worker.close()


class RolloutWorker:
    def __init__(self, model_or_path: Any, config: WorkerConfig | None = None, tokenizer: Any = None) -> None:
        self.config = config if config is not None else WorkerConfig()
        self.model, self.tokenizer = _load(model_or_path, tokenizer, self.config)
        self.owns_model = not hasattr(model_or_path, "forward")
        self._user_attn = current_attn_implementation(self.model)
        engine_attn = resolve_attn_implementation(self.config.attn_implementation, self.model)
        if engine_attn is not None:
            self.model.set_attn_implementation(engine_attn)
        self._lock = threading.RLock()
        self._active_calls = 0
        self._was_training = self.model.training
        try:  # a config the model cannot run with fails here: the owner's attention comes back all the same
            self.engine = Engine(self.model, self.config)
            self._engine_attn = current_attn_implementation(self.model)
        finally:
            self._set_attn(self._user_attn)
        self._fingerprint_cache: tuple[int, str] | None = None
        self._half_updated: str | None = None  # why a bucketed update stopped midway (see update_weights_by_bucket)
        _LIVE_WORKERS.add(self)

    # ------------------------------------------------------------------ properties
    @property
    def policy_version(self) -> int:
        return self.engine.version

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def default_stop_ids(self) -> tuple[int, ...]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat_template: bool = False, timeout: float | None = None) -> RolloutBatch:
        """Generate every sample of every prompt; rows come back prompt-major. Validates the whole call first.
        A sleeping worker wakes first (its cache is re-allocated, as `wake()` does)."""
        if self._half_updated is not None:
            raise RuntimeError(f"the weights are half-updated: {self._half_updated}. Fix: send the whole state dict "
                               "with update_weights(..., full=True) before generating.")
        groups = self._prepare(prompts, sampling, chat_template)
        call = Call([s for group in groups for s in group])
        if call.samples:
            with self._generation_mode():
                self.engine.run(groups, call, timeout=timeout)
        rows = sorted((s.row for s in call.samples), key=lambda r: (r.prompt_index, r.sample_index))
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None and self.tokenizer.pad_token_id is not None else 0
        return RolloutBatch.from_rows(rows, pad_token_id=pad, tokenizer=self.tokenizer)

    def _prepare(self, prompts, sampling, chat_template) -> list[list[Sample]]:
        max_context = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        token_lists, params = prepare_call(prompts, sampling, self.tokenizer, chat_template, self.vocab_size,
                                           max_context, self.engine.max_request_tokens)
        groups = []
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            stop = () if p.ignore_eos else (p.stop_token_ids if p.stop_token_ids is not None else self.default_stop_ids)
            groups.append([Sample(None, i, j, ids, p, tuple(stop)) for j in range(p.n)])
        return groups

    @contextlib.contextmanager
    def _generation_mode(self):
        """Eval mode and the engine's attention while any generate call runs (counted, so concurrent calls from
        several threads keep them); the owner's training flag and attention come back when the last one ends."""
        with self._lock:
            if self._active_calls == 0:
                self._was_training = self.model.training
                self.model.eval()
                self._set_attn(self._engine_attn)
            self._active_calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._active_calls -= 1
                if self._active_calls == 0:
                    self._set_attn(self._user_attn)
                    self.model.train(self._was_training)

    def _set_attn(self, impl: str) -> None:
        set_attn_implementation(self.model, impl)

    # ------------------------------------------------------------------ weights
    def refresh(self, version: int | None = None) -> int:
        """The shared model's weights changed in place: fence, forget cached KV, bump the version."""
        _check_version(version)
        with self.engine.exclusive(abort_in_flight=self.config.in_flight == "abort"):
            return self._bump(version)

    def update_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None, full: bool = False) -> int:
        """Copy new weights in place, atomically: every tensor is validated before any parameter changes."""
        _check_version(version)
        plan = weights_mod.plan_update(self.model, weights, full=full)
        with self.engine.exclusive(abort_in_flight=self.config.in_flight == "abort"):
            weights_mod.apply_update(plan)
            if full:
                self._half_updated = None
            return self._bump(version)

    def update_weights_by_bucket(self, buckets: Iterable, version: int | None = None, full: bool = False) -> int:
        """update_weights for a sender that validated the whole update already (RolloutFleet does): each bucket (a
        dict or (name, tensor) pairs) is validated and copied in as it arrives, so one bucket is staged, not all of
        them (update_weights holds an extra copy of the weights). Rollouts never see a half-updated model (one fence
        for all buckets), but a bucket that fails, or a stream that breaks, leaves the earlier ones applied: the
        worker then refuses to generate until a full update succeeds."""
        _check_version(version)
        with self.engine.exclusive(abort_in_flight=self.config.in_flight == "abort"):
            try:
                seen = weights_mod.apply_by_bucket(self.model, buckets)
                if full:
                    weights_mod.check_complete(self.model, seen)
            except BaseException as exc:
                self._half_updated = f"a bucketed update stopped midway ({type(exc).__name__}: {exc})"
                raise
            if full:
                self._half_updated = None
            return self._bump(version)

    def _bump(self, version: int | None) -> int:
        self.engine.version = self.engine.version + 1 if version is None else version
        self._fingerprint_cache = None
        return self.engine.version

    def weights_fingerprint(self) -> str:
        """A short hash of every parameter and buffer: equal on both sides iff the weights are equal."""
        return weights_mod.fingerprint(self.model)

    # ------------------------------------------------------------------ scoring
    def score(self, prompts, completions, temperature: float = 1.0, **kwargs) -> list[torch.Tensor]:
        """Teacher-forced logprobs of stored completions with this worker's model (see rollout.scoring)."""
        from .scoring import score

        with self.engine.exclusive(abort_in_flight=False, invalidate=False):
            return score(self.model, prompts, completions, temperature=temperature, tokenizer=self.tokenizer,
                         **kwargs)

    # ------------------------------------------------------------------ colocation
    def sleep(self) -> None:
        """Free the KV cache and the engine's step buffers (and CUDA graphs) for a trainer sharing the device; the
        model's weights stay where they are. Waits for in-flight generate calls from other threads first; calls made
        meanwhile wait, then wake the worker. Weight updates and refreshes work while asleep."""
        self.engine.sleep()

    def wake(self) -> None:
        """Re-allocate what `sleep` freed (a fraction budget is measured again); `generate` does it by itself."""
        with self._generation_mode():  # the engine's buffers are sized for the engine's attention
            self.engine.wake()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
            self._set_attn(self._user_attn)

    def __enter__(self) -> "RolloutWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _loading_attn(config: WorkerConfig) -> str:
    """The attention a checkpoint is loaded with (the owner's; the engine's is set afterwards)."""
    return "sdpa" if config.attn_implementation in (None, "auto") else config.attn_implementation


def _check_version(version: int | None) -> None:
    """Checked before anything changes, so a bad version leaves weights and version as they were."""
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        raise ValueError(f"version={version!r} is invalid: must be a non-negative int. Fix: pass e.g. the "
                         "trainer's step number, or None to increment.")


def _load(model_or_path: Any, tokenizer: Any, config: WorkerConfig):
    if hasattr(model_or_path, "forward"):
        return model_or_path, tokenizer
    path = os.fspath(model_or_path)
    if not os.path.isdir(path):
        raise ValueError(f"model_or_path={path!r} is invalid: not a model object nor a local checkpoint directory. "
                         "Fix: pass a PreTrainedModel or the directory written by save_pretrained.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 attn_implementation=_loading_attn(config)).to(device)
    if tokenizer is None:
        with contextlib.suppress(Exception):
            tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
