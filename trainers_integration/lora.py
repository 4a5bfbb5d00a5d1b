"""LoRA through PEFT for the trainers: one helper that wraps a policy, and what the rest of the path does with it.

    policy = add_lora(policy, rank=8)                    # peft.get_peft_model: frozen base, rank-8 on every projection
    optimizer = torch.optim.AdamW(trainable(policy), lr=...)
    worker = RolloutWorker(policy, WorkerConfig(), tokenizer)       # in place: refresh(), nothing moves
    fleet = RolloutFleet(policy, num_workers=2, tokenizer=tokenizer)  # actors rebuild the same PeftModel
    trainer = GRPOTrainer(policy, optimizer, reward_fn, prompts, worker_or_fleet, config)

After each step the trainers push only the adapter (`get_peft_model_state_dict`, PEFT's own names) to a rollout
side that holds its own copy (`trainers_integration.rollouts.policy_weights`); `rollout.model.weights` maps those names to
the model's. Needs `rollout[peft]`.
"""

from __future__ import annotations

import torch

# every attention and MLP projection of Llama/Qwen2-style models
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora(model: torch.nn.Module, rank: int = 8, alpha: float | None = None,
             target_modules: tuple[str, ...] = PROJECTIONS, seed: int | None = None) -> torch.nn.Module:
    """`peft.get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules, dropout 0))`.
    Dropout is 0 so the trainer's forward is the rollout's forward (the logprob gap stays ~1e-6). `seed`: seeds the
    adapters' initialisation (every process of a multi-process run must build the same adapters)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("LoRA needs PEFT. Fix: pip install 'rollout[peft]'.") from exc
    if seed is not None:
        torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=list(target_modules), lora_dropout=0.0)
    return get_peft_model(model, config)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer should hold (for a PEFT model: the adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


__all__ = ["PROJECTIONS", "add_lora", "trainable"]
