"""What `SamplingParams(top_logprobs=k)` costs a rollout step: the same seeded step with k = 0, 5 and 20, interleaved.

    python benchmarks/features/bench_top_logprobs.py              # 25M Llama, 16 prompts x n=8, 64 new tokens, 3 rounds
    python benchmarks/features/bench_top_logprobs.py --rounds 1   # a smoke run

A step where no row asks skips the sampler's top-k pass; one where some row does pays a `torch.topk` over the
vocabulary for every row of the step, the read-back of the top rows and, per asking row, their lists on the host.
The tokens are the same in every run (seeded): the lists change the cost, never a row's token (checked here).
Reports tokens/s per k (best of the rounds) and the ratio to k = 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders
from clock import RunClock  # benchmarks/clock.py: wall time less SIGSTOP pauses

CLOCK = RunClock()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="25m")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ks", default="0,5,20")
    args = parser.parse_args()
    path = build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-{args.size}", size=args.size)
    ks = [int(k) for k in args.ks.split(",")]
    best: dict[int, float] = {}
    tokens: dict[int, list] = {}
    with RolloutWorker(path, WorkerConfig(seed=0)) as worker:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, worker.vocab_size, (32,), generator=gen).tolist() for _ in range(args.prompts)]
        worker.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=4))  # warm-up
        for _ in range(args.rounds):
            for k in ks:
                params = SamplingParams(n=args.n, max_new_tokens=args.tokens, ignore_eos=True, seed=1,
                                        top_logprobs=k)
                start = CLOCK.now()
                batch = worker.generate(prompts, params)
                rate = batch.num_tokens / (CLOCK.now() - start)
                best[k] = max(best.get(k, 0.0), rate)
                tokens.setdefault(k, batch.completion_token_lists())
                assert batch.completion_token_lists() == tokens[ks[0]], "top_logprobs changed a token"
                assert (batch.top_ids is None) == (k == 0)
    load = os.getloadavg()
    print(f"# top_logprobs cost: {args.size} model, fp32, CPU ({torch.get_num_threads()} threads), vocab "
          f"{worker.vocab_size}, {args.prompts} prompts x n={args.n} x {args.tokens} tokens (ignore_eos, seeded), "
          f"best of {args.rounds} interleaved rounds; load average {load[0]:.2f}; tokens identical for every k")
    for k in ks:
        print(f"top_logprobs={k:<3} {best[k]:8.1f} tok/s  {best[k] / best[ks[0]]:.3f}x")


if __name__ == "__main__":
    main()
