"""The step both trainers share: generate -> reward -> update -> push weights, with the per-step metrics.

A trainer subclasses `RolloutLoop` and implements `_update(batch, rewards, ref) -> dict of stats` (`rewards`: one per
episode, `batch.episode_index` maps rows to them: an episode has several rows when its environment restarted it from
a new context); the loop owns
the prompt stream, the rollout side's versioning (rollout versions continue from the worker's at construction),
the timing and the metrics every step logs: its own, the rollout side's (`rollout/...`), the share of zero-variance
groups, and the trainer's `offpolicy/...` split (tracking.py); with a `tracker` (an `accelerate.Accelerator` built
with `log_with=...`, or any object with `log(values, step=)`) each step's numbers go to it. With
`config.async_rollouts` the rollouts come from a `Pipeline` (pipeline.py): submitted ahead, overlapping training, at
most `max_staleness` versions old. With GRPO's
`dynamic_sampling` / `partial_rollouts` they come from a `rollout.RolloutCollector` fed by the prompt lists of the
steps one after another: each step takes as many accepted groups as a step's prompt list holds, rewarded by
`reward_fn` as each group finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rollout import EpisodeSpec, RolloutBatch, RolloutCollector, Rollouts, nonzero_std
from rollout.base import rewards_tensor

from .config import RolloutTrainerConfig
from .pipeline import Pipeline, staleness
from .rollouts import (PromptsExhausted, episode_rewards, episode_starts, flat_prompts, prompt_stream, push_weights,
                       reference_logprobs, shares_model, timed_generate)
from .tracking import loggable, rollout_metrics, zero_variance_fraction


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
        self.base_version = int(self.rollouts.policy_version)  # rollout versions continue from here
        self.step_version = self.base_version  # the version the trainer holds during a step's update
        shared = shares_model(self.rollouts, self.model)
        for flag in ("async_rollouts", "partial_rollouts"):
            if getattr(self.config, flag, False) and shared:
                raise ValueError(f"{flag}=True is invalid with a RolloutWorker that shares the policy in place: "
                                 "training would change the weights under the rollouts in flight. Fix: give the "
                                 "rollout side its own copy (RolloutWorker(checkpoint_path) or a RolloutFleet), or "
                                 f"use {flag}=False.")
        if not shared:  # an own copy or a fleet: start from the policy's weights
            push_weights(self.rollouts, self.model, version=self.base_version)
        self.pipeline = None if not self.config.async_rollouts else Pipeline(
            self.rollouts, self._prompts, self.config.sampling(), self.config.chat_template, episodes,
            self.config.max_staleness)
        self.collector = self._collector(episodes) if getattr(self.config, "uses_collector", False) else None

    def _collector(self, episodes: EpisodeSpec | None) -> RolloutCollector:
        cfg = self.config
        self.groups_per_step, prompts = flat_prompts(self._prompts)
        return RolloutCollector(self.rollouts, prompts, cfg.sampling(), reward_fn=self.reward_fn,
                                accept=nonzero_std if cfg.dynamic_sampling else None, over_sample=cfg.over_sample,
                                partial=cfg.partial_rollouts, max_staleness=cfg.max_staleness,
                                chat_template=cfg.chat_template, **(episodes.kwargs() if episodes else {}))

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
        if self.collector is not None:  # rewarded as each group finished; filtered, carried across steps
            batch = self.collector.next_batch(self.groups_per_step)
            rollout_s = time.perf_counter() - start
            rewards = batch.rewards
        else:
            if self.pipeline is None:
                batch, rollout_s = timed_generate(self.rollouts, self._prompts(self.num_steps), cfg.sampling(),
                                                  cfg.chat_template, self.episodes)
            else:
                batch = self.pipeline.batch(self.num_steps, version)
                rollout_s = time.perf_counter() - start  # what the step waited for: the rest overlapped training
            rewards = rewards_tensor(self.reward_fn(batch) if self.reward_fn is not None else batch.rewards,
                                     len(batch))
        return self._learn(batch, rewards, start, rollout_s, version)

    def learn(self, batch: RolloutBatch, rewards, rollout_s: float = 0.0) -> dict[str, float]:
        """One step on a batch generated elsewhere: the update, then the new weights pushed to the rollout side
        (what `step` does after it generated). For rollouts an outside harness drove, e.g. agent episodes run through
        `rollout.serve` and taken with `server.take_episode(ids)`: rows grouped as the trainer expects (GRPO:
        `num_generations` consecutive rows per group), `rewards` one float per row (the same on an episode's rows)."""
        start = time.perf_counter()
        if self.pipeline is not None:
            raise ValueError("learn() is invalid with async_rollouts=True: that loop generates its own batches "
                             "ahead. Fix: use async_rollouts=False to train on batches generated elsewhere.")
        if self.collector is not None:
            raise ValueError("learn() is invalid with dynamic_sampling, over_sample or partial_rollouts: that loop's "
                             "collector generates its own groups. Fix: turn those off to train on batches generated "
                             "elsewhere.")
        return self._learn(batch, rewards_tensor(rewards, len(batch)), start, rollout_s,
                           self.base_version + self.num_steps)

    def _learn(self, batch: RolloutBatch, rewards: torch.Tensor, start: float, rollout_s: float,
               version: int) -> dict[str, float]:
        cfg = self.config
        rewards = episode_rewards(rewards, batch)  # one per episode (an episode has a row per segment)
        ref = reference_logprobs(self.ref_model, batch, cfg.temperature) if self.ref_model is not None else None
        first = episode_starts(batch.episode_index)
        zero_variance = zero_variance_fraction(rewards, batch.prompt_index[first])  # of the batch's own groups
        train_start = time.perf_counter()
        self.step_version = version  # tokens of older versions are stale
        stats = self._update(batch, rewards, ref)
        train_s = time.perf_counter() - train_start
        self.num_steps += 1
        overlapped = self.pipeline is not None or getattr(cfg, "partial_rollouts", False)
        refresh_s = push_weights(self.rollouts, self.model, version=self.base_version + self.num_steps,
                                 in_flight=cfg.in_flight if overlapped else None)
        metrics = {
            "step": self.num_steps, "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0, **stats,
            "completion_len": float(batch.completion_lengths.float().mean()),
            "num_turns": float(batch.num_turns[first].float().mean()),
            "segments": len(batch) / max(len(rewards), 1),  # rows per episode (> 1: histories rewritten)
            "episode_errors": float(sum(1 for e, f in zip(batch.errors, first.tolist()) if e and f)),
            "rollout_tokens": batch.num_tokens, "rollout_tokens_per_s": batch.num_tokens / max(rollout_s, 1e-9),
            "rollout_s": rollout_s, "train_s": train_s, "refresh_s": refresh_s,
            "staleness": float(staleness(batch, version)),
            "dropped_batches": float(self.pipeline.num_dropped if self.pipeline is not None else 0),
            "zero_variance_frac": self._zero_variance(batch, zero_variance),
            **self._collector_metrics(batch),
            "step_s": time.perf_counter() - start,
            "zero_variance_groups": zero_variance,
            **rollout_metrics(self.rollouts),
        }
        self.history.append(metrics)
        if self.tracker is not None:
            self.tracker.log(loggable(metrics), step=self.num_steps)
        return metrics

    def _zero_variance(self, batch: RolloutBatch, of_batch: float) -> float:
        """The fraction of the step's finished groups whose rewards were all equal: with dynamic sampling, of every
        group the collector judged (the batch holds only the others); otherwise of the batch's own groups."""
        stats = batch.stats
        if self.collector is not None and getattr(self.config, "dynamic_sampling", False):
            judged = stats["accepted_groups"] + stats["rejected_groups"]
            return stats["rejected_groups"] / judged if judged else 0.0
        return of_batch

    def _collector_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        if self.collector is None:
            return {}
        names = ("accepted_groups", "rejected_groups", "failed_groups", "carried_rows", "aborted_rows",
                 "over_generated_tokens", "prompts_exhausted")
        return {name: float(batch.stats[name]) for name in names}

    def close(self) -> None:
        """Cancel the rollouts an asynchronous loop submitted ahead or a collector holds (a no-op for a synchronous
        one)."""
        if self.pipeline is not None:
            self.pipeline.close()
        if self.collector is not None:
            self.collector.close()

    def _update(self, batch: RolloutBatch, rewards: torch.Tensor, ref: torch.Tensor | None) -> dict[str, float]:
        raise NotImplementedError
