"""The default path's GRPO step, interleaved across source trees and worker configs: is a default (or a commit)
faster or slower here?

    python benchmarks/throughput/bench_defaults.py                                   # this tree, WorkerConfig() vs tuned sizes
    python benchmarks/throughput/bench_defaults.py --trees main=.,old=/tmp/wt-59c17aa --configs default --rounds 4
    python benchmarks/throughput/bench_defaults.py --configs default,mbt512=max_batch_tokens:512,r128=max_requests_per_batch:128

One step (the issue's, and bench_rollout's default): 8 prompts of 32-160 tokens x n = 8 samples at T = 1, budgets
16-128 drawn per prompt (ignore_eos: a random model's EOS is noise), a 6-layer 512-wide Llama (vocab 8192, the
`25m` size of rollout.testing). Each (tree, config) runs in its own process (the tree's code imported fresh, one
warm-up step, then `--steps` timed steps of fixed seeds); the pairs are interleaved round by round so load from
elsewhere hits them alike. A tree is a checkout or `git worktree add /tmp/wt-X X` of an older commit; configs are
WorkerConfig fields (`name=field:value+field:value`) that tree understands. Prints a config card, the median tok/s
per pair, each pair's ratio to the first, and a JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders
import machine  # benchmarks/machine.py: the GEMM rate and CPU flags

CHILD = r"""
import json, sys, tempfile, time, torch
from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import build_tiny_model, load_tiny_model
overrides, steps, prompts_n, n = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model, _ = load_tiny_model(build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-25m", size="25m"))
def step(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 161, (prompts_n,), generator=gen).tolist()
    prompts = [torch.randint(10, 8192, (k,), generator=gen).tolist() for k in lengths]
    budgets = torch.randint(16, 129, (prompts_n,), generator=gen).tolist()
    return prompts, [SamplingParams(n=n, temperature=1.0, max_new_tokens=b, ignore_eos=True) for b in budgets]
with RolloutWorker(model, WorkerConfig(**overrides)) as worker:
    worker.generate(*step(1000))
    tokens, seconds = 0, 0.0
    for s in range(steps):
        prompts, params = step(s)
        start = time.perf_counter()
        batch = worker.generate(prompts, params)
        seconds += time.perf_counter() - start
        tokens += int(batch.completion_lengths.sum())
print(json.dumps({"tok_s": tokens / seconds}))
"""


def parse_config(text: str) -> tuple[str, dict]:
    name, _, fields = text.partition("=")
    overrides = {}
    for item in filter(None, fields.split("+")):
        key, _, value = item.partition(":")
        overrides[key] = None if value == "None" else int(value) if value.lstrip("-").isdigit() else value
    return name, overrides


def run(tree: str, overrides: dict, args) -> float:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(overrides), str(args.steps), str(args.prompts),
                          str(args.n)], env=env, cwd=os.path.abspath(tree), capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tree} {overrides}: the step failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default="this=.", help="name=path,... (default: this checkout)")
    parser.add_argument("--configs", default="default,mbt512=max_batch_tokens:512",
                        help="name=field:value+field:value,... ('default' = WorkerConfig())")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args()
    trees = [t.split("=", 1) if "=" in t else (t, t) for t in args.trees.split(",")]
    configs = [parse_config(c) for c in args.configs.split(",")]
    pairs = [(tn, path, cn, ov) for tn, path in trees for cn, ov in configs]
    print(f"# bench_defaults: 25m Llama, {args.prompts} prompts x n={args.n}, prompts 32-160, budgets 16-128, "
          f"{args.steps} timed steps x {args.rounds} interleaved rounds")
    print(f"# machine: {machine.card()}")
    samples = {(tn, cn): [] for tn, _, cn, _ in pairs}
    for r in range(args.rounds):
        for tn, path, cn, ov in (pairs if r % 2 == 0 else pairs[::-1]):
            samples[(tn, cn)].append(run(path, ov, args))
            print(f"round {r}: {tn}/{cn} {samples[(tn, cn)][-1]:.0f} tok/s", flush=True)
    first = statistics.median(samples[(pairs[0][0], pairs[0][2])])
    print("\n| tree | config | tok/s (median) | runs | ratio to first |\n| --- | --- | ---: | --- | ---: |")
    for tn, _, cn, ov in pairs:
        runs = samples[(tn, cn)]
        print(f"| {tn} | {cn} {ov or ''} | {statistics.median(runs):.0f} | {', '.join(f'{v:.0f}' for v in runs)} "
              f"| {statistics.median(runs) / first:.3f} |")
    print(json.dumps({f"{tn}/{cn}": statistics.median(samples[(tn, cn)]) for tn, _, cn, _ in pairs}))


if __name__ == "__main__":
    main()
