"""The step both trainers share: generate -> reward -> update -> push weights, with the per-step metrics.

A trainer subclasses `RolloutLoop` and implements `_update(batch, rewards, ref) -> dict of stats`; the loop owns
the prompt stream, the rollout side's versioning (rollout versions continue from the worker's at construction),
the timing and the metrics every step logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from rollout import EpisodeSpec, RolloutBatch, Rollouts

from .config import RolloutTrainerConfig
from .rollouts import (PromptsExhausted, prompt_stream, push_weights, reference_logprobs, rewards_tensor,
                       shares_model, timed_generate)


class RolloutLoop:
    model: torch.nn.Module
    rollouts: Rollouts
    reward_fn: Callable | None
    ref_model: torch.nn.Module | None
    config: RolloutTrainerConfig

    def _start_loop(self, prompts, episodes: EpisodeSpec | None = None) -> None:
        self.episodes = episodes
        self._prompts = prompt_stream(prompts)
        self.num_steps = 0
        self.history: list[dict[str, float]] = []
        self.base_version = int(getattr(self.rollouts, "policy_version", 0))  # rollout versions continue from here
        if not shares_model(self.rollouts, self.model):  # an own copy or a fleet: start from the policy's weights
            push_weights(self.rollouts, self.model, version=self.base_version)

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
        batch, rollout_s = timed_generate(self.rollouts, self._prompts(self.num_steps), cfg.sampling(),
                                          cfg.chat_template, self.episodes)
        rewards = rewards_tensor(self.reward_fn(batch) if self.reward_fn is not None else batch.rewards, len(batch))
        ref = reference_logprobs(self.ref_model, batch, cfg.temperature) if self.ref_model is not None else None
        train_start = time.perf_counter()
        stats = self._update(batch, rewards, ref)
        train_s = time.perf_counter() - train_start
        self.num_steps += 1
        refresh_s = push_weights(self.rollouts, self.model, version=self.base_version + self.num_steps)
        metrics = {
            "step": self.num_steps, "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0, **stats,
            "completion_len": float(batch.completion_lengths.float().mean()),
            "num_turns": float(batch.num_turns.float().mean()),
            "episode_errors": float(sum(1 for e in batch.errors if e)),
            "rollout_tokens": batch.num_tokens, "rollout_tokens_per_s": batch.num_tokens / max(rollout_s, 1e-9),
            "rollout_s": rollout_s, "train_s": train_s, "refresh_s": refresh_s,
            "staleness": float(self.base_version + self.num_steps - 1 - int(batch.policy_version.min())),
            "step_s": time.perf_counter() - start,
        }
        self.history.append(metrics)
        return metrics

    def _update(self, batch: RolloutBatch, rewards: torch.Tensor, ref: torch.Tensor | None) -> dict[str, float]:
        raise NotImplementedError
