"""What a constrained row (`SamplingParams(structured=...)`) costs per token against an unconstrained one: the same
seeded step with no row constrained, every row constrained and half of them, interleaved; then the two parts of the
cost alone (the host's matcher work per row, the device mask pass per step) on a large vocabulary.

    python benchmarks/features/bench_structured.py              # "small" Llama (vocab 2048), 8 prompts x n=4, 64 tokens
    python benchmarks/features/bench_structured.py --size 25m   # vocab 8192
    python benchmarks/features/bench_structured.py --rounds 1   # a smoke run

The schema's one string is long enough that constrained rows run to max_new_tokens like the plain ones (ignore_eos),
so each run samples the same number of tokens. Reports tokens/s (best of the rounds), the ratio to the plain run, and
per step the time in the grammar fill (host: matchers advanced, bitmasks written and copied) and in `sample_rows`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from rollout import RolloutWorker, SamplingParams, Structured, WorkerConfig
from rollout.engine.sampling import step as sampling_step
from rollout.engine.sampling.grammar import Constraint, GrammarTable, constrain
from rollout.testing import build_tiny_model, load_tiny_model

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 400}}, "required": ["text"],
          "additionalProperties": False}


class Timed:
    """Seconds spent in a function of a module or class while a run lasts (wrapped, then put back)."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.seconds, self.calls = owner, name, 0.0, 0
        self.original = getattr(owner, name)

    def __enter__(self) -> "Timed":
        original = self.original

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out

        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self.original)


def params_for(name: str, n: int, tokens: int) -> list[SamplingParams]:
    plain = SamplingParams(n=n, max_new_tokens=tokens, ignore_eos=True, seed=1)
    constrained = SamplingParams(n=n, max_new_tokens=tokens, seed=1, structured=Structured.json_schema(SCHEMA))
    return [{"plain": plain, "all": constrained, "half": (plain, constrained)[i % 2]}[name] for i in range(8)]


def run(worker, prompts, name: str, n: int, tokens: int) -> dict:
    with Timed(GrammarTable, "fill") as fill, Timed(sampling_step, "sample_rows") as sampler:
        start = time.perf_counter()
        batch = worker.generate(prompts, params_for(name, n, tokens))
        seconds = time.perf_counter() - start
    sampled = int(batch.completion_lengths.sum())
    steps = max(sampler.calls, 1)
    return {"tok_s": sampled / seconds, "tokens": sampled, "fill_ms": 1e3 * fill.seconds / steps,
            "sampler_ms": 1e3 * sampler.seconds / steps, "finish": sorted(set(batch.finish_reason))}


def mask_pass(vocab: int, rows: int = 128, repeats: int = 5) -> tuple[float, float]:
    """ms of the device mask pass (`constrain`) on one (rows, vocab) step, and of a log_softmax of the same logits
    (the sampler runs one or two per step), on one CPU thread (a loaded machine makes every multi-threaded op wait
    for its slowest thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logits = torch.randn(rows, vocab)
    masks = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    constraint = Constraint(torch.ones(rows, dtype=torch.bool), torch.arange(rows), masks,
                            (1 << torch.arange(8)).to(torch.uint8))
    seconds = []
    for step in (lambda: constrain(logits, constraint), lambda: torch.log_softmax(logits, -1)):
        step()
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        seconds.append(1e3 * (time.perf_counter() - start) / repeats)
    torch.set_num_threads(threads)
    return seconds[0], seconds[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    path = build_tiny_model(os.path.join(tempfile.gettempdir(), f"bench_structured_{args.size}"), size=args.size,
                            init_std=0.02)
    model, tokenizer = load_tiny_model(path)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = [[5 + i, 6 + i, 7 + i, 8 + i] for i in range(8)]
    best: dict[str, dict] = {}
    with RolloutWorker(model, WorkerConfig(), tokenizer=tokenizer) as worker:
        run(worker, prompts, "all", args.n, 4)  # warm-up: compile, allocate
        for _ in range(args.rounds):
            for name in ("plain", "all", "half"):
                result = run(worker, prompts, name, args.n, args.tokens)
                if name not in best or result["tok_s"] > best[name]["tok_s"]:
                    best[name] = result
    print(f"# bench_structured: {args.size} Llama (vocab {vocab}), 8 prompts x n={args.n}, {args.tokens} tokens, "
          f"best of {args.rounds} interleaved rounds, {torch.get_num_threads()} threads")
    print("| rows constrained | tok/s | ratio | grammar fill ms/step | sample_rows ms/step | finish |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name in ("plain", "all", "half"):
        r = best[name]
        print(f"| {name} | {r['tok_s']:.0f} | {r['tok_s'] / best['plain']['tok_s']:.3f} | {r['fill_ms']:.2f} | "
              f"{r['sampler_ms']:.2f} | {','.join(r['finish'])} |")
    passes = {v: mask_pass(v) for v in (vocab, 151936)}
    print("mask pass (constrain) on 128 constrained rows, 1 thread: " + ", ".join(
        f"vocab {v}: {mask:.2f} ms (a log_softmax: {softmax:.2f} ms)" for v, (mask, softmax) in passes.items()))
    print(json.dumps({"size": args.size, "vocab": vocab, "runs": best, "mask_pass_ms": passes}))


if __name__ == "__main__":
    main()
