"""What penalties, logit_bias, min_p and min_new_tokens cost a rollout step: the same seeded step with none of them,
with all of them on every row, and with them on half the rows, interleaved; then the sampler alone on a large vocab.

    python benchmarks/features/bench_penalties.py              # 25M Llama, 16 prompts x n=8, 64 new tokens, 3 rounds
    python benchmarks/features/bench_penalties.py --rounds 1   # a smoke run

A step where no row asks skips the adjust pass; one where some row does gathers every row's (V,) counts, prompt,
bias and stop rows from the device table, applies them, and counts the sampled tokens back (penalties.py). Rows that
ask for nothing keep their tokens (checked here: the plain half of the mixed run equals the plain run). Reports
tokens/s per configuration (best of the rounds), the ratio to the plain one, and the time the engine spent in
`sample_rows` per step (less noisy than tokens/s on a shared machine); then `sample_rows` per 128-row step on random
logits of the model's vocabulary and of a 152k one (Qwen's), with and without the pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.engine.sampling import step as sampling_step
from rollout.engine.sampling.sampler import RowSpec, sample_rows
from rollout.engine.sampling.slots import SlotTable
from rollout.engine.sampling.streams import stream_key
from rollout.testing import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders
from clock import RunClock  # benchmarks/clock.py: wall time less SIGSTOP pauses

CLOCK = RunClock()
ADJUSTED = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2, min_p=0.02, min_new_tokens=4,
                logit_bias={11: 2.0, 12: -5.0})
OPENAI = dict(frequency_penalty=0.5, presence_penalty=0.3)  # what OpenAI clients send: one part of the pass


def params_for(name: str, n: int, tokens: int) -> list[SamplingParams]:
    """One SamplingParams per prompt slot pattern: 'plain', 'all' (every row adjusted), 'half' (every other prompt)."""
    base = dict(n=n, max_new_tokens=tokens, ignore_eos=True, seed=1)
    plain, adjusted = SamplingParams(**base), SamplingParams(**base, **ADJUSTED)
    return [{"plain": plain, "all": adjusted, "half": (plain, adjusted)[i % 2]}[name] for i in range(2)]


class SamplerClock:
    """Time spent in the engine's `sample_rows` (sampling/step.py calls it once per step), wrapped while a run lasts."""

    def __init__(self) -> None:
        self.seconds, self.calls, self.original = 0.0, 0, sampling_step.sample_rows

    def __enter__(self) -> "SamplerClock":
        def timed(*args, **kwargs):
            start = time.perf_counter()
            drawn = self.original(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return drawn
        sampling_step.sample_rows = timed
        return self

    def __exit__(self, *exc) -> None:
        sampling_step.sample_rows = self.original


def rollout_rates(args) -> dict[str, float]:
    path = build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-{args.size}", size=args.size)
    names = ["plain", "all", "half"]
    best: dict[str, float] = {}
    step_ms: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list] = {}
    with RolloutWorker(path, WorkerConfig(seed=0)) as worker:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, worker.vocab_size, (32,), generator=gen).tolist() for _ in range(args.prompts)]
        worker.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=4, **ADJUSTED))  # warm-up
        for _ in range(args.rounds):
            for name in names:
                pair = params_for(name, args.n, args.tokens)
                params = [pair[i % 2] for i in range(args.prompts)]
                with SamplerClock() as sampler:
                    start = CLOCK.now()
                    batch = worker.generate(prompts, params)
                    best[name] = max(best.get(name, 0.0), batch.num_tokens / (CLOCK.now() - start))
                step_ms[name].append(1000 * sampler.seconds / sampler.calls)
                tokens.setdefault(name, batch.completion_token_lists())
        plain_rows = [r for r in range(len(tokens["plain"])) if (r // args.n) % 2 == 0]
        assert [tokens["half"][r] for r in plain_rows] == [tokens["plain"][r] for r in plain_rows], \
            "the adjusted rows changed a plain row's tokens"
        vocab = worker.vocab_size
    load = os.getloadavg()
    print(f"# penalties cost: {args.size} model, fp32, CPU ({torch.get_num_threads()} threads), vocab {vocab}, "
          f"{args.prompts} prompts x n={args.n} x {args.tokens} tokens (ignore_eos, seeded), best of {args.rounds} "
          f"interleaved rounds; load average {load[0]:.2f}; adjusted rows: {ADJUSTED}")
    for name in names:
        ms = min(step_ms[name])
        print(f"{name:<6} {best[name]:8.1f} tok/s  {best[name] / best['plain']:.3f}x   sample_rows {ms:6.2f} ms/step "
              f"(best round)")
    return {"vocab": vocab, **{f"{k}_tok_s": round(v, 1) for k, v in best.items()},
            **{f"{k}_sampler_ms": round(min(v), 2) for k, v in step_ms.items()}}


def sampler_step(vocab: int, adjusted: dict, rows: int = 128):
    """A `sample_rows` step (with its table gather and count) on random (rows, vocab) logits, every row sampled with
    `adjusted` ({}: none), as a function of no arguments."""
    params = SamplingParams(temperature=0.9, **adjusted)
    specs = {f"r{i}": RowSpec(params, stream_key(5, i)) for i in range(rows)}
    table = SlotTable(torch.device("cpu"), 2 * rows, specs.__getitem__, lambda _: True, vocab_size=vocab)
    gen = torch.Generator().manual_seed(0)
    states = [SimpleNamespace(request_id=f"r{i}", initial_tokens=torch.randint(0, vocab, (64,), generator=gen).tolist(),
                              generated_tokens=torch.randint(0, vocab, (32,), generator=gen).tolist(),
                              _true_initial_tokens=0) for i in range(rows)]
    slots = table.slots(states)
    passes, index = table.passes(slots), torch.tensor(slots)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    positions = torch.full((rows,), 100)

    def step() -> None:
        sampling = table.rows(index, passes)
        table.count(sampling, sample_rows(logits, sampling, positions, passes).tokens)
    return step


def sampler_ms(vocab: int, calls: int = 10) -> list[float]:
    """Milliseconds per step with none, OPENAI's and all (ADJUSTED) on every row: the best of `calls` interleaved
    calls after 3 warm-ups."""
    steps = [sampler_step(vocab, adjusted) for adjusted in ({}, OPENAI, ADJUSTED)]
    times: list[list[float]] = [[] for _ in steps]
    for i in range(calls + 3):
        for step, spent in zip(steps, times):
            start = time.perf_counter()
            step()
            if i >= 3:
                spent.append(time.perf_counter() - start)
    return [1000 * min(spent) for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="25m")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = rollout_rates(args)
    print("# sample_rows per 128-row step (best of 10 interleaved after 3 warm-ups): every row with none, with "
          "frequency + presence penalties, with all of them")
    for vocab in (result["vocab"], 151936):
        plain, penalties, every = sampler_ms(vocab)
        print(f"vocab {vocab:<7} none {plain:7.2f} ms  penalties {penalties:7.2f} ms ({penalties / plain:.2f}x)  "
              f"all {every:7.2f} ms ({every / plain:.2f}x)")
        result[f"sampler_ms_{vocab}"] = [round(plain, 2), round(penalties, 2), round(every, 2)]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
