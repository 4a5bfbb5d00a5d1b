"""`rollout demo`: GRPO teaches a tiny random policy a toy task on the CPU, through a shared in-place RolloutWorker.

The task: reward = the fraction of completion tokens that are the token "7". A random policy spreads its mass over
~500 tokens, so it earns ~0.002; GRPO finds the signal in the few lucky samples and the reward climbs to ~1 in a
few dozen steps. Nothing is downloaded: the model and its tokenizer are built locally (`rollout.testing`).

Each step prints reward, KL to the initial policy, the train/rollout logprob gap (the health metric of the weight
sync: ~1e-6 here, because trainer and worker share the parameters) and rollout tokens/s. The run saves a PNG of
reward per step, per-step metrics as JSON lines, and a TensorBoard run of every step's metrics (the trainer's, the
off-policy split, the rollout worker's `rollout/...` counters and gauges: docs/observability.md) through accelerate's
tracker, whose directory it prints; then `reward: <first> -> <last>` (first step; mean of the last tenth of the
steps), and it exits 1 if the reward did not rise by at least `--min-gain`.

    rollout demo --steps 40 --seed 0          # or: python -m trainers_integration.demo
    rollout demo --lora                       # rank-8 LoRA adapters (PEFT) on a frozen base, shared in place

With `--env recall` the policy is trained on two-turn episodes (trainers_integration/envs.py): the environment's
observation after turn 1 holds a secret digit, and turn 2 earns the fraction of its tokens equal to it. A policy
blind to observations cannot average more than 0.1, so a reward that climbs past it shows the multi-turn path
working end to end (observation tokens in the context, masked out of the loss).

    rollout demo --env recall

With `--rewrite` (and `--env recall`) turn 2 restarts from a re-rendered context, prompt + secret, that drops turn 1,
as reasoning models' chat templates drop earlier reasoning: every episode is two rows (segments), trained on by the
same GRPO (one advantage per episode, every segment).

    rollout demo --env recall --rewrite

With `--async` the rollouts of step t+1 are generated while step t trains (max_staleness 1, truncated importance
sampling against the per-token behaviour logprobs), by a worker holding its own copy of the weights that receives
them after every step under in_flight="recompute".

    rollout demo --async

With `--dynamic` GRPO uses dynamic sampling with partial rollouts (`rollout.RolloutCollector`): a group whose
rewards are all equal teaches nothing and is replaced by another prompt's (over-sampling 2x), groups unfinished when
a step's batch is complete carry into the next step (their tokens exact under the version that produced each), and
each group is rewarded as soon as it finishes. A random policy earns 0 on most of its groups, so the zero-variance
fraction starts high; each step prints it, and the plot shows it next to the reward.

    rollout demo --dynamic
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from rollout import EpisodeSpec, RolloutWorker, WorkerConfig
from rollout.testing import build_tiny_model, load_tiny_model

from .envs import BLIND_CEILING, ENVS, RecallRewriteFactory
from .grpo import GRPOConfig, GRPOTrainer, format_metrics

TARGET = "7"
# the prompts of step t come from seed * PROMPT_SEED_STRIDE + t: a prime above any step count, so two seeds never
# share a step's prompts
PROMPT_SEED_STRIDE = 100_003
LORA_LR = 2e-2  # adapters start at zero (LoRA's B) and are few: a larger step than full fine-tuning
WORDS = ("the a one two three four five six seven eight nine ten plus minus what how many apple cat dog red blue "
         "green big small count add sum total number word letter sky sea tree").split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rollout demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default 40: ~20 s on 2 CPU cores; 300 "
                        "with --env: ~1.5 min; 20 with --dynamic)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and the sampling")
    parser.add_argument("--out", default="runs/demo", help="run directory: the tiny model and metrics.jsonl")
    parser.add_argument("--plot", default="runs/demo_reward.png", help="PNG of reward per step ('' to skip)")
    parser.add_argument("--tensorboard", default=None, metavar="DIR", help="TensorBoard log directory: each run "
                        "writes a subdirectory there (default: OUT/tensorboard; '' to skip)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (high: a tiny model; default "
                        "5e-3, 3e-3 with --env, 2e-2 with --lora)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--generations", type=int, default=None, help="samples per prompt (the GRPO group; default "
                        "8, 16 with --env)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="completion budget (default 16; per "
                        "turn with --env: 4)")
    parser.add_argument("--async", dest="async_rollouts", action="store_true", help="overlap rollouts with "
                        "training (max_staleness 1, a worker with its own copy of the weights)")
    parser.add_argument("--dynamic", action="store_true", help="dynamic sampling (zero-variance groups replaced, "
                        "2x over-sampling) with partial rollouts carried across steps (a worker with its own copy of "
                        "the weights)")
    parser.add_argument("--env", choices=sorted(ENVS), default=None, help="train on multi-turn episodes of this "
                        "environment instead of the single-turn task")
    parser.add_argument("--rewrite", action="store_true", help="with --env recall: turn 2 restarts from a "
                        "re-rendered context that drops turn 1 (a history-rewriting chat template)")
    parser.add_argument("--min-gain", type=float, default=0.3, help="exit 1 unless last - first reward >= this")
    parser.add_argument("--lora", action="store_true", help=f"train rank-8 LoRA adapters (PEFT) on a frozen base "
                        f"instead of every weight; lr {LORA_LR} unless --lr is given")
    args = parser.parse_args(argv)
    if args.rewrite and args.env != "recall":
        parser.error("--rewrite needs --env recall: it is the recall task under a history-rewriting template")
    if (args.async_rollouts or args.dynamic) and args.lora:
        parser.error("--async or --dynamic with --lora is not supported: that demo's worker loads the base "
                     "checkpoint, without the adapters. Fix: drop --lora")
    if args.async_rollouts and args.dynamic:
        parser.error("--async with --dynamic is not supported: --dynamic carries partial rollouts across steps "
                     "instead. Fix: use one of the two")
    defaults = dict(steps=300, lr=3e-3, generations=16, max_new_tokens=4) if args.env else \
        dict(steps=40, lr=LORA_LR if args.lora else 5e-3, generations=8, max_new_tokens=16)
    if args.dynamic:  # converged by then: all-equal rewards again, so each later step searches long for signal
        defaults["steps"] = 20
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tensorboard is None:
        args.tensorboard = str(Path(args.out) / "tensorboard")
    if args.steps < 1:
        parser.error(f"--steps={args.steps} is invalid: run at least 1 step")
    return args


def make_prompts(tokenizer, num_prompts: int, seed: int):
    """step -> `num_prompts` short random word prompts (token ids), reproducible from the seed and the step."""

    def prompts(step: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed * PROMPT_SEED_STRIDE + step)
        out = []
        for _ in range(num_prompts):
            length = int(torch.randint(2, 6, (1,), generator=gen))
            words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=gen)]
            out.append(tokenizer.encode(" ".join(words), add_special_tokens=False))
        return out

    return prompts


def target_reward(target_id: int):
    def reward(batch) -> torch.Tensor:  # fraction of each completion's tokens that are the target
        hits = (batch.completion_ids == target_id) & batch.completion_mask
        return hits.sum(dim=1).float() / batch.completion_lengths.clamp(min=1).float()

    return reward


def save_plot(rewards: list[float], path: str, title: str, blind: float | None = None,
              zero_variance: list[float] | None = None) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the demo's plot needs matplotlib. Fix: pip install 'rollout[plot]', or pass --plot ''.") \
            from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(rewards) + 1), rewards, marker="o", markersize=3, label="mean reward")
    if zero_variance is not None:
        ax.plot(range(1, len(zero_variance) + 1), zero_variance, marker="s", markersize=3, color="tab:orange",
                label="zero-variance groups (fraction)")
    if blind is not None:
        ax.axhline(blind, color="grey", linestyle="--", label="best policy blind to observations")
    if blind is not None or zero_variance is not None:
        ax.legend(loc="upper left")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward" if zero_variance is None else "reward / fraction")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def open_tracker(args: argparse.Namespace):
    """(accelerate's Accelerator logging to TensorBoard under args.tensorboard/<run>, that run's directory), or
    (None, None) when skipped or when accelerate / tensorboard are not installed (said once)."""
    if not args.tensorboard:
        return None, None
    from .tracking import make_tracker, tracker_missing

    missing = tracker_missing("tensorboard")
    if missing:
        print(f"tensorboard: skipped ({missing}). Fix: pip install 'rollout[dev]'", file=sys.stderr)
        return None, None
    run = f"{args.env or 'target'}{'-lora' if args.lora else ''}{'-async' if args.async_rollouts else ''}" \
          f"-seed{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    config = {k: v for k, v in vars(args).items() if k not in ("out", "plot", "tensorboard")}
    return make_tracker(args.tensorboard, run, config=config), Path(args.tensorboard) / run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out)
    torch.manual_seed(args.seed)
    model, tokenizer = load_tiny_model(build_tiny_model(out / "model", seed=args.seed))
    if args.lora:  # the worker below shares the PeftModel in place: refresh() after each step, nothing moves
        from .lora import add_lora

        model = add_lora(model, rank=8, seed=args.seed)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    overlapped = args.async_rollouts or args.dynamic
    config = GRPOConfig(num_generations=args.generations, max_new_tokens=args.max_new_tokens, temperature=1.0,
                        async_rollouts=args.async_rollouts, tis_cap=2.0 if overlapped else None,
                        dynamic_sampling=args.dynamic, partial_rollouts=args.dynamic,
                        over_sample=2.0 if args.dynamic else 1.0)
    prompts = make_prompts(tokenizer, args.prompts, args.seed)
    if args.env:
        make_env = RecallRewriteFactory(tokenizer, args.seed, prompts) if args.rewrite else \
            ENVS[args.env](tokenizer, args.seed)
        reward_fn, episodes = None, EpisodeSpec(make_env, max_turns=2)
        rewritten = ", turn 2 from a re-rendered context without turn 1" if args.rewrite else ""
        task = (f"{args.env} episodes (2 turns{rewritten}; a policy blind to observations earns <= "
                f"{BLIND_CEILING:.1f})")
    else:
        make_env, reward_fn, episodes = None, target_reward(tokenizer.convert_tokens_to_ids(TARGET)), None
        task = f"reward = fraction of tokens that are {TARGET!r}"
    if args.async_rollouts:
        task += "; asynchronous rollouts (max staleness 1)"
    if args.dynamic:
        task += "; dynamic sampling with partial rollouts (over-sampling 2x, max staleness 1)"
    if args.lora:
        task += "; rank-8 LoRA adapters on a frozen base"
    print(f"demo: GRPO on a tiny {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter policy, {task}; "
          f"{args.steps} steps x {args.prompts} prompts x {args.generations} samples, lr {args.lr}, seed {args.seed}",
          flush=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    rewards, zero_variance = [], []
    source = out / "model" if overlapped else model  # rollouts running while it trains: the worker's own copy
    tracker, run_dir = open_tracker(args)
    with RolloutWorker(source, WorkerConfig(seed=args.seed), tokenizer=tokenizer) as worker, \
            open(out / "metrics.jsonl", "w") as log:
        trainer = GRPOTrainer(model, optimizer, reward_fn, prompts, worker, config, ref_model=ref, episodes=episodes,
                              tracker=tracker)
        for step in range(args.steps):
            if make_env is not None:
                make_env.step = step  # a new secret per step
            metrics = trainer.step()
            rewards.append(metrics["reward_mean"])
            zero_variance.append(metrics["zero_variance_frac"])
            log.write(json.dumps(metrics) + "\n")
            print(format_metrics(metrics), flush=True)
        trainer.close()
    if tracker is not None:
        tracker.end_training()  # flushes the event files
        print(f"tensorboard: {run_dir} (view: tensorboard --logdir {args.tensorboard})")
    if args.plot:
        title = f"GRPO on {args.env} episodes" if args.env else "GRPO through a shared RolloutWorker"
        title += " (rewritten history)" if args.rewrite else ""
        if args.dynamic:
            title = "GRPO with dynamic sampling and partial rollouts"
        save_plot(rewards, args.plot, f"{title} (seed {args.seed})", BLIND_CEILING if args.env else None,
                  zero_variance if args.dynamic else None)
        print(f"plot: {args.plot}")
    print(f"wall time: {time.perf_counter() - start:.1f}s")
    return reward_verdict(rewards, args.min_gain)


def reward_verdict(rewards: list[float], min_gain: float, note: str = "", head: int = 1) -> int:
    """Prints `reward: <first> -> <last>` (the mean of the first `head` steps; the mean of the last tenth of the run,
    at least 3 steps) and returns the exit code: 1, with the shortfall on stderr, unless the reward rose by
    `min_gain`."""
    tail = rewards[-max(3, len(rewards) // 10):]
    first, last = sum(rewards[:head]) / len(rewards[:head]), sum(tail) / len(tail)
    print(f"reward: {first:.3f} -> {last:.3f}{note}")
    if last - first < min_gain:
        print(f"FAILED: the reward rose by {last - first:.3f} < {min_gain}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
