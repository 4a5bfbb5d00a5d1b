"""PPO on the rollout engine: generate -> score -> KL-shaped token rewards -> GAE -> clipped policy + value update.

    head = ValueHead.for_model(policy)                       # or CriticModel(copy_of_policy)
    optimizer = torch.optim.AdamW([*policy.parameters(), *head.parameters()], lr=1e-5)
    trainer = PPOTrainer(policy, head, optimizer, reward_fn, prompts, rollouts, PPOConfig(), ref_model=ref)
    metrics = trainer.step()

Contract of one step:
1. `rollouts.generate` (same API as GRPO); `reward_fn(batch) -> R` scalar scores, one per completion (equal on the
   rows of one episode).
2. Old values (no grad) from the value model; token rewards = -kl_coef * (logp_rollout - logp_ref) on every token
   plus the score on the episode's last model token (`losses.kl_shaped_rewards`), or, trained on the environments'
   rewards (reward_fn None), each turn's reward on that turn's last model token (`batch.turn_rewards`); advantages
   and returns by GAE over each episode's rows in order (its segments: `losses.gae_over_episodes`), advantages
   whitened over the batch.
3. `num_epochs` optimizer steps over the batch: clipped ratio against the rollout's logprobs (the behaviour
   policy, `rollouts.behaviour_logprobs`, as GRPO) plus `vf_coef` times the clipped value loss.
4. The rollout side gets the new policy weights (`refresh()` in place, else `update_weights`); the value model
   never leaves the trainer.

Logged per step: as GRPO (reward, KL to the reference, clip fraction, rollout tokens/s and times, logprob gap on
the first epoch, its off-policy split, the rollout side's metrics), plus value loss and value clip fraction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollout import EpisodeSpec, RolloutBatch, Rollouts

from . import losses
from .config import RolloutTrainerConfig
from .forward import Packed, completion_logprobs, pack, replayed
from .loop import RolloutLoop
from .grpo import RewardFn, clip_grad_norm
from .rollouts import behaviour_logprobs, logprob_gap, pad_token_id
from .tracking import offpolicy_split
from .value import ValueHead


@dataclass(frozen=True, kw_only=True)
class PPOConfig(RolloutTrainerConfig):
    """The shared fields (RolloutTrainerConfig), here with num_generations = 1 and num_epochs = 4, plus:
    value_clip: how far a value may move from its old estimate before the clipped loss takes over. vf_coef: weight
    of the value loss. kl_coef: weight of the per-token KL penalty folded into the rewards (needs ref_model; the KL
    is logged whenever a ref_model is given). gamma, lam: GAE discount and trace decay. whiten_advantages: normalise
    advantages over the batch.
    """

    num_generations: int = 1
    num_epochs: int = 4
    value_clip: float = 0.2
    vf_coef: float = 0.5
    kl_coef: float = 0.05
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be in [0, 1]. Fix: use e.g. 1.0 "
                                 "for gamma, 0.95 for lam.")
        if self.value_clip <= 0 or self.vf_coef < 0 or self.kl_coef < 0:
            raise ValueError("value_clip must be > 0, vf_coef and kl_coef >= 0. Fix: use e.g. value_clip=0.2, "
                             "vf_coef=0.5, kl_coef=0.05.")


class PPOTrainer(RolloutLoop):
    """PPO over a `rollouts` object. value_model: a `ValueHead` on the policy's hidden states, or a critic module
    mapping a `Packed` batch to (R, T) values (e.g. `CriticModel`). The optimizer must cover the policy and the
    value model. `episodes` as in GRPOTrainer: GAE runs over the model's tokens, observations skipped. `tracker` as
    in GRPOTrainer: where each step's metrics are logged."""

    def __init__(self, model: torch.nn.Module, value_model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 reward_fn: RewardFn | None, prompts, rollouts: Rollouts, config: PPOConfig | None = None,
                 ref_model: torch.nn.Module | None = None, episodes: EpisodeSpec | None = None,
                 tracker: Any = None) -> None:
        self.model, self.value_model, self.optimizer = model, value_model, optimizer
        self.reward_fn, self.rollouts = reward_fn, rollouts
        self.config = config if config is not None else PPOConfig()
        self.ref_model = ref_model
        self._check_optimizer()
        self._start_loop(prompts, episodes, tracker)

    def _check_optimizer(self) -> None:
        covered = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        for name, module in (("model", self.model), ("value_model", self.value_model)):
            trainable = [p for p in module.parameters() if p.requires_grad]
            if trainable and not any(id(p) in covered for p in trainable):
                raise ValueError(f"the optimizer holds none of {name}'s parameters. Fix: build it over both, e.g. "
                                 "AdamW([*policy.parameters(), *value_model.parameters()]).")

    def _forward(self, packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, values), both (R, T): one policy forward for a ValueHead, policy + critic otherwise."""
        head = isinstance(self.value_model, ValueHead)
        logp, hidden = completion_logprobs(self.model, packed, self.config.temperature, return_hidden=head)
        values = self.value_model(hidden) if head else self.value_model(packed)
        return logp, values.float()

    def _update(self, batch: RolloutBatch, scores: torch.Tensor, ref: torch.Tensor | None) -> dict[str, float]:
        cfg, device = self.config, self.device
        mask = batch.action_mask.to(device)  # the model's own tokens: episodes' observations are not trained on
        rollout_lp = behaviour_logprobs(batch).to(device)
        ref = ref.to(device) if ref is not None else None
        num_tokens, num_rows = int(mask.sum()), len(batch)
        size = cfg.micro_batch_size or num_rows
        pad = pad_token_id(self.rollouts)
        packs = [(rows, pack(batch.prompt_ids[rows], batch.completion_ids[rows], batch.completion_mask[rows], pad,
                             device)) for rows in (slice(i, min(i + size, num_rows)) for i in range(0, num_rows, size))]
        self.model.eval()
        self.value_model.eval()
        with torch.no_grad():
            old_values = []
            for rows, packed in packs:
                with replayed(self.model, batch, rows, cfg.routing_replay):
                    old_values.append(self._old_values(packed))
            old_values = torch.cat(old_values)
        rewards = self._token_rewards(batch, scores.to(device), rollout_lp, ref, mask)
        advantages, returns = losses.gae_over_episodes(rewards, old_values, mask, batch.episode_index.to(device),
                                                       cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = losses.masked_whiten(advantages, mask)
        totals = dict(loss=0.0, pg_loss=0.0, value_loss=0.0, clip=0.0, vclip=0.0, grad_norm=0.0)
        gap_max, gap_sum = 0.0, 0.0
        first_lp = torch.zeros_like(rollout_lp)  # the trainer's logprobs at the start of the step (epoch 0)
        self.model.train()
        self.value_model.train()
        for epoch in range(cfg.num_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for rows, packed in packs:
                with replayed(self.model, batch, rows, cfg.routing_replay):
                    logp, values = self._forward(packed)
                m = mask[rows]
                if epoch == 0:
                    g_max, g_mean = logprob_gap(logp, rollout_lp[rows], m)
                    gap_max, gap_sum = max(gap_max, g_max), gap_sum + g_mean * int(m.sum())
                    first_lp[rows] = logp.detach()
                pg, clipped = losses.clipped_policy_loss(logp, rollout_lp[rows], advantages[rows], cfg.clip_low,
                                                         cfg.clip_high)
                vf, vclipped = losses.clipped_value_loss(values, old_values[rows], returns[rows], cfg.value_clip)
                share = int(m.sum()) / num_tokens
                pg_loss = losses.masked_mean(pg, m) * share
                value_loss = losses.masked_mean(vf, m) * share
                loss = pg_loss + cfg.vf_coef * value_loss
                loss.backward()
                for key, value in (("loss", loss), ("pg_loss", pg_loss), ("value_loss", value_loss)):
                    totals[key] += float(value.detach()) / cfg.num_epochs
                totals["clip"] += float(losses.masked_sum(clipped.float(), m)) / num_tokens / cfg.num_epochs
                totals["vclip"] += float(losses.masked_sum(vclipped.float(), m)) / num_tokens / cfg.num_epochs
            params = torch.nn.ModuleList([self.model, self.value_model])
            totals["grad_norm"] += clip_grad_norm(params, cfg.max_grad_norm) / cfg.num_epochs
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        kl = float(losses.masked_mean(losses.k3_kl(rollout_lp, ref), mask)) if ref is not None else float("nan")
        return {"loss": totals["loss"], "pg_loss": totals["pg_loss"], "value_loss": totals["value_loss"],
                "kl": kl, "clip_frac": totals["clip"], "value_clip_frac": totals["vclip"],
                "grad_norm": totals["grad_norm"], "value_mean": float(losses.masked_mean(old_values, mask)),
                "logprob_gap_max": gap_max, "logprob_gap_mean": gap_sum / max(num_tokens, 1),
                **offpolicy_split(first_lp, rollout_lp, mask, batch.token_versions, self.step_version)}

    def _token_rewards(self, batch: RolloutBatch, scores: torch.Tensor, rollout_lp: torch.Tensor,
                       ref: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """KL-shaped token rewards. Trained on the environments' rewards (no reward_fn): each turn's reward on that
        turn's last model token (`batch.turn_rewards`). Otherwise each episode's score on its last model token (the
        last row of an episode with several segments)."""
        if self.reward_fn is None:
            shaped = losses.kl_shaped_rewards(torch.zeros_like(scores[batch.episode_index]), rollout_lp, ref, mask,
                                              self.config.kl_coef)
            return shaped + torch.where(mask, batch.turn_rewards.to(mask.device), torch.zeros_like(shaped))
        index = batch.episode_index.to(mask.device)
        last = torch.ones(len(index), dtype=torch.bool, device=mask.device)
        last[:-1] = index[1:] != index[:-1]
        return losses.kl_shaped_rewards(torch.where(last, scores[index], torch.zeros_like(scores[index])), rollout_lp,
                                        ref, mask, self.config.kl_coef)

    def _old_values(self, packed: Packed) -> torch.Tensor:
        if isinstance(self.value_model, ValueHead):
            _, hidden = completion_logprobs(self.model, packed, self.config.temperature, return_hidden=True)
            return self.value_model(hidden).float()
        return self.value_model(packed).float()
