"""Trainers on the rollout engine: GRPO, PPO, and a TRL adapter. Depends on `rollout`; `rollout` never imports this.

    from trainers_integration import GRPOTrainer, GRPOConfig
    trainer = GRPOTrainer(policy, optimizer, reward_fn, prompts, rollouts=RolloutWorker(policy, ...))

`trainers_integration.trl` (TRL's GRPOTrainer on this engine) imports TRL only when used.
`trainers_integration.trl_async` (TRL's experimental AsyncGRPOTrainer on this engine: its RolloutWorkerProtocol and
WeightTransferProtocol) imports TRL when an AsyncRollouts is built.
`trainers_integration.openrlhf` (OpenRLHF's vLLM Ray actor surface over a RolloutWorker) imports OpenRLHF only for its
default agent executor.
"""

from .config import RolloutTrainerConfig
from .grpo import GRPOConfig, GRPOTrainer
from .ppo import PPOConfig, PPOTrainer
from .value import CriticModel, ValueHead

__all__ = ["CriticModel", "GRPOConfig", "GRPOTrainer", "PPOConfig", "PPOTrainer", "RolloutTrainerConfig", "ValueHead"]
