"""What every trainer on the rollout engine is configured with: how to sample, how many optimizer steps per batch, the
clip range and the batch shape. GRPOConfig and PPOConfig add their own fields (and their own defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollout import SamplingParams
from rollout.base import check_in_flight, check_int, invalid


@dataclass(frozen=True, kw_only=True)
class RolloutTrainerConfig:
    """num_generations: samples per prompt. temperature, max_new_tokens, stop_token_ids: sampling (no top-k / top-p:
        the behaviour policy must be the full-vocabulary distribution the trainer recomputes).
    num_epochs: optimizer steps per batch. clip_low, clip_high: ratio clip range [1 - clip_low, 1 + clip_high].
    max_grad_norm: gradient clipping (None: off). micro_batch_size: rows per forward (None: the whole batch).
    chat_template: apply the tokenizer's chat template to text prompts.
    async_rollouts: submit the rollouts of the next `max_staleness` steps before each step trains, so generation
        overlaps training (the rollout side must hold its own weights: a RolloutWorker on a checkpoint, or a fleet).
    max_staleness: how many versions behind the policy a batch's oldest model token may be; an older batch is
        dropped and regenerated (metric `dropped_batches`).
    in_flight: how the weights pushed after a step land on the rollouts in flight (async only): "recompute"
        (default: every token exact under the version that produced it), "keep", "wait" or "abort".
    routing_replay: mixtures of experts: every training forward routes each token to the experts the rollout chose
        (`rollout.replay_routing`, R3; gate weights from the trainer's own router logits). The rollouts must record
        routing (`WorkerConfig(record_routing=True)`); docs/moe.md.
    """

    num_generations: int = 1
    temperature: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] | None = None
    num_epochs: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    max_grad_norm: float | None = 1.0
    micro_batch_size: int | None = None
    chat_template: bool = False
    async_rollouts: bool = False
    max_staleness: int = 1
    in_flight: str = "recompute"
    routing_replay: bool = False

    def __post_init__(self) -> None:
        check_int("num_generations", self.num_generations, 1, "use e.g. 1 or 8")
        check_int("num_epochs", self.num_epochs, 1, "use e.g. 1 or 8")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r} is invalid: training needs sampled rollouts. Fix: "
                             "use a temperature > 0, e.g. 1.0.")
        for name in ("clip_low", "clip_high"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be in [0, 1). Fix: use e.g. 0.2.")
        if self.micro_batch_size is not None:
            check_int("micro_batch_size", self.micro_batch_size, 1, "use None for the whole batch")
        if not isinstance(self.async_rollouts, bool):
            raise invalid("async_rollouts", self.async_rollouts, "must be a bool", "use True or False")
        check_int("max_staleness", self.max_staleness, 1 if self.async_rollouts else 0,
                  "allow at least 1 version of staleness (the rollouts of the next step overlap this one)")
        check_in_flight(self.in_flight)
        if not isinstance(self.routing_replay, bool):
            raise invalid("routing_replay", self.routing_replay, "must be a bool", "use True or False")

    def sampling(self) -> SamplingParams:
        """What every step asks the rollout side for."""
        return SamplingParams(n=self.num_generations, temperature=self.temperature,
                              max_new_tokens=self.max_new_tokens, stop_token_ids=self.stop_token_ids)
