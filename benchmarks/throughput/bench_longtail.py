"""The long tail of a GRPO step: the synchronous step (generate everything, then filter) against the collector
without and with partial rollouts, on the 25M-parameter Llama (fp32, CPU).

    python benchmarks/throughput/bench_longtail.py              # 6 measured steps per method (~10 min on a quiet 2-core box)
    python benchmarks/throughput/bench_longtail.py --steps 2    # a smoke run
    python benchmarks/throughput/bench_longtail.py --no-push    # rollout throughput alone: no weight push between steps

Workload (one seeded prompt stream, the same for every method): prompts of 8-16 random tokens, n = 8 samples each.
Lengths are heavy-tailed through stop tokens and budgets: a prompt is "hard" one time in ten (its samples run to the
budget, 8x the median), otherwise its samples stop at the first of K stop tokens, K chosen so the median completion
is `--median` tokens (the model's next-token distribution is nearly flat, so a completion's length is geometric).
The reward is 0 for every sample of 40% of the prompts (those groups have zero variance: dynamic sampling drops them)
and otherwise the parity of the sum of the completion's token ids. Between steps the weights are pushed back
(the same tensors, version + 1) under in_flight="recompute", as a trainer does after its optimizer step: rows carried
by partial rollouts have their KV recomputed (on this CPU a re-prefilled token costs about half a sampled one, so
this is the price partial rollouts pay here for exactness; on a GPU prefill is far cheaper). `--push keep` pushes
with in_flight="keep" instead (carried rows go on over their old-weight KV, as the peers' partial rollouts do:
inexact), to show what exactness costs.

Methods, each run for a warm-up step and `--steps` measured steps:
- sync: generate `--groups` prompts per step, then reward and keep the groups whose rewards differ;
- collector: RolloutCollector(partial=False, over_sample): next_batch(accepted) with leftovers cancelled;
- partial: RolloutCollector(partial=True, over_sample, max_staleness): leftovers carried into the next step.
`accepted` = 60% of `--groups` (what sync keeps on average), so every method trains on batches of the same size.

Reported per method over the measured steps: accepted groups/s, accepted (useful) tokens/s, generated tokens/s,
rows sampled per engine step (how full a batch the method keeps: on this CPU a step of ~120 rows decodes ~1.5x the
tokens/s of one of ~40), over-generated tokens (generated and not returned: rejected groups, cancelled leftovers, stale rows), rows carried,
KV tokens the pushes had recomputed (carried rows: the price of their exactness, about a prefill token each),
the per-token staleness histogram, and each method's ratio to sync. The last line is JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from rollout import (RolloutBatch, RolloutCollector, RolloutWorker, SamplingParams, Speculation, WorkerConfig,
                     nonzero_std)
from rollout.testing import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders
from clock import RunClock  # benchmarks/clock.py: wall time less SIGSTOP pauses

N = 8  # samples per prompt


CLOCK = RunClock()


def prompt_stream(seed: int, vocab: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        length = int(torch.randint(8, 17, (1,), generator=gen))
        yield torch.randint(10, vocab, (length,), generator=gen).tolist()


def is_hard(prompt: list[int]) -> bool:
    return prompt[0] % 10 == 0  # one prompt in ten


def is_flat(prompt: list[int]) -> bool:
    return prompt[1] % 5 < 2  # two in five: every sample rewarded 0


def sampling_fn(median: int, vocab: int):
    """Per prompt: hard ones run to the budget; the others stop at one of K tokens (geometric, median `median`)."""
    budget = 8 * median
    num_stops = round(vocab * (1 - 0.5 ** (1 / median)))
    stops = tuple(range(vocab - num_stops, vocab))
    hard = SamplingParams(n=N, max_new_tokens=budget, ignore_eos=True)
    easy = SamplingParams(n=N, max_new_tokens=budget, stop_token_ids=stops)
    return (lambda prompt: hard if is_hard(prompt) else easy), num_stops


def reward(group) -> torch.Tensor:
    if is_flat(group.prompt_ids[0]):
        return torch.zeros(len(group))
    return torch.tensor([float(sum(ids) % 2) for ids in group.completion_token_lists()])


def model_tokens(batch) -> int:
    return int(batch.action_mask.sum())


class StepMeter:
    """Engine steps and the rows each sampled, through the engine's step trace hooks (what `TurnTrace` receives):
    how full the batch a method keeps is."""

    def __init__(self, worker) -> None:
        self.worker, self.steps, self.rows = worker, 0, 0
        worker.engine.trace = self

    def step(self, start: float, end: float) -> None:
        self.steps += 1

    def sampled(self, request_ids: list[str], when: float) -> None:
        self.rows += len(request_ids)

    def ready(self, request_id: str, when: float) -> None:
        pass

    def close(self) -> float:
        """Stop metering; the mean rows sampled per engine step."""
        self.worker.engine.trace = None
        return self.rows / max(self.steps, 1)


def push(worker, state, mode: str | None) -> None:
    if mode is not None:
        worker.update_weights(state, in_flight=mode)


def run_sync(worker, state, args, sampling, stream) -> dict:
    totals = dict(groups=0, tokens=0, generated=0, over=0, carried=0, aborted=0, recomputed=0, stale={})
    for step in range(args.steps + 1):
        if step == 1:
            start, totals = CLOCK.now(), {k: ({} if k == "stale" else 0) for k in totals}
            recomputed, meter = recompute_tokens(worker), StepMeter(worker)
        prompts = list(itertools.islice(stream, args.groups))
        batch = worker.generate(prompts, [sampling(p) for p in prompts])
        rewards = torch.cat([reward(batch_of(batch, g)) for g in range(args.groups)]).view(args.groups, N)
        keep = (rewards != rewards[:, :1]).any(dim=1)
        lengths = batch.completion_lengths.view(args.groups, N).sum(dim=1)
        totals["groups"] += int(keep.sum())
        totals["tokens"] += int(lengths[keep].sum())
        totals["generated"] += batch.num_tokens
        totals["over"] += int(lengths[~keep].sum())
        add_hist(totals["stale"], {0: int(lengths[keep].sum())})
        push(worker, state, args.push)
    totals["seconds"] = CLOCK.now() - start
    totals["recomputed"] = recompute_tokens(worker) - recomputed
    totals["rows_per_step"] = meter.close()
    return totals


def batch_of(batch, g: int):
    return RolloutBatch.from_rows([r for r in batch.rows() if r.prompt_index == g])


def run_collector(worker, state, args, sampling, stream, partial: bool) -> dict:
    totals = dict(groups=0, tokens=0, generated=0, over=0, carried=0, aborted=0, recomputed=0, stale={})
    with RolloutCollector(worker, stream, sampling, reward_fn=reward, accept=nonzero_std, over_sample=args.over_sample,
                          partial=partial, max_staleness=args.max_staleness) as collector:
        for step in range(args.steps + 1):
            if step == 1:
                start, totals = CLOCK.now(), {k: ({} if k == "stale" else 0) for k in totals}
                recomputed, meter = recompute_tokens(worker), StepMeter(worker)
            batch = collector.next_batch(args.accepted)
            stats = batch.stats
            totals["groups"] += stats["accepted_groups"]
            totals["tokens"] += model_tokens(batch)
            totals["over"] += stats["over_generated_tokens"]
            totals["generated"] += model_tokens(batch) + stats["over_generated_tokens"]
            totals["carried"] += stats["carried_rows"]
            totals["aborted"] += stats["aborted_rows"]
            add_hist(totals["stale"], stats["staleness_hist"])
            push(worker, state, args.push)
        totals["seconds"] = CLOCK.now() - start
        totals["rows_per_step"] = meter.close()
    totals["recomputed"] = recompute_tokens(worker) - recomputed
    return totals


def recompute_tokens(worker) -> int:
    """KV tokens the pushes so far had recomputed under the new weights (each costs about a prefill token)."""
    return int(worker.engine.counters.recompute_tokens)


def prefill_rate(worker, vocab: int) -> float:
    """Prompt tokens per second of a plain prefill (80 prompts x 100 tokens, one new token each, best of two): what
    a recomputed KV token costs, to set against the pushes' `recomp` counts."""
    gen = torch.Generator().manual_seed(1)
    best = 0.0
    for _ in range(2):
        prompts = [torch.randint(10, vocab, (100,), generator=gen).tolist() for _ in range(80)]
        start = CLOCK.now()
        worker.generate(prompts, SamplingParams(max_new_tokens=1))
        best = max(best, 8000 / (CLOCK.now() - start))
    return best


def add_hist(into: dict, hist: dict) -> None:
    for k, v in hist.items():
        into[int(k)] = into.get(int(k), 0) + int(v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per method (after one warm-up step)")
    parser.add_argument("--groups", type=int, default=16, help="prompts per synchronous step")
    parser.add_argument("--median", type=int, default=16, help="median completion length (budget: 8x)")
    # 2 groups in flight per group wanted keep ~60 rows per engine step against ~40 at 1.5 (and the synchronous
    # step's 39); a budget-length row needs ~3 steps, so max_staleness 2 lets it finish instead of being regenerated
    parser.add_argument("--over-sample", type=float, default=2.0, help="the collectors' over_sample")
    parser.add_argument("--max-staleness", type=int, default=2, help="the collectors' max_staleness")
    parser.add_argument("--push", default="recompute", choices=["recompute", "keep"], help="the pushes' in_flight "
                        "mode: recompute (exact, the default) or keep (carried rows go on over their old-weight KV, as "
                        "the peers' partial rollouts do: inexact, for comparison)")
    parser.add_argument("--no-push", dest="push", action="store_const", const=None, help="no weight push between "
                        "steps")
    parser.add_argument("--methods", default="sync,collector,partial")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculation", default="off", choices=["off", "auto", "always"],
                        help="speculative decoding with context and history drafts (docs/speculation.md)")
    args = parser.parse_args()
    args.accepted = max(1, round(0.6 * args.groups))
    path = build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-25m", size="25m")
    results = {}
    speculation = None if args.speculation == "off" else Speculation(mode=args.speculation)
    with RolloutWorker(path, WorkerConfig(seed=args.seed, speculation=speculation)) as worker:
        vocab = worker.vocab_size
        sampling, num_stops = sampling_fn(args.median, vocab)
        state = {name: t.detach().clone() for name, t in worker.model.state_dict().items()}
        for method in args.methods.split(","):
            stream = prompt_stream(args.seed, vocab)
            if method == "sync":
                results[method] = run_sync(worker, state, args, sampling, stream)
            else:
                results[method] = run_collector(worker, state, args, sampling, stream, partial=method == "partial")
            print(f"# {method}: {results[method]['seconds']:.1f}s", file=sys.stderr, flush=True)
        recomputed = worker.engine.num_recomputed
        prefill = prefill_rate(worker, vocab)
    load = os.getloadavg()
    print(f"# long-tail card: 25M-parameter Llama, fp32, CPU ({torch.get_num_threads()} threads), WorkerConfig "
          f"defaults; {args.steps} measured steps per method after 1 warm-up; n={N}; prompts 8-16 tokens; median "
          f"completion {args.median} (K={num_stops} stop tokens), budget {8 * args.median}, 1 prompt in 10 runs "
          f"to it; 40% of groups zero-variance; sync {args.groups} prompts/step, collectors {args.accepted} accepted "
          f"groups/step, over_sample {args.over_sample}, max_staleness {args.max_staleness}; weight push per step: "
          f"{args.push or 'none'}; speculation {args.speculation}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{CLOCK.paused:.0f}s paused by the machine's owner left out of the timings")
    base = results.get("sync")
    print(f"{'method':<10}{'s':>7}{'groups/s':>10}{'acc tok/s':>11}{'gen tok/s':>11}{'rows/step':>10}{'over-gen':>10}"
          f"{'carried':>9}{'aborted':>9}{'recomp':>8}{'x sync':>8}  staleness (tokens by versions behind)")
    rows = {}
    for method, r in results.items():
        rate = r["tokens"] / r["seconds"]
        ratio = rate / (base["tokens"] / base["seconds"]) if base else float("nan")
        rows[method] = dict(seconds=r["seconds"], groups_per_s=r["groups"] / r["seconds"], accepted_tokens_per_s=rate,
                            generated_tokens_per_s=r["generated"] / r["seconds"], over_generated=r["over"],
                            carried_rows=r["carried"], aborted_rows=r["aborted"],
                            recomputed_tokens=r["recomputed"], rows_per_step=r["rows_per_step"], vs_sync=ratio,
                            staleness=dict(sorted(r["stale"].items())))
        print(f"{method:<10}{r['seconds']:>7.1f}{rows[method]['groups_per_s']:>10.3f}{rate:>11.1f}"
              f"{rows[method]['generated_tokens_per_s']:>11.1f}{r['rows_per_step']:>10.1f}{r['over']:>10d}{r['carried']:>9d}{r['aborted']:>9d}"
              f"{r['recomputed']:>8d}{ratio:>7.2f}x  {rows[method]['staleness']}")
    print(f"# requests recomputed by the pushes (all steps): {recomputed}; plain prefill {prefill:.0f} tok/s, so the "
          "measured steps' recomputes cost about " + ", ".join(f"{m} {r['recomputed'] / prefill:.1f}s"
                                                               for m, r in results.items()))
    print(json.dumps({"benchmark": "longtail", "steps": args.steps, "groups": args.groups, "accepted": args.accepted,
                      "median": args.median, "over_sample": args.over_sample, "push": args.push,
                      "max_staleness": args.max_staleness, "load": [round(x, 2) for x in load],
                      "paused_s": round(CLOCK.paused, 1), "prefill_tokens_per_s": round(prefill, 1),
                      "results": rows}))


if __name__ == "__main__":
    main()
