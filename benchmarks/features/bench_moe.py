"""Mixture of experts: what routing replay buys, and what recording routing costs.

On a tiny MoE built locally (Qwen3-MoE by default), a RolloutWorker shares the model in place and generates a
GRPO-shaped batch; the trainer's forward (trainers_integration.forward: right-padded rows, one batch) recomputes
every completion token's logprob in the same dtype, without and with `rollout.replay_routing`. Reported:
- gap: |rollout logprob - trainer logprob| over completion tokens (max, mean);
- flips: the fraction of (position, MoE layer) whose top-k expert set in the trainer's forward differs from the one
  the rollout recorded (the trainer's own routing; under replay, what its routers were forced to);
- cost of recording: useful tokens/s with record_routing off and on (rounds alternate, same prompts and seeds) and
  the bytes of routing per token and per batch.

    python benchmarks/features/bench_moe.py                          # bf16, about a minute on 2 CPU cores
    python benchmarks/features/bench_moe.py --dtype float32 --quick  # the fp32 control (flips ~0)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig, replay_routing
from rollout.moe import capture_routing
from rollout.testing import build_tiny_model, load_tiny_model
from trainers_integration.forward import completion_logprobs, pack


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "olmoe", "mixtral"])
    parser.add_argument("--size", default="small")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer prompts, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.max_new_tokens, args.rounds = 4, 4, 24, 1
    return args


def make_prompts(num: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (int(n),), generator=gen).tolist() for n in torch.randint(16, 96, (num,), generator=gen)]


def trainer_pass(model, batch, replay: bool):
    """(logprobs (R, T), flips, positions): the trainer's forward, and how often its routing differs."""
    packed = pack(batch.prompt_ids, batch.completion_ids, batch.completion_mask, 0)
    width = packed.input_ids.shape[1]
    with torch.no_grad(), (replay_routing(model, batch) if replay else _null()), capture_routing(model) as seen:
        logp, _ = completion_logprobs(model, packed)
    experts = seen[0].view(len(batch), width, *seen[0].shape[1:])
    flips = positions = 0
    for r, row in enumerate(batch.routing.rows):
        n = row.shape[0]
        differ = (experts[r, :n].sort(-1).values != row.long().sort(-1).values).any(-1)
        flips, positions = flips + int(differ.sum()), positions + differ.numel()
    return logp, flips, positions


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def gap(batch, logp) -> tuple[float, float]:
    diff = (batch.logprobs - logp.float()).abs()[batch.completion_mask]
    return float(diff.max()), float(diff.mean())


def throughput(model, tok, record: bool, prompts, sampling) -> tuple[float, int]:
    config = WorkerConfig(page_size=16, record_routing=record, prefix_caching=False)
    with RolloutWorker(model, config, tokenizer=tok) as worker:
        worker.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # start-up out of the timing
        start = time.perf_counter()
        batch = worker.generate(prompts, sampling)
        seconds = time.perf_counter() - start
    nbytes = 0 if batch.routing is None else batch.routing.nbytes
    return batch.num_tokens / seconds, nbytes


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    path = build_tiny_model(os.path.join(tempfile.gettempdir(), f"rollout_bench_moe_{args.arch}_{args.size}"),
                            arch=args.arch, size=args.size)
    model, tok = load_tiny_model(path, dtype=dtype)
    prompts = make_prompts(args.prompts)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=1)
    experts = model.config.num_local_experts if args.arch == "mixtral" else model.config.num_experts
    print(f"# bench_moe: {args.arch} size={args.size} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"params, {experts} experts top-{model.config.num_experts_per_tok}), {args.dtype}, {args.prompts} prompts x "
          f"n={args.n}, {args.max_new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}")

    with RolloutWorker(model, WorkerConfig(page_size=16, record_routing=True), tokenizer=tok) as worker:
        batch = worker.generate(prompts, sampling)
    plain_lp, plain_flips, positions = trainer_pass(model, batch, replay=False)
    replay_lp, replay_flips, _ = trainer_pass(model, batch, replay=True)
    plain_gap, replay_gap = gap(batch, plain_lp), gap(batch, replay_lp)

    rates = {False: [], True: []}
    nbytes = 0
    for _ in range(args.rounds):  # alternate, so drift in the machine's load hits both alike
        for record in (False, True):
            rate, size = throughput(model, tok, record, prompts, sampling)
            rates[record].append(rate)
            nbytes = max(nbytes, size)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])

    print("| trainer forward | gap max | gap mean | routing flips |")
    print("| --- | --- | --- | --- |")
    print(f"| own routing | {plain_gap[0]:.3e} | {plain_gap[1]:.3e} | {plain_flips / positions:.4%} "
          f"({plain_flips}/{positions}) |")
    print(f"| replayed | {replay_gap[0]:.3e} | {replay_gap[1]:.3e} | {replay_flips / positions:.4%} |")
    print(f"| replay / own (gap mean) | {replay_gap[1] / max(plain_gap[1], 1e-30):.3f}x | | |")
    print()
    print("| record_routing | tok/s (median) | ratio |")
    print("| --- | --- | --- |")
    print(f"| off | {off:.1f} | 1.000 |")
    print(f"| on | {on:.1f} | {on / off:.3f} |")
    print(f"routing: {batch.routing.bytes_per_token} bytes/token, {nbytes / 1024:.1f} KiB for "
          f"{sum(r.shape[0] for r in batch.routing.rows)} positions")
    print(json.dumps(dict(bench="moe", arch=args.arch, size=args.size, dtype=args.dtype,
                          gap_max_own=plain_gap[0], gap_mean_own=plain_gap[1], gap_max_replay=replay_gap[0],
                          gap_mean_replay=replay_gap[1], flip_frac_own=plain_flips / positions,
                          flip_frac_replay=replay_flips / positions, tok_s_off=off, tok_s_on=on,
                          record_ratio=on / off, bytes_per_token=batch.routing.bytes_per_token,
                          load_avg=os.getloadavg()[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
