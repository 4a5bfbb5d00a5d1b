"""Rollouts: what a trainer may rely on of the rollout side, whichever it is.

`RolloutWorker` (one engine in this process) and `RolloutFleet` (many, on Ray actors) both satisfy it, so a trainer
types against `Rollouts` and takes either (tests/test_worker.py checks both, by signature). A worker that shares
the trainer's model also has `refresh(version)` (the weights changed in place: no copy); that is the worker's own,
and a trainer checks for it (`worker.model is policy`) before calling it.

Consumers (the server, the collector, the CLI, the trainers) use exactly this contract, with no `getattr` fallbacks:
a server in front of a fleet stops on the same ids, limits requests the same way and names the model the same way as
one in front of a worker (tests/test_fleet.py checks both side by side).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .batch import RolloutBatch
from .env import EnvFactory, EpisodeSpec
from .params import SamplingParams


@runtime_checkable
class RolloutsFuture(Protocol):
    """A submitted call (`Rollouts.submit`), as concurrent.futures users expect it: RolloutFuture (a worker's) and
    FleetFuture (a fleet's) both keep it."""

    def done(self) -> bool:
        """The call is over: its result, its error or its cancellation is final."""

    def cancelled(self) -> bool:
        """`cancel()` stopped it before it was over."""

    def result(self, timeout: float | None = None) -> RolloutBatch:
        """The whole batch; TimeoutError after `timeout` (the call goes on), CancelledError after a cancel,
        RuntimeError when a sample failed past the retries."""

    def as_completed(self, timeout: float | None = None) -> Iterator[RolloutBatch]:
        """Each prompt's group (its n rows) as a RolloutBatch, in the order the groups finish."""

    def cancel(self) -> bool:
        """Stop what is left of the call; True if it was not over yet."""

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """fn(future) once the call is over (at once if it already is), on a thread of the rollout side."""

    @property
    def discarded_tokens(self) -> int:
        """Model tokens sampled for groups a cancel threw away (0 until cancelled)."""


def request_limit(max_context: int | None, max_request_tokens: int) -> int:
    """The most tokens (prompt + completion, or a whole episode) one request may hold: the model's context and what
    the KV cache holds for one request, whichever is less. The one place this is computed."""
    return max_request_tokens if max_context is None else min(int(max_context), int(max_request_tokens))


def model_name(name_or_path: str | None) -> str:
    """What a model is called to clients (the server's default `model`): its checkpoint folder's name, else
    "rollout" (a model built in memory)."""
    return os.path.basename(os.path.normpath(name_or_path)) if name_or_path else "rollout"


@runtime_checkable
class Rollouts(Protocol):
    tokenizer: Any  # the tokenizer text prompts are encoded with, or None (token-id prompts only)

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size) (the output embedding's rows)."""

    @property
    def max_context(self) -> int | None:
        """The model's context length (`max_position_embeddings`), or None if its config states none."""

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + completion) the KV cache holds (a fleet: its smallest actor's)."""

    @property
    def default_stop_ids(self) -> tuple[int, ...]:
        """The ids a row stops on unless its SamplingParams say otherwise: the generation config's EOS list, else
        the model config's, else the tokenizer's EOS, else none."""

    @property
    def supports_streaming(self) -> bool:
        """`submit(..., on_tokens=fn)` streams each row's tokens as they are sampled (a worker); False: rows arrive
        as their group finishes (`as_completed`, a fleet)."""

    @property
    def model_name(self) -> str:
        """What the model is called to clients (`model_name(config.name_or_path)`)."""

    @property
    def policy_version(self) -> int:
        """The version of the weights rows are generated with now (set by update_weights)."""

    def generate(self, prompts: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat_template: bool = False, timeout: float | None = None, env: EnvFactory | None = None,
                 max_turns: int = 1, max_episode_tokens: int | None = None,
                 env_timeout: float | None = 300.0, episode: EpisodeSpec | None = None) -> RolloutBatch:
        """Every sample of every prompt, rows prompt-major; the whole call is validated before any work. With
        `episode` (or its fields as keywords: env, max_turns, ...), every sample is a multi-turn episode
        (docs/episodes.md)."""

    def submit(self, prompts: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
               chat_template: bool = False, env: EnvFactory | None = None, max_turns: int = 1,
               max_episode_tokens: int | None = None, env_timeout: float | None = 300.0,
               episode: EpisodeSpec | None = None) -> RolloutsFuture:
        """`generate`, returning at once a future (`done()`, `result(timeout)`, `cancel()`; docs/async.md) whose
        `as_completed(timeout)` yields each prompt's group as a RolloutBatch as soon as it finishes (docs/collector.md:
        what `rollout.RolloutCollector` builds on)."""

    def update_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None, full: bool = False, in_flight: str | None = None) -> int:
        """New weights, validated then applied atomically; returns the new version. `in_flight` says what happens
        to calls in flight: "wait", "abort", "recompute" or "keep"."""

    def weights_fingerprint(self) -> str:
        """A short hash of the weights held, equal to `rollout.model.weights.fingerprint` of the same weights."""

    def score(self, prompts: Sequence[Any], completions: Sequence[Any], temperature: Any = 1.0,
              **kwargs: Any) -> list[torch.Tensor]:
        """Teacher-forced logprobs of stored completions with the rollout side's weights (see rollout.scoring)."""

    def metrics(self) -> Any:
        """A snapshot of counters and gauges (rollout.metrics: WorkerMetrics, or a fleet's FleetMetrics with its
        totals); names, units and meanings in docs/observability.md."""

    def serve_metrics(self, port: int, host: str = "127.0.0.1") -> Any:
        """Serve `metrics()` for Prometheus on http://host:port/metrics (rollout.metrics.prometheus.MetricsServer)."""

    def close(self) -> None:
        """Stop the engine(s); the object is unusable afterwards."""
