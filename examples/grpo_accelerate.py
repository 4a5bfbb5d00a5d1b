"""GRPO under `accelerate launch`: one trainer per process, the rollouts placed one of three ways.

    accelerate launch --multi_gpu --num_processes 2 examples/grpo_accelerate.py --layout colocated --steps 10
    accelerate launch --multi_gpu --num_processes 2 examples/grpo_accelerate.py --layout sharded --steps 10
    accelerate launch --multi_gpu --num_processes 2 examples/grpo_accelerate.py --layout fleet --steps 10
    ... --lora      # rank-8 LoRA (PEFT) on every projection: only the adapter trains and moves

- colocated (DDP): every rank runs a RolloutWorker in place on its own replica and generates its shard of the
  step's prompts; after the optimizer step, `refresh()`: no weights move.
- sharded (FSDP2): the full state dict is gathered with `accelerator.get_state_dict` on rank 0, whose worker holds
  a full copy and generates every rank's prompts in one call; rows go back to their ranks.
- fleet: rank 0 owns a RolloutFleet (Ray actors); every rank's prompts go in one fleet call, rows back to their
  ranks; rank 0 pushes the weights after each step.

The same command runs without a GPU: the script builds `Accelerator(cpu=True)` there (without it the two processes
would each believe they are alone) and the ranks talk over gloo; the sharded layout then runs torch's FSDP2 on CPU.
Each rank first proves it is in one group (num_processes and an all_reduce of ones). At the end every rank reports
its weights fingerprint (trainer and rollout side), policy_version and worst train/rollout logprob gap, one line per
rank; the script exits 1 unless all agree and every gap is < --max-gap (1e-4). Same toy task as `rollout demo`.

Every step's metrics (the trainer's, the off-policy split, and the rollout side's `rollout/...`: docs/observability.md)
go through accelerate's trackers (`--log-with`, TensorBoard by default, under --out/tensorboard; rank 0 writes).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import os
import signal
import sys
from pathlib import Path

import torch

from rollout import RolloutWorker, WorkerConfig
from rollout.testing import build_tiny_model, load_tiny_model
from trainers_integration.demo import LORA_LR, make_prompts, target_reward
from trainers_integration.distributed import (LAYOUTS, MainProcessRollouts, check_agreement, check_process_group,
                                              format_report, make_accelerator, rank_prompts, rank_report)
from trainers_integration.grpo import GRPOConfig, GRPOTrainer, format_metrics
from trainers_integration.lora import add_lora, trainable
from trainers_integration.tracking import tracker_missing

MAX_GAP = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=LAYOUTS, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: a tiny model built under --out)")
    parser.add_argument("--size", default="tiny", help="size of the built tiny model (rollout.testing.SIZES)")
    parser.add_argument("--out", default="runs/grpo_accelerate")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step, all ranks together")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=None, help=f"AdamW learning rate (default 5e-3, {LORA_LR} with "
                        "--lora)")
    parser.add_argument("--lora", action="store_true", help="train rank-8 LoRA adapters (PEFT) on a frozen base")
    parser.add_argument("--fleet-workers", type=int, default=2, help="actors of the fleet layout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-with", default="tensorboard", help="accelerate tracker for every step's metrics "
                        "(tensorboard, wandb, trackio, ...; 'none' to skip)")
    parser.add_argument("--max-gap", type=float, default=MAX_GAP, help="worst train/rollout logprob gap allowed on "
                        "any rank (the 25m test model's own fp32 noise is ~1e-4: use 1e-3 there)")
    args = parser.parse_args(argv)
    if args.lr is None:
        args.lr = LORA_LR if args.lora else 5e-3
    return args


def say(line: str) -> None:
    """One write per line: the ranks share stdout, and print() would interleave their lines mid-line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def build_rollouts(args, accelerator, policy, rollout_copy, tokenizer):
    rank = accelerator.process_index
    if args.layout == "colocated":
        return RolloutWorker(accelerator.unwrap_model(policy), WorkerConfig(seed=args.seed + rank), tokenizer=tokenizer)
    backend = None
    if rank == 0 and args.layout == "sharded":  # a full copy on rank 0's device, beside its shard
        backend = RolloutWorker(rollout_copy.to(accelerator.device), WorkerConfig(seed=args.seed), tokenizer=tokenizer)
    elif rank == 0:
        from rollout import RolloutFleet

        backend = RolloutFleet(rollout_copy, num_workers=args.fleet_workers, config=WorkerConfig(seed=args.seed),
                               tokenizer=tokenizer)
    return MainProcessRollouts(accelerator, backend, tokenizer)


def main(argv=None) -> None:
    args = parse_args(argv)
    faulthandler.register(signal.SIGTERM, chain=True)  # a rank the launcher has to stop prints where it hung
    log_with = None if args.log_with == "none" or tracker_missing(args.log_with) else args.log_with
    accelerator = make_accelerator(fsdp=args.layout == "sharded", log_with=log_with,
                                   project_dir=str(Path(args.out) / "tensorboard"))
    group = check_process_group(accelerator)
    rank = accelerator.process_index
    say(f"rank {rank}: group of {group['num_processes']} ({group['distributed_type']}, backend {group['backend']}), "
        f"all_reduce(1) = {group['all_reduce']}")

    if args.model is None:
        with accelerator.main_process_first():  # rank 0 builds, the others load what it wrote
            path = build_tiny_model(Path(args.out) / f"model-{args.size}", size=args.size, seed=args.seed)
    else:
        path = args.model
    policy, tokenizer = load_tiny_model(path)
    if args.lora:
        policy = add_lora(policy, rank=8, seed=args.seed)  # same seed on every rank: the same adapters
    # the rollout side's own copy (sharded: rank 0's worker; fleet: shipped to the actors), taken before wrapping
    rollout_copy = copy.deepcopy(policy) if rank == 0 and args.layout != "colocated" else None
    optimizer = torch.optim.AdamW(trainable(policy), lr=args.lr)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    rollouts = build_rollouts(args, accelerator, policy, rollout_copy, tokenizer)

    config = GRPOConfig(num_generations=args.generations, max_new_tokens=args.max_new_tokens, temperature=1.0)
    reward = target_reward(tokenizer.convert_tokens_to_ids("7"))
    prompts = rank_prompts(make_prompts(tokenizer, args.prompts, args.seed), accelerator)
    if log_with is not None:
        accelerator.init_trackers(f"{args.layout}{'-lora' if args.lora else ''}", config=dict(
            steps=args.steps, prompts=args.prompts, generations=args.generations, lr=args.lr, seed=args.seed))
    trainer = GRPOTrainer(policy, optimizer, reward, prompts, rollouts, config, tracker=accelerator)
    for _ in range(args.steps):
        metrics = trainer.step()
        say(f"[rank {rank}] {format_metrics(metrics)}")

    from accelerate.utils import gather_object

    reports = gather_object([rank_report(accelerator, policy, rollouts, trainer.history)])
    problems = check_agreement(reports, args.max_gap)
    if rank == 0:
        for report in reports:
            say(format_report(report))
        say(f"ranks agree: {not problems}" + "".join(f"\n  DISAGREE: {p}" for p in problems))
    rollouts.close()
    accelerator.wait_for_everyone()  # no rank tears the group down while another still uses it
    accelerator.end_training()
    leave(1 if problems else 0)  # with the wrapped policy still referenced: see leave()


def leave(code: int):
    """Exit now, skipping interpreter teardown. Everything is closed and the group destroyed, but freeing the DDP/FSDP
    wrapper can still deadlock: it drops the last reference to torch's gloo process group while holding the GIL, and
    the group's destructor joins a gloo thread that needs the GIL to release a finished collective's tensors
    (pytorch/pytorch#56297; seen here about one run in ten when main() returned). Nothing is left to clean up."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
