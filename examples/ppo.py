"""PPO with a value head on the policy, through a RolloutWorker that shares the policy in place.

    python examples/ppo.py --steps 20

Token rewards are the task score on the last token minus a per-token KL penalty to the initial policy; advantages
come from GAE over a value head on the policy's last hidden state. Task: reward = number of "7" tokens in the
completion / 4 (the rollout demo's task, less dense). The logprob gap stays ~1e-6: trainer and worker share weights.
"""

import argparse
import copy
import tempfile

import torch

from rollout import RolloutWorker, WorkerConfig
from rollout.testing import build_tiny_model, load_tiny_model
from trainers_integration import PPOConfig, PPOTrainer, ValueHead
from trainers_integration.demo import make_prompts
from trainers_integration.grpo import format_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    policy, tokenizer = load_tiny_model(build_tiny_model(tempfile.mkdtemp() + "/tiny"))
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    value_head = ValueHead.for_model(policy)
    optimizer = torch.optim.AdamW([*policy.parameters(), *value_head.parameters()], lr=5e-3)
    target = tokenizer.convert_tokens_to_ids("7")

    def reward(batch):
        return ((batch.completion_ids == target) & batch.completion_mask).sum(dim=1).float() / 4

    config = PPOConfig(num_generations=4, max_new_tokens=16, num_epochs=2, kl_coef=0.001)
    with RolloutWorker(policy, WorkerConfig(), tokenizer=tokenizer) as worker:
        trainer = PPOTrainer(policy, value_head, optimizer, reward, make_prompts(tokenizer, 16, seed=0), worker,
                             config, ref_model=reference)
        for _ in range(args.steps):
            m = trainer.step()
            print(f"{format_metrics(m)}  value_loss {m['value_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
