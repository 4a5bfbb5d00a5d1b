"""Asynchronous GRPO against the synchronous loop: trainer on one core, rollouts on the other (one fleet actor).

    python benchmarks/throughput/bench_async.py                 # three workloads, 24 steps each (~3 min on 2 cores)
    python benchmarks/throughput/bench_async.py --steps 6       # a smoke run

As on a cluster where the fleet has its own GPUs: the trainer process runs torch on 1 thread, the rollouts run in
one Ray actor with 1 thread of its own. Each workload is trained twice from the same initial weights and seed:
synchronously (generate, then train, then push weights) and asynchronously (`async_rollouts=True`, max_staleness 1,
in_flight "recompute", TIS cap 2). From the synchronous run, T_r (rollout seconds per step) and T_t (train + weight
push seconds per step) give the best overlap can do: (T_t + T_r) / max(T_t, T_r). The table reports each run's
seconds per step, the speedup, its fraction of that bound, and the mean reward of the last quarter of the steps
of both runs (learning must not suffer).

Workloads:
- demo: the `rollout demo` task and model (0.14M-parameter Llama, reward = fraction of "7" tokens), 8 prompts x 8
  samples x 16 tokens, 1 epoch: rollouts dominate, and steps are ~0.1 s;
- balanced: the same model and task with 32-token completions and 2 PPO-style epochs per batch, so training and
  rollouts take about as long (the case overlap is for);
- large: balanced with a larger batch (16 prompts x 8 samples x 64 tokens): steps of ~0.4 s, so the fixed cost of a
  step (Ray round trips, the weight push and its fingerprint check: ~20 ms) weighs less.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time

import torch

from rollout import RolloutFleet, WorkerConfig
from rollout.testing import build_tiny_model, load_tiny_model
from trainers_integration.demo import TARGET, make_prompts, target_reward
from trainers_integration.grpo import GRPOConfig, GRPOTrainer

WORKLOADS = {
    "demo": dict(max_new_tokens=16, num_epochs=1),
    "balanced": dict(max_new_tokens=32, num_epochs=2),
    "large": dict(max_new_tokens=64, num_epochs=2, prompts=16),
}


def run(fleet: RolloutFleet, initial, tokenizer, steps: int, workload: dict, asynchronous: bool, seed: int,
        in_flight: str = "recompute") -> dict:
    torch.manual_seed(seed)
    model = copy.deepcopy(initial).train()
    workload = dict(workload)
    prompts = workload.pop("prompts", 8)
    config = GRPOConfig(num_generations=8, temperature=1.0, async_rollouts=asynchronous, tis_cap=2.0,
                        in_flight=in_flight, **workload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    reward = target_reward(tokenizer.convert_tokens_to_ids(TARGET))
    trainer = GRPOTrainer(model, optimizer, reward, make_prompts(tokenizer, prompts, seed), fleet, config)  # pushes v0
    start = time.perf_counter()
    history = trainer.train(steps)
    seconds = time.perf_counter() - start
    trainer.close()
    tail = history[-max(1, steps // 4):]
    return dict(seconds=seconds, per_step=seconds / steps,
                rollout_s=statistics.mean(m["rollout_s"] for m in history),
                train_s=statistics.mean(m["train_s"] + m["refresh_s"] for m in history),
                reward=statistics.mean(m["reward_mean"] for m in tail),
                staleness=max(m["staleness"] for m in history), dropped=history[-1]["dropped_batches"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--workloads", default="demo,balanced,large")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify-every", type=int, default=1, help="RolloutFleet(verify_every=...): compare the "
                        "actors' fingerprints after every k-th update (1: every update)")
    parser.add_argument("--in-flight", default="recompute", help="how each push lands on the rollouts in flight")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the trainer's core
    path = build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-async", seed=args.seed)
    initial, tokenizer = load_tiny_model(path)
    results = {}
    fleet = RolloutFleet(path, num_workers=1, config=WorkerConfig(seed=args.seed),
                         resources={"num_cpus": 1, "torch_threads": 1}, verify_every=args.verify_every)
    try:
        for name in args.workloads.split(","):
            sync = run(fleet, initial, tokenizer, args.steps, WORKLOADS[name], False, args.seed)
            print(f"# {name} sync: {sync['per_step']:.3f} s/step", file=sys.stderr, flush=True)
            asyn = run(fleet, initial, tokenizer, args.steps, WORKLOADS[name], True, args.seed, args.in_flight)
            print(f"# {name} async: {asyn['per_step']:.3f} s/step", file=sys.stderr, flush=True)
            t_r, t_t = sync["rollout_s"], sync["train_s"]
            bound = (t_r + t_t) / max(t_r, t_t)
            speedup = sync["seconds"] / asyn["seconds"]
            results[name] = dict(sync=sync, asyn=asyn, bound=bound, speedup=speedup, of_bound=speedup / bound)
    finally:
        fleet.close()
    print(f"# async card: {sum(p.numel() for p in initial.parameters()) / 1e6:.2f}M-parameter Llama, fp32, CPU; "
          f"trainer 1 thread, one fleet actor 1 thread; {args.steps} GRPO steps x 8 samples per prompt; "
          f"max_staleness 1, in_flight {args.in_flight}, tis_cap 2, verify_every {args.verify_every}")
    print(f"{'workload':<10}{'T_r s':>7}{'T_t s':>7}{'sync s/step':>12}{'async s/step':>13}{'speedup':>9}"
          f"{'bound':>7}{'of bound':>9}{'reward sync':>12}{'reward async':>13}{'dropped':>8}")
    for name, r in results.items():
        print(f"{name:<10}{r['sync']['rollout_s']:>7.3f}{r['sync']['train_s']:>7.3f}{r['sync']['per_step']:>12.3f}"
              f"{r['asyn']['per_step']:>13.3f}{r['speedup']:>8.2f}x{r['bound']:>6.2f}x{r['of_bound']:>8.0%}"
              f"{r['sync']['reward']:>12.3f}{r['asyn']['reward']:>13.3f}{r['asyn']['dropped']:>8.0f}")
    print(json.dumps({"benchmark": "async", "steps": args.steps,
                      "results": {k: {"speedup": v["speedup"], "bound": v["bound"], "of_bound": v["of_bound"],
                                      "T_r": v["sync"]["rollout_s"], "T_t": v["sync"]["train_s"],
                                      "reward_sync": v["sync"]["reward"], "reward_async": v["asyn"]["reward"],
                                      "dropped": v["asyn"]["dropped"]} for k, v in results.items()}}))


if __name__ == "__main__":
    main()
