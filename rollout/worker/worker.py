"""RolloutWorker: what a trainer calls every step.

    worker = RolloutWorker(model_or_path, config=WorkerConfig(...), tokenizer=None)
    batch = worker.generate(prompts, sampling=SamplingParams(n=8, temperature=1.0))
    ...  # optimizer.step() on the same model
    worker.refresh()                           # shared model: fence, cache invalidation, version bump
    worker.update_weights(state_dict)          # own copy: atomic, validated, in-place copy
    worker.sleep(); ...train...; worker.wake() # colocated with a trainer: the KV cache is freed while it trains
    worker.metrics()                           # counters and gauges (rollout/metrics/snapshot.py); docs/observability.md
    worker.serve_metrics(9400)                 # the same, for Prometheus, on http://127.0.0.1:9400/metrics

One persistent engine per worker (started once; rebuilt when it wakes from `sleep`). A shared model is used in
place: generate leaves its training flag and attention implementation as it found them, and never touches its
gradients or the global RNG.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..base.batch import RolloutBatch
from ..base.config import WorkerConfig, check_in_flight
from ..base.env import EnvFactory, EpisodeSpec
from ..base.errors import invalid
from ..base.params import SamplingParams
from ..base.rollouts import model_name, request_limit
from ..engine import (Call, DraftModel, Engine, Episode, Sample, current_attn_implementation, install,
                      resolve_attn_implementation, set_attn_implementation)
from ..metrics.snapshot import WorkerMetrics
from ..model import adapters
from ..model import weights as weights_mod
from ..model.loading import load_model, loading_attention, pad_token_id
from .future import RolloutFuture
from .validation import compile_structured, prepare_call

# on_tokens(prompt_index, sample_index, token_ids, logprobs, token_versions, top): top is None, or per token the
# (ids, logprobs) of its SamplingParams.top_logprobs most likely tokens
TokenCallback = Callable[[int, int, list[int], list[float], list[int], list[tuple[list[int], list[float]]] | None],
                         None]
_LIVE_WORKERS: "weakref.WeakSet[RolloutWorker]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # the engine thread is a daemon, so exit never hangs; stopping it here still lets
    # it finish its step before the interpreter tears down the modules it runs on
    for worker in list(_LIVE_WORKERS):
        worker.close()


class RolloutWorker:
    def __init__(self, model_or_path: Any, config: WorkerConfig | None = None, tokenizer: Any = None) -> None:
        self.config = config if config is not None else WorkerConfig()
        install()  # the engine's hooks on transformers (once per process), before a checkpoint loads with them
        self.model, self.tokenizer = load_model(model_or_path, tokenizer,
                                                attn_implementation=loading_attention(self.config.attn_implementation))
        self.owns_model = not hasattr(model_or_path, "forward")
        self._user_attn = current_attn_implementation(self.model)
        engine_attn = resolve_attn_implementation(self.config.attn_implementation, self.model)
        if engine_attn is not None:
            set_attn_implementation(self.model, engine_attn)
        self._lock = threading.RLock()
        self._active_calls = 0
        self._was_training = self.model.training
        self._merge: contextlib.ExitStack | None = None  # adapters merged for the running calls (merge_adapters)
        self._merged: adapters.Merge | None = None  # what that merge changed
        try:  # a config the model cannot run with fails here: the owner's attention comes back all the same
            self.engine = Engine(self.model, self.config, draft_model=self._draft_model())
            self._engine_attn = current_attn_implementation(self.model)
        finally:
            self._set_attn(self._user_attn)
        self._digests = weights_mod.DigestCache()  # per-tensor checksums: a fingerprint re-reads only what changed
        self._half_updated: str | None = None  # why a bucketed update stopped midway (see update_weights_by_bucket)
        self._metrics_server = None  # the Prometheus endpoint, when serve_metrics started one
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
    def max_context(self) -> int | None:
        """The model's context length (`max_position_embeddings`), or None if its config has none."""
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + completion) the KV cache holds."""
        return self.engine.max_request_tokens

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

    @property
    def supports_streaming(self) -> bool:
        return True  # submit(..., on_tokens=fn)

    @property
    def model_name(self) -> str:
        return model_name(self.model.config.name_or_path)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat_template: bool = False, timeout: float | None = None, env: EnvFactory | None = None,
                 max_turns: int = 1, max_episode_tokens: int | None = None,
                 env_timeout: float | None = 300.0, *, episode: EpisodeSpec | None = None) -> RolloutBatch:
        """Generate every sample of every prompt; rows come back prompt-major. Validates the whole call first.
        `submit(...).result(timeout)`, except that a call that times out (or is interrupted) is cancelled. A
        sleeping worker wakes first (its cache is re-allocated, as `wake()` does).

        With `env` (`make_env(prompt_index, sample_index) -> Environment`), every sample is a multi-turn episode:
        after each model turn its environment steps off the engine thread and the next turn is submitted as soon as
        the observation is back, reusing the episode's cached KV (docs/episodes.md). `episode=EpisodeSpec(...)` is
        the same as its fields given as keywords (env, max_turns, max_episode_tokens, env_timeout)."""
        future = self.submit(prompts, sampling, chat_template, env, max_turns, max_episode_tokens, env_timeout,
                             episode=episode)
        try:
            return future.result(timeout)
        except BaseException:  # timeout, Ctrl-C, ...: nothing of this call keeps running in the engine
            future.cancel()
            raise

    def submit(self, prompts: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
               chat_template: bool = False, env: EnvFactory | None = None, max_turns: int = 1,
               max_episode_tokens: int | None = None, env_timeout: float | None = 300.0, *,
               episode: EpisodeSpec | None = None, on_tokens: TokenCallback | None = None) -> RolloutFuture:
        """Validate the call, submit it and return at once (docs/async.md). Several calls may be in flight; weight
        updates may land while they run (`update_weights(..., in_flight=...)`), and every token of the result says
        which version produced it (`batch.token_versions`).

        `on_tokens(prompt_index, sample_index, token_ids, logprobs, token_versions, top)` streams the call (not with
        `env`): called on the engine thread after every step that samples a token for a row, with everything the row
        has so far (`top`: None, or per token the (ids, logprobs) of its `top_logprobs` most likely tokens); it must
        return at once (hand the lists to another thread). A row re-run after an engine restart
        or an "abort" update reports from its first token again. The batch at the end holds the same tokens."""
        if self._half_updated is not None:
            raise RuntimeError(f"the weights are half-updated: {self._half_updated}. Fix: send the whole state dict "
                               "with update_weights(..., full=True) before generating.")
        spec = EpisodeSpec.of(env, max_turns, max_episode_tokens, env_timeout, episode)
        if on_tokens is not None and (spec is not None or not callable(on_tokens)):
            raise invalid("on_tokens", on_tokens, "must be a callable, and streams single-turn calls only",
                          "drop env=... to stream, or on_tokens=... to run episodes")
        groups = self._prepare(prompts, sampling, chat_template, spec)
        call = Call([s for group in groups for s in group], on_over=lambda _: self._leave_generation_mode(),
                    on_tokens=None if on_tokens is None else
                    lambda s, ids, lps, vs, top: on_tokens(s.prompt_index, s.sample_index, ids, lps, vs, top))
        future = RolloutFuture(call, self.engine.cancel, self._batch_of)
        self._enter_generation_mode()
        if call.samples:
            self.engine.submit(groups, call)
        else:
            self._leave_generation_mode()
            call.settle()
        return future

    def _batch_of(self, rows: list) -> RolloutBatch:
        rows = sorted(rows, key=lambda r: (r.prompt_index, r.sample_index, r.segment_index))
        return RolloutBatch.from_rows(rows, pad_token_id=pad_token_id(self.tokenizer), tokenizer=self.tokenizer)

    def _prepare(self, prompts, sampling, chat_template, spec: EpisodeSpec | None = None) -> list[list[Sample]]:
        limit = request_limit(self.max_context, self.max_request_tokens)
        token_lists, params = prepare_call(prompts, sampling, self.tokenizer, chat_template, self.vocab_size,
                                           self.max_context, self.max_request_tokens)
        groups = []
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            stop = () if p.ignore_eos else (p.stop_token_ids if p.stop_token_ids is not None else self.default_stop_ids)
            if p.is_constrained:
                compile_structured(self.engine, self.tokenizer, self.vocab_size, p, tuple(stop), i)
            budget = None if spec is None else spec.budget(len(ids), limit, i)
            groups.append([Sample(None, i, j, ids, p, tuple(stop), episode=self._episode(spec, budget, ids, limit))
                           for j in range(p.n)])
        return groups

    def _episode(self, spec: EpisodeSpec | None, budget: int | None, prompt: list[int], limit: int) -> Episode | None:
        if spec is None:
            return None
        return Episode(spec.env, spec.max_turns, budget, self.vocab_size, spec.env_timeout, prompt=list(prompt),
                       limit=limit, cap=spec.max_episode_tokens)

    def _enter_generation_mode(self) -> None:
        """Eval mode and the engine's attention while any call is in flight (counted, so concurrent calls keep
        them); the owner's training flag and attention come back when the last one is over."""
        with self._lock:
            if self._active_calls == 0:
                self._was_training = self.model.training
                self.model.eval()
                self._set_attn(self._engine_attn)
                self._merge_adapters()
            self._active_calls += 1

    def _leave_generation_mode(self) -> None:
        """Called once per call, after it is over (on the engine's supervisor thread). Merged adapters are unmerged
        and the owner's attention restored inside a pause of the loop, so no forward of the engine thread ever runs
        with them: a cancelled request is dropped by the loop before its next step, and a step under way finishes
        first."""
        with self._lock:
            self._active_calls -= 1
            if self._active_calls == 0:
                with self.engine.paused():
                    self._unmerge_adapters()
                    self._set_attn(self._user_attn)
                    self.model.train(self._was_training)

    def _set_attn(self, impl: str) -> None:
        set_attn_implementation(self.model, impl)

    def _draft_model(self) -> DraftModel | None:
        """The "model" draft source's runner: `speculation.draft_model` (a model object, or a checkpoint directory
        loaded on the policy's device in its dtype), checked to draft in the policy's ids."""
        spec = self.config.speculation
        if spec is None or spec.mode == "off" or "model" not in spec.drafts:
            return None
        draft, draft_tokenizer = load_model(spec.draft_model, dtype=self.model.dtype, device=self.model.device,
                                            field="speculation.draft_model")
        same = draft_tokenizer is not None and self.tokenizer is not None  # a model object comes without one
        if same and draft_tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise invalid("speculation.draft_model", str(spec.draft_model), "has another tokenizer than the policy "
                          "(their vocabularies differ)", "use a draft model trained with the policy's tokenizer")
        return DraftModel.checked(draft, self.model, same_tokenizer=same)

    def _merge_adapters(self) -> None:
        if self.config.merge_adapters and self._merge is None and adapters.is_peft_model(self.model):
            self._digests.forget(())  # a fingerprint racing the merge must not keep digests of merged bytes
            with contextlib.ExitStack() as stack:
                self._merged = stack.enter_context(adapters.merged(self.model))
                self._merge = stack.pop_all()
            self.engine.weights_changed()

    def _unmerge_adapters(self) -> bool:
        """Base weights back to their exact bytes; True when adapters were merged (to merge again after)."""
        merge, self._merge, self._merged = self._merge, None, None
        if merge is not None:
            merge.close()
            self.engine.weights_changed()
        return merge is not None

    # ------------------------------------------------------------------ weights
    def refresh(self, version: int | None = None, in_flight: str | None = None) -> int:
        """The shared model's weights changed in place: fence, forget cached KV, bump the version. `in_flight`
        (default `WorkerConfig.in_flight`) says what happens to calls in flight: "wait", "abort", "recompute" or
        "keep" (docs/async.md). With a shared model, change its weights only when nothing is in flight, or inside
        `in_place_update()`, so that no forward runs while they change."""
        with self.in_place_update(version, in_flight) as bump:
            return bump()

    def update_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None, full: bool = False, in_flight: str | None = None) -> int:
        """Copy new weights in place, atomically: every tensor is validated before any parameter changes.
        `in_flight` as in `refresh`."""
        weights_mod.check_version(version)
        plan = weights_mod.plan_update(self.model, weights, full=full)
        written = [dst for dst, _ in plan.copies]
        with self.in_place_update(version, in_flight, written) as bump:
            weights_mod.apply_update(plan)
            if full:
                self._half_updated = None
            return bump()

    @contextlib.contextmanager
    def in_place_update(self, version: int | None = None, in_flight: str | None = None,
                      written: Iterable[torch.Tensor] | None = None):
        """Change the weights in place inside this block (e.g. a shared model's `optimizer.step()`): no forward runs
        meanwhile, what is in flight is handled by `in_flight`, and the version is bumped (to `version`, or + 1)
        when the block ends. `as bump` gives a function that bumps early and returns the new version. Adapters merged
        for calls in flight are unmerged first (the change lands on the exact base weights) and merged again after.
        `written`: the tensors the block writes (None: any, so every cached checksum is dropped)."""
        weights_mod.check_version(version)
        mode = self.config.in_flight if in_flight is None else in_flight
        check_in_flight(mode)
        bumped: list[int] = []

        def bump() -> int:
            if not bumped:
                bumped.append(self._bump(version))
            return bumped[0]

        # the worker's lock too: a call being fenced cannot end (and unmerge) between our unmerge and re-merge
        with self.engine.exclusive(mode), self._lock:
            remerge = self._unmerge_adapters()
            try:
                yield bump
            finally:
                self._digests.forget(written)
                if remerge:
                    self._merge_adapters()
            bump()

    def update_weights_by_bucket(self, buckets: Iterable, version: int | None = None, full: bool = False,
                                 in_flight: str | None = None) -> int:
        """update_weights for a sender that validated the whole update already (RolloutFleet does): each bucket (a
        dict or (name, tensor) pairs) is validated and copied in as it arrives, so one bucket is staged, not all of
        them (update_weights holds an extra copy of the weights). Rollouts never see a half-updated model (one fence
        for all buckets), but a bucket that fails, or a stream that breaks, leaves the earlier ones applied: the
        worker then refuses to generate until a full update succeeds."""
        with self.in_place_update(version, in_flight) as bump:
            try:
                seen = weights_mod.apply_by_bucket(self.model, buckets)
                if full:
                    weights_mod.check_complete(self.model, seen)
            except BaseException as exc:
                self._half_updated = f"a bucketed update stopped midway ({type(exc).__name__}: {exc})"
                raise
            if full:
                self._half_updated = None
            return bump()

    def _bump(self, version: int | None) -> int:
        self.engine.weights_changed()
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
        from ..scoring import score

        with self.engine.exclusive("wait", invalidate=False):
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
        self._enter_generation_mode()  # the engine's buffers are sized for the engine's attention
        try:
            self.engine.wake()
        finally:
            self._leave_generation_mode()

    # ------------------------------------------------------------------ pause
    def pause(self, in_flight: str = "keep") -> None:
        """Stop generating until `resume()` (a trainer's update window; a server's /pause). What is in flight: "keep"
        freezes it where it is, "wait" lets it finish first, "abort" re-runs it from scratch after the resume. Calls
        made meanwhile are accepted and wait. Weight updates may land while paused, with their own `in_flight`
        ("recompute": frozen requests continue exact under the new weights; "wait" is refused while any is frozen)."""
        self.engine.hold(in_flight)

    def resume(self) -> None:
        """Generate again after `pause()` (a no-op when not paused)."""
        self.engine.release()

    @property
    def is_paused(self) -> bool:
        return self.engine.is_held

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (requests in flight keep their own KV): later requests prefill in full."""
        with self.engine.paused():
            self.engine.forget_prefix_cache()

    # ------------------------------------------------------------------ observability
    def metrics(self) -> WorkerMetrics:
        """A snapshot of what this worker has done since it started (counters: tokens, rows by finish reason,
        preemptions, restarts, weight updates, ...) and holds now (gauges: requests, KV pages, version); names,
        units and meanings in rollout/metrics/snapshot.py and docs/observability.md."""
        return WorkerMetrics.of(*self.engine.metrics())

    def serve_metrics(self, port: int, host: str = "127.0.0.1"):
        """Serve `metrics()` for Prometheus on http://host:port/metrics until the worker closes (or the returned
        `MetricsServer` is closed). Listens on this machine only unless `host` says otherwise (e.g. "0.0.0.0").
        One endpoint per worker: a second call is refused while the first serves. `port=0` picks a free port."""
        from ..metrics.prometheus import serve

        with self._lock:
            self._metrics_server = serve(self._metrics_server, self.metrics, port, host, "worker")
            return self._metrics_server

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        server = getattr(self, "_metrics_server", None)
        if server is not None:
            server.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
            self._set_attn(self._user_attn)

    def __enter__(self) -> "RolloutWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
