"""What a trainer's step logs besides its loss, and where: the rollout side's metrics, the figures that need both
sides, and accelerate's trackers.

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs")   # wandb / trackio when installed
    accelerator.init_trackers("grpo")
    trainer = GRPOTrainer(..., tracker=accelerator)     # every step: accelerator.log(metrics, step=step)

- `rollout_metrics(rollouts)`: the rollout side's snapshot (`rollouts.metrics()`: a worker's or a fleet's totals),
  flattened under `rollout/...` keys (rollout/metrics/snapshot.py names them; docs/observability.md lists them).
- `offpolicy_split`: over the batch's action tokens, mean |trainer logprob - behaviour logprob| for tokens made by
  the version the trainer holds (`offpolicy/gap_current`: numerics alone, ~1e-6 in fp32 here) and for tokens made
  by older versions (`offpolicy/gap_stale`: staleness plus numerics), and the older tokens' share. This engine's
  logprobs are exact, so the split tells a staleness problem from a numerics one token by token.
- `zero_variance_fraction`: the share of prompt groups whose samples all got the same reward (no GRPO signal).
- `make_tracker`: an Accelerator with one tracker (TensorBoard by default) and the run initialised, for scripts that
  have no Accelerator of their own (the demo).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rollout import Rollouts

NAN = float("nan")


def rollout_metrics(rollouts: Rollouts, prefix: str = "rollout/") -> dict[str, float]:
    """The rollout side's metrics, flattened."""
    return rollouts.metrics().flat(prefix)


def offpolicy_split(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                    token_versions: torch.Tensor, version: int) -> dict[str, float]:
    """(R, T) logprobs of the trainer (at the step's start) and of the behaviour policy (the rollout's), the action
    mask and each token's version; `version`: the one the trainer holds. NaN where there is no such token."""
    device = trainer_logprobs.device
    gap = (trainer_logprobs.detach().float() - behaviour_logprobs.to(device).float()).abs()
    mask, versions = mask.to(device), token_versions.to(device)
    current, stale = mask & (versions == version), mask & (versions >= 0) & (versions < version)
    num_tokens = int(mask.sum())
    return {"offpolicy/gap_current": _mean(gap, current), "offpolicy/gap_stale": _mean(gap, stale),
            "offpolicy/stale_token_fraction": int(stale.sum()) / num_tokens if num_tokens else NAN}


def _mean(values: torch.Tensor, where: torch.Tensor) -> float:
    picked = values[where]
    return float(picked.mean()) if picked.numel() else NAN


def zero_variance_fraction(rewards: torch.Tensor, prompt_index: torch.Tensor) -> float:
    """The share of prompts (with 2+ samples) whose samples' rewards are all equal; NaN when no prompt has 2+."""
    groups: dict[int, list[float]] = {}
    for reward, prompt in zip(rewards.tolist(), prompt_index.tolist()):
        groups.setdefault(prompt, []).append(reward)
    sized = [g for g in groups.values() if len(g) > 1]
    return sum(max(g) == min(g) for g in sized) / len(sized) if sized else NAN


def loggable(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a step's metrics (a tracker takes scalars; NaN is kept: 'no such token this step')."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def make_tracker(log_dir: str | Path, run_name: str, log_with: str = "tensorboard", config: dict | None = None):
    """An `accelerate.Accelerator` logging to `log_with` under `log_dir/run_name`, its run initialised (with
    `config` as hyperparameters). Call `.end_training()` when done."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with=log_with, project_dir=str(log_dir))
    accelerator.init_trackers(run_name, config={k: v for k, v in (config or {}).items()
                                                if isinstance(v, (int, float, str, bool))})
    return accelerator


def tracker_missing(log_with: str) -> str:
    """What is missing to log with accelerate's `log_with` tracker ("" when nothing is)."""
    import importlib.util

    needed = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}.get(log_with, log_with)
    absent = [name for name in ("accelerate", needed) if importlib.util.find_spec(name) is None]
    return f"{' and '.join(absent)} not installed" if absent else ""
