"""TRL's GRPOTrainer three ways, interleaved: TRL's default `generate`, TRL's continuous-batching flag, and
RolloutGRPOTrainer (this engine as TRL's rollout_func).

    python benchmarks/features/bench_trl.py           # 25M Llama, 8 prompts x 8 generations x 64 tokens, 8 steps x 3 rounds
    python benchmarks/features/bench_trl.py --steps 1 --rounds 1 --warmup 0 --size tiny --tokens 8 --prompts 2 --n 4  # smoke

Variants (`--variants`, comma-separated):
- generate: `trl.GRPOTrainer` as a user runs it, generating with `model.generate`;
- cb: `trl.GRPOTrainer(args=GRPOConfig(use_transformers_continuous_batching=True))`;
- rollout: `RolloutGRPOTrainer` over a `RolloutWorker` sharing the policy in place (default `OldLogprobs`: TRL's
  old-logprob forward on the first batch and every `check_every` = 50 steps only; the first falls in the warm-up,
  so a timed step of 8 holds none: amortized, a check adds `rollout-recompute`'s recompute seconds / 50 a step);
- rollout-recompute: the same with `OldLogprobs(source="trainer")`: TRL's recompute forward and importance-sampling
  correction on every batch (what the adapter did before; not in the default set).
Every run is a fresh process (transformers' continuous-batching code is shared by `cb` and this engine's hooks),
on the same saved model, fp32, bf16 and gradient checkpointing off, the same seed; runs are interleaved round by
round. Each run trains `--warmup` untimed steps, then `--steps` timed ones. Per step: wall seconds (RunClock: SIGSTOP
pauses left out), seconds inside TRL's `_generate` (generation, including the weight push), seconds in no-grad
logprob forwards (TRL's old-logprob recompute), and the completions' mean length (EOS may end rows early; the same
sampling settings in every variant). The table reports means over all timed steps of all rounds and each
variant's speed against `generate`. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders
from clock import RunClock  # benchmarks/clock.py: wall time less SIGSTOP pauses

VARIANTS = ("generate", "cb", "rollout", "rollout-recompute")
ROOT = Path(__file__).resolve().parents[2]


def make_dataset(num_prompts: int, seed: int):
    import datasets

    from trainers_integration.demo import WORDS

    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(num_prompts):  # 3 to 7 random words
        length = int(torch.randint(3, 8, (1,), generator=gen))
        prompts.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=gen)))
    return datasets.Dataset.from_dict({"prompt": prompts})


def length_reward(completions, **kwargs):
    return [len(c) / 100 for c in completions]


class StepTimer:
    """Per optimizer step: wall seconds, seconds in `_generate`, seconds in no-grad logprob forwards."""

    def __init__(self, clock: RunClock) -> None:
        self.clock, self.steps, self.generate, self.recompute, self._start = clock, [], 0.0, 0.0, 0.0

    def wrap(self, trainer) -> None:
        generate, logps = trainer._generate, trainer._get_per_token_logps_and_entropies

        def timed_generate(*args, **kwargs):
            start = self.clock.now()
            try:
                return generate(*args, **kwargs)
            finally:
                self.generate += self.clock.now() - start

        def timed_logps(*args, **kwargs):
            start = self.clock.now()
            try:
                return logps(*args, **kwargs)
            finally:
                if not torch.is_grad_enabled():
                    self.recompute += self.clock.now() - start

        trainer._generate, trainer._get_per_token_logps_and_entropies = timed_generate, timed_logps

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._start, timer.generate, timer.recompute = timer.clock.now(), 0.0, 0.0

            def on_step_end(self, args, state, control, **kwargs):
                timer.steps.append({"step_s": timer.clock.now() - timer._start, "generation_s": timer.generate,
                                    "recompute_s": timer.recompute})

        return Callback()


def child(args: argparse.Namespace) -> None:
    """One run of one variant in this process; prints its per-step JSON."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl

    from rollout import RolloutWorker, WorkerConfig
    from rollout.testing import load_tiny_model
    from trainers_integration.trl import OldLogprobs, RolloutGRPOTrainer

    clock = RunClock()
    model, tok = load_tiny_model(args.model)
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n, max_completion_length=args.tokens, max_steps=args.warmup + args.steps,
        learning_rate=1e-5, bf16=False, gradient_checkpointing=False, report_to="none", logging_steps=1,
        use_cpu=True, save_strategy="no", seed=args.seed, temperature=1.0, disable_tqdm=True,
        use_transformers_continuous_batching=args.child == "cb")
    common = {"model": model, "reward_funcs": length_reward, "args": config, "processing_class": tok,
              "train_dataset": make_dataset(args.prompts * (args.warmup + args.steps), args.seed)}
    worker = None
    if args.child.startswith("rollout"):
        worker = RolloutWorker(model, WorkerConfig(seed=args.seed), tokenizer=tok)
        old = OldLogprobs(source="trainer") if args.child == "rollout-recompute" else OldLogprobs()
        trainer = RolloutGRPOTrainer(rollouts=worker, old_logprobs=old, **common)
    else:
        trainer = trl.GRPOTrainer(**common)
    timer = StepTimer(clock)
    timer.wrap(trainer)
    trainer.add_callback(timer.callback())
    trainer.train()
    if worker is not None:
        worker.close()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    steps = [dict(s, mean_length=n) for s, n in zip(timer.steps, lengths, strict=True)][args.warmup:]
    print("RESULT " + json.dumps(steps), flush=True)


def run_child(args: argparse.Namespace, variant: str) -> list[dict]:
    command = [sys.executable, __file__, "--child", variant, "--model", args.model] + [
        f"--{name}={getattr(args, name)}" for name in ("prompts", "n", "tokens", "steps", "warmup", "seed")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} run failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summary(steps: list[dict]) -> dict:
    mean = {key: statistics.mean(s[key] for s in steps) for key in steps[0]}
    return dict(mean, generation_share=mean["generation_s"] / mean["step_s"], timed_steps=len(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="25m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="generations per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="max_completion_length")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=0.2,
                        help="the model's init std: rollout.testing's 0.2 (peaked, varied distributions; oneDNN's "
                             "products can differ from torch's by > 1e-4 in a logprob there, so TRL's check fails and "
                             "its recompute runs every step) or 0.02 (a normally initialised model)")
    parser.add_argument("--variants", default="generate,cb,rollout")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: {unknown} unknown; pick from {list(VARIANTS)}")
    from rollout.testing import build_tiny_model

    suffix = "" if args.init_std == 0.2 else f"-std{args.init_std}"
    args.model = str(build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-{args.size}{suffix}", size=args.size,
                                      init_std=args.init_std))
    steps: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in variants:
            steps[variant] += run_child(args, variant)
            print(f"# round {r + 1}/{args.rounds} {variant}: {summary(steps[variant])['step_s']:.2f} s/step so far",
                  file=sys.stderr, flush=True)
    results = {v: summary(s) for v, s in steps.items()}
    import transformers
    import trl

    load = os.getloadavg()
    print(f"# TRL GRPO step: {args.size} Llama (rollout.testing), fp32, CPU ({torch.get_num_threads()} threads), "
          f"{args.prompts} prompts x {args.n} generations, max {args.tokens} new tokens, temperature 1; "
          f"trl {trl.__version__}, transformers {transformers.__version__}; {args.rounds} interleaved rounds x "
          f"{args.steps} timed steps (+{args.warmup} warm-up) per variant, each run a fresh process; "
          f"load average {load[0]:.2f}")
    base = results.get("generate")
    print(f"{'variant':<19}{'s/step':>8}{'gen s':>8}{'gen share':>10}{'recompute s':>12}{'mean len':>9}"
          f"{'vs generate':>12}")
    for name, r in results.items():
        ratio = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
        print(f"{name:<19}{r['step_s']:>8.2f}{r['generation_s']:>8.2f}{r['generation_share']:>10.0%}"
              f"{r['recompute_s']:>12.2f}{r['mean_length']:>9.1f}{ratio:>12}")
    print(json.dumps({"benchmark": "trl", "size": args.size, "prompts": args.prompts, "n": args.n,
                      "tokens": args.tokens, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                      "results": results}))


if __name__ == "__main__":
    main()
