"""Pure functions of the policy-gradient losses: advantages, GAE, clipped losses, KL estimators, masks.

Shapes: R rows (one per completion), T completion positions, right-padded; `mask` (R, T) is True on the tokens
the loss covers: the model's own tokens (`RolloutBatch.action_mask`), so the observation tokens of multi-turn
episodes are holes inside a row, and padding follows the row. An episode whose environment restarted it from a new
context has several rows (segments, `RolloutBatch.episode_index`); the functions taking `episode_index` treat its
rows as one episode.
Every function is a plain tensor function (no model, no rollout object), so each is tested against values worked
out by hand in tests/test_trainers.py. Masked positions never contribute, whatever they hold.
"""

from __future__ import annotations

import torch

LOSS_NORMS = ("token", "sequence")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum() if dim is None else \
        torch.where(mask, x, torch.zeros_like(x)).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the masked-in entries (0 where there are none)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked-in entries (population std); masked-out entries become 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + eps), torch.zeros_like(x))


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std when `scale`.

    rewards: (R,) prompt-major, R = num_prompts * group_size (the rows of one prompt are consecutive). The std is
    the sample std (Bessel-corrected, as in the GRPO paper and TRL); a group whose rewards are all equal gets 0.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}: must be (num_prompts * {group_size},). Fix: "
                         "pass one reward per row of the RolloutBatch, rows prompt-major.")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.view(-1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, norm: str = "token") -> torch.Tensor:
    """Reduce a (R, T) per-token loss to a scalar.

    "token": sum over every real token of the batch / their count (each token weighs the same; DAPO, Dr. GRPO).
    "sequence": mean over rows of each row's token mean (each completion weighs the same; the GRPO paper).
    """
    if norm == "token":
        return masked_mean(per_token, mask)
    if norm == "sequence":
        return masked_mean(per_token, mask, dim=1).mean()
    raise ValueError(f"loss_norm={norm!r} is invalid: must be one of {LOSS_NORMS}. Fix: pick one of those.")


def row_weights(mask: torch.Tensor, norm: str = "token", episode_index: torch.Tensor | None = None) -> torch.Tensor:
    """(R,) the weight of each masked-in token of each row, so that `masked_sum(per_token * w[:, None], mask)` is
    the batch's loss, whichever rows a micro-batch holds.

    "token": 1 / (real tokens of the batch): `aggregate(..., "token")`.
    "sequence": 1 / (tokens of the row's episode * number of episodes): each episode weighs the same, however many
    rows (segments) it has; with one row per episode, `aggregate(..., "sequence")`.
    """
    if norm == "token":
        return torch.full((mask.shape[0],), 1.0 / max(int(mask.sum()), 1), device=mask.device)
    if norm != "sequence":
        raise ValueError(f"loss_norm={norm!r} is invalid: must be one of {LOSS_NORMS}. Fix: pick one of those.")
    if episode_index is None:
        episode_index = torch.arange(mask.shape[0], device=mask.device)
    episode_index = episode_index.to(mask.device)
    num_episodes = int(episode_index.max()) + 1 if len(episode_index) else 1
    tokens = torch.zeros(num_episodes, device=mask.device).index_add_(0, episode_index, mask.sum(dim=1).float())
    return 1.0 / (tokens[episode_index].clamp(min=1) * num_episodes)


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token: -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A).

    logprobs: (R, T) under the policy being trained (with grad); old_logprobs: (R, T) of the behaviour policy;
    advantages: (R,) per row or (R, T) per token. Returns (per-token loss, per-token bool "the clip was active").
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimator of KL(policy || reference) from samples of the policy (Schulman's k3):
    exp(ref - logp) - (ref - logp) - 1. Non-negative, 0 where the two agree, unbiased in expectation."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def truncated_is_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al., 2025): min(pi_trainer(token) / pi_rollout(token), cap), per token,
    no gradient. Corrects for rollouts sampled by a stale or numerically different policy."""
    return torch.exp(trainer_logprobs.detach() - rollout_logprobs).clamp(max=cap)


def kl_shaped_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
                      mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """PPO-RLHF token rewards: -kl_coef * (logp - ref_logp) on every token, plus the scalar score on each row's last
    masked-in token. scores: (R,); logprobs, ref_logprobs, mask: (R, T). Returns (R, T), 0 where mask is False."""
    rewards = torch.zeros_like(logprobs)
    if ref_logprobs is not None and kl_coef:
        rewards = -kl_coef * (logprobs - ref_logprobs)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1).clamp(min=0)
    rewards = rewards.clone()
    rewards[torch.arange(len(scores)), last] += scores.to(rewards.dtype)
    return torch.where(mask, rewards, torch.zeros_like(rewards))


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's masked-in tokens; the state after the last one is terminal.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token = 0), A_t = delta_t + gamma * lam * A_{t+1}, where
    t+1 is the row's next masked-in token: masked-out tokens inside a row (an episode's observations) are part of
    the environment's transition, skipped rather than treated as the end of the row. Returns (advantages,
    returns = advantages + values), both (R, T), 0 where mask is False.
    """
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    values = torch.where(mask, values, torch.zeros_like(values))
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        live = mask[:, t]
        running = torch.where(live, delta + gamma * lam * running, running)  # masked-out: carried across
        advantages[:, t] = torch.where(live, running, torch.zeros_like(running))
        next_value = torch.where(live, values[:, t], next_value)
    return advantages, torch.where(mask, advantages + values, torch.zeros_like(values))


def gae_over_episodes(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      episode_index: torch.Tensor | None = None, gamma: float = 1.0,
                      lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """`gae` with an episode's rows (its segments, in order) as one sequence: a segment's last token is followed by
    the next segment's first model token (the episode goes on; its value is that token's value under the new
    context), and only the episode's last token is terminal. Without `episode_index` (or one row per episode), `gae`.
    """
    if episode_index is None or len(episode_index) == 0 or int(episode_index.max()) + 1 == len(episode_index):
        return gae(rewards, values, mask, gamma, lam)
    episode_index = episode_index.to(mask.device)
    rows_of = [torch.nonzero(episode_index == e).flatten() for e in range(int(episode_index.max()) + 1)]
    width = max(len(rows) for rows in rows_of) * mask.shape[1]

    def joined(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(x[rows].reshape(-1), (0, width - len(rows) * x.shape[1]))
                            for rows in rows_of])

    advantages, returns = gae(joined(rewards), joined(values), joined(mask), gamma, lam)
    out_adv, out_ret = torch.zeros_like(rewards), torch.zeros_like(values)
    for e, rows in enumerate(rows_of):
        size = len(rows) * mask.shape[1]
        out_adv[rows] = advantages[e, :size].view(len(rows), -1)
        out_ret[rows] = returns[e, :size].view(len(rows), -1)
    return out_adv, out_ret


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss, per token: 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).
    Returns (per-token loss, per-token bool "the clipped branch was the larger")."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(loss_unclipped, loss_clipped), loss_clipped > loss_unclipped
