"""GRPO on the rollout engine: generate -> reward -> group advantages -> clipped update -> refresh.

    rollouts = RolloutWorker(policy, config, tokenizer)       # shares the policy in place (or a RolloutFleet)
    trainer = GRPOTrainer(policy, optimizer, reward_fn, prompts, rollouts, GRPOConfig(num_generations=8))
    for _ in range(100):
        metrics = trainer.step()

Contract of one step:
1. `rollouts.generate(prompts, SamplingParams(n=num_generations, temperature=T, ...))`; rows come back prompt-major.
2. `reward_fn(batch) -> R floats`; advantages are group-normalised per prompt (`losses.group_advantages`). An
   episode that its environment restarted from a new context has several rows (segments): one reward per episode
   (equal on its rows), one advantage per episode on every row, and the loss weighs the episode once.
3. `num_epochs` passes over the batch, one optimizer step each. The behaviour policy of the clipped ratio is the
   rollout's own per-token logprobs (`rollouts.behaviour_logprobs`: the full-vocabulary log_softmax(logits / T), what
   this trainer's forward recomputes; PPO uses the same), or, with `tis_cap`, the trainer's logprobs at the start of the
   step (the proximal policy) with a truncated importance weight min(pi_proximal / pi_behaviour, tis_cap) per token,
   for rollouts from stale (asynchronous) or numerically different weights.
4. The rollout side gets the new weights: `refresh()` for a worker sharing the policy, `update_weights` otherwise
   (with `async_rollouts`, under `in_flight`, while the next steps' rollouts are still generating).

Logged per step: reward mean/std, KL to the reference (when given), clip fraction, rollout tokens/s, rollout /
train / refresh seconds, and the behaviour/proximal logprob gap on the first epoch (`logprob_gap_*`: ~1e-6 for a
synchronous loop, larger as asynchronous batches grow stale), split by the tokens' versions (`offpolicy/gap_current`
for tokens of the weights the trainer holds: numerics alone; `offpolicy/gap_stale` for older ones), staleness and
dropped batches, the share of zero-variance groups (`zero_variance_groups`), and the rollout side's metrics
(`rollout/...`, docs/observability.md); with `tracker=accelerator`, all of it through accelerate's trackers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rollout import EpisodeSpec, RolloutBatch, Rollouts
from rollout.base import invalid

from . import losses
from .config import RolloutTrainerConfig
from .forward import completion_logprobs, pack, replayed
from .loop import RolloutLoop
from .rollouts import behaviour_logprobs, logprob_gap, pad_token_id
from .tracking import offpolicy_split

RewardFn = Callable[[RolloutBatch], Any]


@dataclass(frozen=True, kw_only=True)
class GRPOConfig(RolloutTrainerConfig):
    """The shared fields (RolloutTrainerConfig: sampling, num_epochs, clip range, max_grad_norm, micro_batch_size,
    chat_template), here with num_generations = 8 (the group) and num_epochs = 1 (more is PPO-style reuse; the clip
    keeps later epochs near the behaviour policy; clip_high > clip_low is DAPO's clip-higher), plus:
    beta: weight of the k3 KL penalty to `ref_model` (the KL is logged whenever a ref_model is given).
    loss_norm: "token" (every token weighs the same) or "sequence" (every completion weighs the same; an episode of
        several rows, its segments, weighs what one completion weighs).
    scale_rewards: divide group-centred rewards by the group std (False: Dr. GRPO).
    tis_cap: None, or the cap of truncated importance sampling against the rollout's logprobs.
    dynamic_sampling: DAPO's filter: a group whose rewards are all equal (zero advantage) is dropped and another
        prompt generated instead, so every step trains on as many groups as its prompt list holds
        (`rollout.RolloutCollector` with accept=nonzero_std; metric `zero_variance_frac`).
    over_sample: groups kept in flight per group still wanted (>= 1; with dynamic_sampling or partial_rollouts).
    partial_rollouts: groups unfinished when a step's batch is complete keep generating and join a later step; the
        weights pushed after each step land on them under `in_flight` ("recompute": every token exact under the
        version that produced it), and no batch holds a token more than `max_staleness` versions old. The rollout
        side must hold its own weights (a RolloutWorker on a checkpoint, or a fleet); use tis_cap as with async.
    """

    num_generations: int = 8
    num_epochs: int = 1
    beta: float = 0.0
    loss_norm: str = "token"
    scale_rewards: bool = True
    tis_cap: float | None = None
    dynamic_sampling: bool = False
    over_sample: float = 1.0
    partial_rollouts: bool = False

    @property
    def uses_collector(self) -> bool:
        return self.dynamic_sampling or self.partial_rollouts

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("dynamic_sampling", "partial_rollouts"):
            if not isinstance(getattr(self, name), bool):
                raise invalid(name, getattr(self, name), "must be a bool", "use True or False")
        if isinstance(self.over_sample, bool) or not isinstance(self.over_sample, (int, float)) or \
                not math.isfinite(self.over_sample) or self.over_sample < 1:
            raise invalid("over_sample", self.over_sample, "must be a number >= 1", "use 1.0, or e.g. 1.5")
        if self.over_sample != 1 and not self.uses_collector:
            raise invalid("over_sample", self.over_sample, "only applies with dynamic_sampling or partial_rollouts",
                          "set dynamic_sampling=True or partial_rollouts=True, or leave over_sample=1.0")
        if self.uses_collector and self.async_rollouts:
            raise invalid("async_rollouts", True, "cannot be combined with dynamic_sampling or partial_rollouts "
                          "(they schedule rollouts differently)", "use partial_rollouts=True for overlap with "
                          "dynamic sampling, or async_rollouts alone")
        if self.loss_norm not in losses.LOSS_NORMS:
            raise ValueError(f"loss_norm={self.loss_norm!r} is invalid: must be one of {losses.LOSS_NORMS}. Fix: "
                             "pick one of those.")
        if self.tis_cap is not None and not self.tis_cap >= 1.0:
            raise ValueError(f"tis_cap={self.tis_cap!r} is invalid: must be >= 1 (or None). Fix: use e.g. 2.0.")


class GRPOTrainer(RolloutLoop):
    """Group-relative policy optimisation over a `rollouts` object (see module docstring).

    model: the policy being trained; optimizer: over its parameters; reward_fn(batch) -> R floats;
    prompts: `step -> list of prompts` or an iterable of per-step prompt lists (token ids, text, or chat messages);
    ref_model: frozen reference for the KL (scored through `rollout.score`);
    tracker: where each step's metrics are logged (`accelerator` built with `log_with=...`; see tracking.py);
    episodes: multi-turn episodes (`rollout.EpisodeSpec(make_env, max_turns=...)`): every sample is an episode, the
    loss covers the model's tokens only (`batch.action_mask`), and reward_fn may be None to train on the
    environments' own rewards (`batch.rewards`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, reward_fn: RewardFn | None, prompts,
                 rollouts: Rollouts, config: GRPOConfig | None = None, ref_model: torch.nn.Module | None = None,
                 episodes: EpisodeSpec | None = None, tracker: Any = None) -> None:
        self.model, self.optimizer, self.reward_fn, self.rollouts = model, optimizer, reward_fn, rollouts
        self.config = config if config is not None else GRPOConfig()
        self.ref_model = ref_model
        if self.config.beta and ref_model is None:
            raise ValueError(f"beta={self.config.beta} needs a reference model. Fix: pass ref_model=... (e.g. a "
                             "frozen copy of the initial policy) or use beta=0.")
        self._start_loop(prompts, episodes, tracker)

    def _update(self, batch: RolloutBatch, rewards: torch.Tensor, ref: torch.Tensor | None) -> dict[str, float]:
        cfg, device = self.config, self.device
        # every row (segment) of an episode gets the episode's advantage
        advantages = losses.group_advantages(rewards, cfg.num_generations, scale=cfg.scale_rewards)[
            batch.episode_index]
        mask = batch.action_mask.to(device)  # the model's own tokens: episodes' observations are not trained on
        weights = losses.row_weights(mask, cfg.loss_norm, batch.episode_index)  # an episode weighs the same, in
        # however many rows
        rollout_lp = behaviour_logprobs(batch).to(device)
        advantages = advantages.to(device)
        ref = ref.to(device) if ref is not None else None
        old_lp = torch.zeros_like(rollout_lp)  # the trainer's logprobs at the start of the step (epoch 0)
        num_tokens, num_rows = int(mask.sum()), len(batch)
        size = cfg.micro_batch_size or num_rows
        chunks = [slice(i, min(i + size, num_rows)) for i in range(0, num_rows, size)]
        pad = pad_token_id(self.rollouts)
        totals = dict(loss=0.0, clip=0.0, kl=0.0, grad_norm=0.0)
        gap_max, gap_sum = 0.0, 0.0
        self.model.train()
        for epoch in range(cfg.num_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for rows in chunks:
                packed = pack(batch.prompt_ids[rows], batch.completion_ids[rows], batch.completion_mask[rows], pad,
                              device)
                with replayed(self.model, batch, rows, cfg.routing_replay):
                    logp, _ = completion_logprobs(self.model, packed, cfg.temperature)
                m = mask[rows]
                if epoch == 0:
                    g_max, g_mean = logprob_gap(logp, rollout_lp[rows], m)
                    gap_max, gap_sum = max(gap_max, g_max), gap_sum + g_mean * int(m.sum())
                    old_lp[rows] = logp.detach()
                behaviour = rollout_lp[rows] if cfg.tis_cap is None else old_lp[rows]
                per_token, clipped = losses.clipped_policy_loss(logp, behaviour, advantages[rows], cfg.clip_low,
                                                                cfg.clip_high)
                if cfg.tis_cap is not None:
                    per_token = per_token * losses.truncated_is_weights(old_lp[rows], rollout_lp[rows], cfg.tis_cap)
                if ref is not None:
                    kl = losses.k3_kl(logp, ref[rows])
                    per_token = per_token + cfg.beta * kl
                    if epoch == 0:  # KL of the policy that sampled the batch, as PPO reports it
                        totals["kl"] += float(losses.masked_sum(kl.detach(), m)) / num_tokens
                loss = losses.masked_sum(per_token * weights[rows, None], m)
                loss.backward()
                totals["loss"] += float(loss.detach()) / cfg.num_epochs
                totals["clip"] += float(losses.masked_sum(clipped.float(), m)) / num_tokens / cfg.num_epochs
            totals["grad_norm"] += clip_grad_norm(self.model, cfg.max_grad_norm) / cfg.num_epochs
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": totals["loss"], "kl": totals["kl"] if ref is not None else float("nan"),
                "clip_frac": totals["clip"], "grad_norm": totals["grad_norm"], "logprob_gap_max": gap_max,
                "logprob_gap_mean": gap_sum / max(num_tokens, 1),  # behaviour vs proximal (the trainer at step start)
                **offpolicy_split(old_lp, rollout_lp, mask, batch.token_versions, self.step_version)}


def clip_grad_norm(model: torch.nn.Module, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm is None:
        return float(torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params])))
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def format_metrics(m: dict[str, float]) -> str:
    """One progress line: what a person watching a run needs."""
    kl = "   n/a " if math.isnan(m.get("kl", float("nan"))) else f"{m['kl']:.4f}"
    return (f"step {m['step']:3d}  reward {m['reward_mean']:.3f} ± {m['reward_std']:.3f}  kl {kl}  "
            f"clip {m['clip_frac']:.3f}  gap {m['logprob_gap_max']:.1e}  "
            f"rollout {m['rollout_tokens_per_s']:.0f} tok/s ({m['rollout_s']:.2f}s)  "
            f"train {m['train_s']:.2f}s  refresh {m['refresh_s'] * 1e3:.1f}ms  "
            f"zero-var {m['zero_variance_frac']:.2f}")


__all__ = ["GRPOConfig", "GRPOTrainer", "clip_grad_norm", "format_metrics"]
