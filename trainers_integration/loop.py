"""The step both trainers share: generate -> reward -> update -> push weights, with the per-step metrics.

A trainer subclasses `RolloutLoop` and implements `_update(batch, rewards, ref) -> dict of stats`; the loop owns
the prompt stream, the rollout side's versioning (rollout versions continue from the worker's at construction),
the timing and the metrics every step logs: its own, the rollout side's (`rollout/...`), the share of zero-variance
groups, and the trainer's `offpolicy/...` split (tracking.py); with a `tracker` (an `accelerate.Accelerator` built
with `log_with=...`, or any object with `log(values, step=)`) each step's numbers go to it. With
`config.async_rollouts` the rollouts come from a `Pipeline` (pipeline.py): submitted ahead, overlapping training, at
most `max_staleness` versions old.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rollout import EpisodeSpec, RolloutBatch, Rollouts

from .config import RolloutTrainerConfig
from .pipeline import Pipeline, staleness
from .tracking import loggable, rollout_metrics, zero_variance_fraction
from .rollouts import (PromptsExhausted, prompt_stream, push_weights, reference_logprobs, rewards_tensor,
                       shares_model, timed_generate)


class RolloutLoop:
    model: torch.nn.Module
    rollouts: Rollouts
    reward_fn: Callable | None
    ref_model: torch.nn.Module | None
    config: RolloutTrainerConfig

    def _start_loop(self, prompts, episodes: EpisodeSpec | None = None, tracker: Any = None) -> None:
        self.episodes = episodes
        self.tracker = tracker
        self._prompts = prompt_stream(prompts)
        self.num_steps = 0
        self.history: list[dict[str, float]] = []
        self.base_version = int(getattr(self.rollouts, "policy_version", 0))  # rollout versions continue from here
        self.step_version = self.base_version  # the version the trainer holds during a step's update
        shared = shares_model(self.rollouts, self.model)
        if self.config.async_rollouts and shared:
            raise ValueError("async_rollouts=True is invalid with a RolloutWorker that shares the policy in place: "
                             "training would change the weights under the rollouts in flight. Fix: give the rollout "
                             "side its own copy (RolloutWorker(checkpoint_path) or a RolloutFleet), or use "
                             "async_rollouts=False.")
        if not shared:  # an own copy or a fleet: start from the policy's weights
            push_weights(self.rollouts, self.model, version=self.base_version)
        self.pipeline = None if not self.config.async_rollouts else Pipeline(
            self.rollouts, self._prompts, self.config.sampling(), self.config.chat_template, episodes,
            self.config.max_staleness)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def train(self, num_steps: int, log: Callable[[dict], None] | None = None) -> list[dict[str, float]]:
        """Up to `num_steps` steps (fewer if an iterable prompt source runs out); returns the history."""
        for _ in range(num_steps):
            try:
                metrics = self.step()
            except PromptsExhausted:  # raised before any work of the step
                break
            if log is not None:
                log(metrics)
        return self.history

    def step(self) -> dict[str, float]:
        cfg = self.config
        if self.reward_fn is None and self.episodes is None:  # checked before anything is generated
            raise ValueError("reward_fn=None is invalid without episodes: there is no reward to train on. Fix: pass "
                             "reward_fn(batch) -> R floats, or episodes=EpisodeSpec(make_env) to use the "
                             "environments' rewards.")
        start = time.perf_counter()
        version = self.base_version + self.num_steps  # of the weights the rollout side holds now
        if self.pipeline is None:
            batch, rollout_s = timed_generate(self.rollouts, self._prompts(self.num_steps), cfg.sampling(),
                                              cfg.chat_template, self.episodes)
        else:
            batch = self.pipeline.batch(self.num_steps, version)
            rollout_s = time.perf_counter() - start  # what the step waited for: the rest overlapped training
        rewards = rewards_tensor(self.reward_fn(batch) if self.reward_fn is not None else batch.rewards, len(batch))
        ref = reference_logprobs(self.ref_model, batch, cfg.temperature) if self.ref_model is not None else None
        train_start = time.perf_counter()
        self.step_version = version  # tokens of older versions are stale
        stats = self._update(batch, rewards, ref)
        train_s = time.perf_counter() - train_start
        self.num_steps += 1
        refresh_s = push_weights(self.rollouts, self.model, version=self.base_version + self.num_steps,
                                 in_flight=cfg.in_flight if self.pipeline is not None else None)
        metrics = {
            "step": self.num_steps, "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0, **stats,
            "completion_len": float(batch.completion_lengths.float().mean()),
            "num_turns": float(batch.num_turns.float().mean()),
            "episode_errors": float(sum(1 for e in batch.errors if e)),
            "rollout_tokens": batch.num_tokens, "rollout_tokens_per_s": batch.num_tokens / max(rollout_s, 1e-9),
            "rollout_s": rollout_s, "train_s": train_s, "refresh_s": refresh_s,
            "staleness": float(staleness(batch, version)),
            "dropped_batches": float(self.pipeline.num_dropped if self.pipeline is not None else 0),
            "step_s": time.perf_counter() - start,
            "zero_variance_groups": zero_variance_fraction(rewards, batch.prompt_index),
            **rollout_metrics(self.rollouts),
        }
        self.history.append(metrics)
        if self.tracker is not None:
            self.tracker.log(loggable(metrics), step=self.num_steps)
        return metrics

    def close(self) -> None:
        """Cancel the rollouts an asynchronous loop submitted ahead (a no-op for a synchronous one)."""
        if self.pipeline is not None:
            self.pipeline.close()

    def _update(self, batch: RolloutBatch, rewards: torch.Tensor, ref: torch.Tensor | None) -> dict[str, float]:
        raise NotImplementedError
