"""RolloutWorker: what a trainer calls every step.

    worker = RolloutWorker(model_or_path, config=WorkerConfig(...), tokenizer=None)
    batch = worker.generate(prompts, sampling=SamplingParams(n=8, temperature=1.0))
    ...  # optimizer.step() on the same model
    worker.refresh()                           # shared model: fence, cache invalidation, version bump
    worker.update_weights(state_dict)          # own copy: atomic, validated, in-place copy

One persistent engine per worker (started once). A shared model is used in place: generate leaves its training
flag and attention implementation as it found them, and never touches its gradients or the global RNG.
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
from . import adapters, weights as weights_mod

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
        self._merge: contextlib.ExitStack | None = None  # adapters merged for the running calls (merge_adapters)
        self._merged: adapters.Merge | None = None  # what that merge changed
        self.engine = Engine(self.model, self.config)
        self._engine_attn = current_attn_implementation(self.model)
        self._set_attn(self._user_attn)
        self._digests = weights_mod.DigestCache()  # per-tensor digests: a fingerprint re-reads only what changed
        _LIVE_WORKERS.add(self)

    # ------------------------------------------------------------------ properties
    @property
    def policy_version(self) -> int:
        return self.engine.version

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
        """Generate every sample of every prompt; rows come back prompt-major. Validates the whole call first."""
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
                self._merge_adapters()
            self._active_calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._active_calls -= 1
                if self._active_calls == 0:
                    self._unmerge_adapters()
                    self._set_attn(self._user_attn)
                    self.model.train(self._was_training)

    def _set_attn(self, impl: str) -> None:
        set_attn_implementation(self.model, impl)

    def _merge_adapters(self) -> None:
        if self.config.merge_adapters and self._merge is None and adapters.is_peft_model(self.model):
            self._digests.forget(())  # a fingerprint racing the merge must not keep digests of merged bytes
            with contextlib.ExitStack() as stack:
                self._merged = stack.enter_context(adapters.merged(self.model))
                self._merge = stack.pop_all()

    def _unmerge_adapters(self) -> bool:
        """Base weights back to their exact bytes; True when adapters were merged (to merge again after)."""
        merge, self._merge, self._merged = self._merge, None, None
        if merge is not None:
            merge.close()
        return merge is not None

    # ------------------------------------------------------------------ weights
    def refresh(self, version: int | None = None) -> int:
        """The shared model's weights changed in place: fence, forget cached KV, bump the version."""
        _check_version(version)
        with self.engine.exclusive(abort_in_flight=self.config.in_flight == "abort"), self._lock:
            self._digests.forget()  # the owner wrote the model in place: nothing cached is known to hold
            if self._unmerge_adapters():  # merged mid-call: fold the new adapter values in
                self._merge_adapters()
            return self._bump(version)

    def update_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None, full: bool = False) -> int:
        """Copy new weights in place, atomically: every tensor is validated before any parameter changes."""
        _check_version(version)
        plan = weights_mod.plan_update(self.model, weights, full=full)
        # the worker's lock too: the call being fenced cannot end (and unmerge) between our unmerge and re-merge
        with self.engine.exclusive(abort_in_flight=self.config.in_flight == "abort"), self._lock:
            remerge = self._unmerge_adapters()  # merged mid-call: the update lands on the exact base, then re-merge
            weights_mod.apply_update(plan)
            self._digests.forget(dst for dst, _ in plan.copies)
            if remerge:
                self._merge_adapters()
            return self._bump(version)

    def _bump(self, version: int | None) -> int:
        self.engine.version = self.engine.version + 1 if version is None else version
        return self.engine.version

    def weights_fingerprint(self) -> str:
        """A short hash of every parameter and buffer: equal on both sides iff the weights are equal. Tensors not
        written since the last call are not read again (an adapter-only update re-hashes only the adapter). While
        adapters are merged for a call in flight, it hashes the weights as the owner knows them (`state_dict`)."""
        with self._lock:
            merged = self._merged
            state = adapters.unmerged_state_dict(self.model, merged) if merged is not None else None
        if state is not None:
            return weights_mod.fingerprint(state)
        return self._digests.fingerprint(self.model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict as its owner knows it: while adapters are merged for a call in flight, the base
        weights' bytes from before the merge (what a peer restoring from this worker must get)."""
        with self._lock:
            return adapters.unmerged_state_dict(self.model, self._merged)

    # ------------------------------------------------------------------ scoring
    def score(self, prompts, completions, temperature: float = 1.0, **kwargs) -> list[torch.Tensor]:
        """Teacher-forced logprobs of stored completions with this worker's model (see rollout.scoring)."""
        from .scoring import score

        with self.engine.exclusive(abort_in_flight=False, invalidate=False):
            return score(self.model, prompts, completions, temperature=temperature, tokenizer=self.tokenizer,
                         **kwargs)

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
