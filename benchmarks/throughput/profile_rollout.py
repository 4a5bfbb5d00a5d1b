"""Where a rollout step's time goes, per engine step, on the engine thread.

    python benchmarks/throughput/profile_rollout.py            # 25M Llama, the first timed step of bench_rollout.py (~1 min)
    python benchmarks/throughput/profile_rollout.py --quick    # 4 x 4, short completions: a smoke run
    python benchmarks/throughput/profile_rollout.py --arch qwen2 --size 100m --prompts 64 --gen-min 32   # 512 rows, ~100M Qwen2

The worker runs with `WorkerConfig()` defaults; `--sizes bench` gives it bench_rollout.py's page size, batch-token
budget and fixed number of KV blocks instead.

Runs one warmup step and one timed step of bench_rollout.py's GRPO-shaped workload through a `RolloutWorker`, with
wall-clock timers (no profiler, so no profiler overhead) around: each engine loop iteration, the model forward plus
sampling, every `nn.Linear` call (the model's matmuls, lm_head included), the decode attention of `rollout_paged`
(KV reads and SDPAs of the decode rows) and the sampler. "other forward" is the rest of the forward: norms, rotary,
activations, residuals, the KV writes and prefill attention. "host" is the loop outside the forward: upstream's
scheduling and batch preparation. Engine steps are grouped by their shape (live rows, in 8 bins, decode-only or with
prefill); the ceiling column is the model's plain DynamicCache decode step at the bin's top row count
(bench_rollout.py's Ceiling). "idle" is the step's wall time the engine thread spent outside its loop body.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_rollout as bench  # noqa: E402
from rollout import RolloutWorker, WorkerConfig  # noqa: E402
from rollout.engine.attention import paged as attention  # noqa: E402
from rollout.engine.sampling import step  # noqa: E402
from rollout.engine.upstream import runner  # noqa: E402
from transformers.generation.continuous_batching import continuous_api  # noqa: E402

PARTS = ("loop", "forward", "linear", "decode attention", "sampler")


class StepTimers:
    """Wraps the engine's hot functions with timers; one record per engine loop iteration that ran a batch."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.current: collections.Counter = collections.Counter()
        self.shape: tuple[int, bool] | None = None

    def add(self, part: str, seconds: float) -> None:
        self.current[part] += seconds

    def timed(self, part: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - start)
        return wrapper

    def install(self) -> None:
        loop_body = continuous_api.ContinuousBatchingManager._generation_loop_body
        forward = runner.RolloutModelRunner._forward_process_and_sample

        def body(manager, processor, bootstrapping):
            start = time.perf_counter()
            result = loop_body(manager, processor, bootstrapping)
            if self.shape is not None:
                self.add("loop", time.perf_counter() - start)
                self.records.append({"shape": self.shape, **self.current})
            self.current, self.shape = collections.Counter(), None
            return result

        def forward_and_sample(model_runner, model, batch_data, *args):
            start = time.perf_counter()
            forward(model_runner, model, batch_data, *args)
            self.add("forward", time.perf_counter() - start)
            rows = len(model_runner.inputs_and_outputs.requests_in_batch)
            self.shape = (rows, batch_data["input_ids"].numel() == rows)

        continuous_api.ContinuousBatchingManager._generation_loop_body = body
        runner.RolloutModelRunner._forward_process_and_sample = forward_and_sample
        torch.nn.Linear.forward = self.timed("linear", torch.nn.Linear.forward)
        attention._decode = self.timed("decode attention", attention._decode)
        step.sample_rows = self.timed("sampler", step.sample_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", choices=("defaults", "bench"), default="defaults",
                        help="the worker's sizes: WorkerConfig() defaults, or bench_rollout.py's")
    args = bench.parse_args(parser)
    model, _, label = bench.load_model(args)
    steps = [bench.make_step(args.seed + r, args, model.config.vocab_size) for r in range(2)]
    timers = StepTimers()
    config = WorkerConfig() if args.sizes == "defaults" else \
        WorkerConfig(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks)
    with RolloutWorker(model, config) as worker:
        timers.install()  # after the worker patched nn.Linear.forward (onednn.py): the timer wraps what it runs
        bench.run_worker(worker, *steps[0], args.n)
        timers.records.clear()
        start = time.perf_counter()
        tokens = bench.run_worker(worker, *steps[1], args.n)
        wall = time.perf_counter() - start
    records = timers.records
    rows = args.prompts * args.n
    context = round(statistics.mean(len(p) for p in steps[1][0]) + statistics.mean(steps[1][1]) / 2)
    width = max(1, max(r["shape"][0] for r in records) // 8)  # live rows are grouped in 8 bins
    binned = collections.defaultdict(list)
    for r in records:
        live, decode_only = r["shape"]
        binned[(-(-live // width) * width, decode_only)].append(r)  # keyed by the bin's top
    ceiling = bench.Ceiling(model, sorted({live for live, decode_only in binned if decode_only}), context,
                            model.config.vocab_size)
    ceiling.measure(steps=4)
    ceiling_s = ceiling.step_seconds()

    print(f"# profile_rollout: {label}, {args.dtype}, {args.device}, threads={torch.get_num_threads()}; "
          f"{args.prompts} prompts x {args.n} samples, completions {args.gen_min}-{args.gen_max}; worker "
          f"{'WorkerConfig() defaults' if args.sizes == 'defaults' else 'bench sizes'}: {worker.engine.config}")
    print(f"# one step: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s, {len(records)} engine steps")
    totals = {p: sum(r.get(p, 0.0) for r in records) for p in PARTS}
    parts = [("linear", totals["linear"]), ("decode attention", totals["decode attention"]),
             ("sampler", totals["sampler"]),
             ("other forward", totals["forward"] - totals["linear"] - totals["decode attention"] - totals["sampler"]),
             ("host", totals["loop"] - totals["forward"]), ("idle", max(0.0, wall - totals["loop"]))]
    print("# whole step, seconds (share of wall time): " + ", ".join(
        f"{name} {value:.2f} ({value / wall:.0%})" for name, value in parts))
    print(f"{'live rows':>9} {'kind':>8} {'steps':>6} {'total s':>8} {'ms/step':>8} {'linear':>7} {'dec.attn':>9} "
          f"{'sampler':>8} {'other':>6} {'host':>5} {'ceiling':>8}")
    for (live, decode_only), group in sorted(binned.items()):
        med = {p: 1000 * statistics.median(r.get(p, 0.0) for r in group) for p in PARTS}
        rest = med["forward"] - med["linear"] - med["decode attention"] - med["sampler"]
        ceil = f"{1000 * ceiling_s[live]:.1f}" if decode_only else ""
        label_rows = f"{max(1, live - width + 1)}-{live}" if width > 1 else str(live)
        print(f"{label_rows:>9} {'decode' if decode_only else 'prefill':>8} {len(group):>6} "
              f"{sum(r['loop'] for r in group):>8.2f} {med['loop']:>8.1f} {med['linear']:>7.1f} "
              f"{med['decode attention']:>9.1f} {med['sampler']:>8.1f} {rest:>6.1f} "
              f"{med['loop'] - med['forward']:>5.1f} {ceil:>8}")

if __name__ == "__main__":
    main()
