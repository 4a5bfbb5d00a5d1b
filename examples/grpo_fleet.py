"""GRPO with a RolloutFleet: the policy trains here, two Ray actors generate, weights go out after every step.

    python examples/grpo_fleet.py --steps 15

The fleet holds its own copies of the policy, so the trainer sends the state dict (`fleet.update_weights`) after
each optimizer step; the logprob gap column proves every actor sampled from exactly the trained weights.
Same toy task as `rollout demo` (reward = fraction of completion tokens that are "7"). Needs `rollout[ray]`.
"""

import argparse
import tempfile

import torch

from rollout import RolloutFleet, WorkerConfig
from rollout.testing import build_tiny_model, load_tiny_model
from trainers_integration.demo import make_prompts, target_reward
from trainers_integration.grpo import GRPOConfig, GRPOTrainer, format_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    path = build_tiny_model(tempfile.mkdtemp() + "/tiny")
    policy, tokenizer = load_tiny_model(path)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    reward = target_reward(tokenizer.convert_tokens_to_ids("7"))
    with RolloutFleet(path, num_workers=args.workers, config=WorkerConfig()) as fleet:
        trainer = GRPOTrainer(policy, optimizer, reward, make_prompts(tokenizer, 8, seed=0), fleet,
                              GRPOConfig(num_generations=8, max_new_tokens=16))
        trainer.train(args.steps, log=lambda m: print(format_metrics(m), flush=True))
        print(f"fleet version {fleet.policy_version}, fingerprints match: "
              f"{fleet.weights_fingerprint() == _fingerprint(policy)}")


def _fingerprint(model) -> str:
    from rollout.model.weights import fingerprint

    return fingerprint(model)


if __name__ == "__main__":
    main()
