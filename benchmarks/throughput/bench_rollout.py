"""Rollout throughput on a GRPO-shaped step, four ways in one process, against the model's own decode ceiling.

    python benchmarks/throughput/bench_rollout.py            # 25M Llama, 8 prompts x 8 samples, 3 timed rounds (~3-4 min, 2 cores)
    python benchmarks/throughput/bench_rollout.py --workers auto,sdpa   # adds the engine on transformers' sdpa path
    python benchmarks/throughput/bench_rollout.py --quick    # 4 x 4, 1 round: a smoke run
    python benchmarks/throughput/bench_rollout.py --metrics-ab --skip generate_batch,generate --rounds 8   # what metrics cost
    benchmarks/gpu/gpu.sh                             # the GPU version (0.5B Qwen2 in bf16), which calls this file

One step: P prompts of lengths drawn uniformly in [prompt-min, prompt-max], N samples each at temperature 1.0.
Completion lengths are ragged as EOS makes them; the model is random, so EOS is emulated: every prompt gets a budget
drawn uniformly in [gen-min, gen-max] (one SamplingParams per prompt, `ignore_eos=True`; its N samples stop together
at that budget). Useful tokens are the completion tokens the step asked for; each method is charged its whole wall
time for the step.

- worker: `RolloutWorker.generate`, default WorkerConfig apart from sizing (started once, one warmup step, then
  timed steps). More worker rows (`--workers auto,sdpa,...`) run the same engine on other attention
  implementations; the first listed is "worker".
- generate_batch: transformers' continuous batching with a fresh manager per step, as `generate_batch` builds it
  (`continuous_batching_context_manager`, warmup included, the same page size, cache and batch-token budget as the
  worker). `generate_batch` itself takes one `max_new_tokens` for every request, so its context manager is called
  directly and each request gets its prompt's budget.
- generate: padded `model.generate` of all P x N rows, left-padded, to the step's longest budget (what EOS costs
  it: finished rows are computed until the last row ends).
- ceiling: the same model's plain decode step with a contiguous cache (DynamicCache) at P x N rows and the step's
  mean context length, forward only (no sampling, no scheduling). "ceiling@profile" charges that decode step at the
  number of rows still live at each step of the ragged workload instead (an engine cannot keep finished rows busy).

`--metrics-ab` adds "worker[metrics stubbed]": the same worker built with the engine's counters stubbed out
(`NullCounters`: every count a no-op), interleaved with the worker as another method, and prints what the counting
itself took: the CPU seconds spent inside the counters' methods over one more run of every step, per step and as a
share of the steps' CPU time (an upper bound: the timer's own cost is included), and what one `worker.metrics()`
snapshot costs (taken on demand, never on the engine's path). The A/B ratio is given in wall-clock tokens/s and in
tokens per CPU-second (the load-robust one on a shared machine).

Methods are interleaved round by round, so load from elsewhere hits them alike; the table shows medians. Extra
memory: peak RSS (CPU) or peak allocated (GPU) during the method minus before it; the worker's is its start-up.
logprob gap: max |logprob - plain forward| over the first rows of the last step, in the model's dtype.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import torch
import transformers

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import SIZES, build_tiny_model, load_tiny_model

# Qwen2.5-0.5B's shape (494M parameters with tied embeddings), built locally with random weights
QWEN2_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)


# ---------------------------------------------------------------------------------------------------- memory
def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@contextmanager
def peak_memory(out: dict, key: str, device: torch.device, period: float = 0.01):
    """Records into out[key] the peak memory while the block runs minus before it (MiB): RSS on CPU, allocated
    tensor memory on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            torch.cuda.synchronize()
            out[key] = max(out.get(key, 0.0), (torch.cuda.max_memory_allocated() - before) / 2**20)
        return
    before, peak, done = rss_mb(), [rss_mb()], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            done.wait(period)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        out[key] = max(out.get(key, 0.0), max(peak[0], rss_mb()) - before)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- model
def load_model(args):
    """(model, pad_token_id, label). Sizes of rollout.testing are Llamas (or Qwen2s, `--arch qwen2`) with their
    trained tokenizer; "0.5b" is a Qwen2 of Qwen2.5-0.5B's shape with random weights (token ids only)."""
    dtype = getattr(torch, args.dtype)
    if args.size in SIZES:
        suffix = "" if args.arch == "llama" else f"-{args.arch}"
        path = build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-{args.size}{suffix}", arch=args.arch,
                                size=args.size)
        model, tok = load_tiny_model(path, dtype=dtype)
        return model.to(args.device), tok.pad_token_id, f"{args.arch}-{args.size}"
    if args.size != "0.5b":
        raise SystemExit(f"--size {args.size!r}: use one of {sorted(SIZES)} or 0.5b")
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**QWEN2_0_5B)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = config.eos_token_id
    return model.eval(), 0, "qwen2-0.5b"


# ---------------------------------------------------------------------------------------------------- workload
def make_step(seed: int, args, vocab: int) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(10, min(vocab, 30000), (n,), generator=gen).tolist() for n in lengths]
    budgets = torch.randint(args.gen_min, args.gen_max + 1, (args.prompts,), generator=gen).tolist()
    return prompts, budgets


def run_worker(worker: RolloutWorker, prompts, budgets, n: int, keep: list | None = None) -> int:
    params = [SamplingParams(n=n, temperature=1.0, max_new_tokens=b, ignore_eos=True) for b in budgets]
    batch = worker.generate(prompts, params)
    assert batch.completion_lengths.tolist() == [b for b in budgets for _ in range(n)], "worker ignored a budget"
    if keep is not None:
        keep[:] = [batch]
    return int(batch.completion_lengths.sum())


def run_generate_batch(model, prompts, budgets, n: int, args, startup: list[float]) -> int:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen_config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                                  eos_token_id=-1, max_new_tokens=max(budgets))
    cpu = model.device.type == "cpu"  # on a GPU, upstream's own defaults (CUDA graphs, async, flash switch)
    cb_config = ContinuousBatchingConfig(page_size=args.page_size, num_blocks=args.num_blocks,
                                         max_batch_tokens=args.max_batch_tokens,
                                         use_cuda_graph=False if cpu else None,
                                         use_async_batching=False if cpu else None)
    start = time.perf_counter()
    tokens = 0
    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb_config,
                                                   block=True, timeout=60, warmup=True) as manager:
        startup.append(time.perf_counter() - start)
        for i, (ids, budget) in enumerate(zip(prompts, budgets)):
            manager.add_request(input_ids=ids, request_id=f"p{i}", max_new_tokens=budget, eos_token_id=-1)
        finished = 0
        while finished < len(prompts) * n:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished += 1
                tokens += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("generate_batch's manager died")
    return tokens


def run_generate(model, prompts, budgets, n: int, pad_id: int) -> int:
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=max(budgets), min_new_tokens=max(budgets), pad_token_id=pad_id)
    assert out.shape[1] - width == max(budgets)
    return sum(budgets) * n  # the useful part: each row up to its (emulated) EOS


@torch.no_grad()
def logprob_gap(model, batch, rows: int) -> float:
    """Max |worker logprob - plain teacher-forced forward logprob| over the first `rows` rows (model dtype)."""
    gap = 0.0
    for r, completion in enumerate(batch.completion_token_lists()[:rows]):
        prompt = batch.prompt_ids[r]
        ids = torch.tensor([prompt + completion], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion, device=model.device)[:, None])[:, 0]
        gap = max(gap, float((batch.logprobs[r, : len(completion)].to(ref.device) - ref).abs().max()))
    return gap


# ---------------------------------------------------------------------------------------------------- ceiling
class Ceiling:
    """The model's plain decode step with a contiguous cache (DynamicCache): one prefill of `rows` sequences of
    `context` tokens, then timed decode steps at each batch size from a copy of that cache."""

    @torch.no_grad()
    def __init__(self, model, batch_sizes: list[int], context: int, vocab: int) -> None:
        from transformers import DynamicCache

        self.model, self.batch_sizes = model, sorted(batch_sizes, reverse=True)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(10, min(vocab, 30000), (self.batch_sizes[0], context), generator=gen).to(model.device)
        self.cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
        self.token = logits[:, -1].argmax(-1, keepdim=True)
        self.samples: dict[int, list[float]] = {b: [] for b in self.batch_sizes}

    @torch.no_grad()
    def measure(self, steps: int) -> None:
        for size in self.batch_sizes:
            cache = copy.deepcopy(self.cache)
            if size < self.batch_sizes[0]:
                cache.batch_select_indices(torch.arange(size, device=self.model.device))
            token = self.token[:size]
            for i in range(steps + 2):
                if i == 2:
                    sync(self.model.device)
                    start = time.perf_counter()
                logits = self.model(input_ids=token, past_key_values=cache, use_cache=True).logits
                token = logits[:, -1].argmax(-1, keepdim=True)
            sync(self.model.device)
            self.samples[size].append((time.perf_counter() - start) / steps)

    def step_seconds(self) -> dict[int, float]:
        return {size: statistics.median(s) for size, s in self.samples.items()}


def profile_seconds(step_seconds: dict[int, float], budgets: list[int], n: int) -> float:
    """Decode time of the ragged step at the ceiling's per-step cost: live rows at step t = rows with budget > t."""
    sizes = sorted(step_seconds)

    def at(b: int) -> float:  # linear interpolation between measured batch sizes
        lo = max([s for s in sizes if s <= b], default=sizes[0])
        hi = min([s for s in sizes if s >= b], default=sizes[-1])
        if hi == lo:
            return step_seconds[lo]
        w = (b - lo) / (hi - lo)
        return step_seconds[lo] * (1 - w) + step_seconds[hi] * w

    return sum(at(n * sum(1 for b in budgets if b > t)) for t in range(max(budgets)))


def bandwidth_bound(model, args, rows: int, context: int, sizes: list[int], steps) -> dict:
    """Decode tokens/s if every step only read the weights once and each row's KV once, at args.bandwidth_tbs:
    "bound" at all rows and the mean context, "bound@profile" at the ragged step's live rows."""
    from rollout.engine.device.sizing import kv_bytes_per_token

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = kv_bytes_per_token(model)
    step_s = {size: (weight_bytes + size * context * per_token) / (args.bandwidth_tbs * 1e12) for size in sizes}
    profile = statistics.median(sum(b * args.n for b in budgets) / profile_seconds(step_s, budgets, args.n)
                                for _, budgets in steps)
    return {"bound": {"useful_tokens_per_s": rows / step_s[rows], "step_s": step_s[rows], "tokens_per_step": rows},
            "bound@profile": {"useful_tokens_per_s": profile}}


# ---------------------------------------------------------------------------------------------------- main
def parse_args(parser: argparse.ArgumentParser | None = None):
    """This benchmark's arguments, added to `parser` (another script's, with arguments of its own) if given."""
    parser = parser or argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="25m", help=f"one of {sorted(SIZES)} (Llama) or 0.5b (Qwen2)")
    parser.add_argument("--arch", default="llama", choices=("llama", "qwen2"), help="of the rollout.testing sizes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-min", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=160)
    parser.add_argument("--gen-min", type=int, default=16)
    parser.add_argument("--gen-max", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per method (after one warmup step)")
    parser.add_argument("--workers", default="auto",
                        help="attention implementations of the worker rows, e.g. auto,sdpa; the first is 'worker'")
    parser.add_argument("--page-size", type=int, default=WorkerConfig.page_size)
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="default: WorkerConfig's for the device")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks for every engine (pages)")
    parser.add_argument("--gap-rows", type=int, default=8, help="rows of the last step checked against a forward")
    parser.add_argument("--skip", default="", help="comma-separated methods to skip: generate_batch,generate")
    parser.add_argument("--quick", action="store_true", help="4 prompts x 4 samples, completions 16-48, 1 round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics-ab", action="store_true", help="add the worker with its counters stubbed, and "
                        "the time counting takes")
    parser.add_argument("--bandwidth-tbs", type=float, default=None,
                        help="device memory bandwidth in TB/s (H200: 4.8): adds the decode bound rows")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.n, args.gen_max, args.rounds = 4, 4, min(args.gen_max, 48), 1
    if args.max_batch_tokens is None:
        args.max_batch_tokens = WorkerConfig().for_device(torch.device(args.device)).max_batch_tokens
    return args


def main() -> None:
    args = parse_args()
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device(args.device)

    t_build = time.perf_counter()
    model, pad_id, label = load_model(args)
    model.generation_config.top_k = None  # temperature-only sampling everywhere
    build_s = time.perf_counter() - t_build
    vocab = model.config.vocab_size
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    steps = [make_step(args.seed + r, args, vocab) for r in range(args.rounds + 1)]  # step 0 warms up

    mem: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    startup: dict[str, float] = {}
    gb_startup: list[float] = []
    base_rss = rss_mb()

    cpu: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        with peak_memory(mem, name, device):
            start, cpu_start = time.perf_counter(), time.process_time()
            count = fn()
            times.setdefault(name, []).append(time.perf_counter() - start)
            cpu.setdefault(name, []).append(time.process_time() - cpu_start)  # every thread's CPU seconds
        tokens.setdefault(name, []).append(count)
        print(f"# round {len(times[name])} {name}: {count} tokens in {times[name][-1]:.2f} s", file=sys.stderr,
              flush=True)

    workers: dict[str, RolloutWorker] = {}
    last: dict[str, list] = {}
    try:
        for i, attn in enumerate(args.workers.split(",")):
            start = time.perf_counter()
            config = config_of(args, attn)
            with peak_memory(mem, "pending", device):
                worker = RolloutWorker(model, config)
            name = "worker" if i == 0 else f"worker[{worker._engine_attn}]"
            mem[name] = mem.pop("pending")
            startup[name] = time.perf_counter() - start
            workers[name] = worker
            last[name] = []
        if args.metrics_ab:  # the first worker's engine, counting nothing
            from unittest import mock

            from rollout.engine.observe.counters import NullCounters

            with mock.patch("rollout.engine.engine.Counters", NullCounters):
                workers["worker[metrics stubbed]"] = RolloutWorker(model, config_of(args, args.workers.split(",")[0]))
            mem["worker[metrics stubbed]"], last["worker[metrics stubbed]"] = 0.0, []
        rows = args.prompts * args.n
        mean_context = round(statistics.mean(len(p) for prompts, _ in steps[1:] for p in prompts)
                             + statistics.mean(b for _, budgets in steps[1:] for b in budgets) / 2)
        sizes = sorted({rows, max(1, rows // 2), max(1, rows // 4), max(1, rows // 8), max(1, rows // 16), args.n})
        ceiling = Ceiling(model, sizes, mean_context, vocab)
        t_warm = time.perf_counter()
        for w in workers.values():  # the warmup step, not timed
            run_worker(w, *steps[0], args.n)
        warmup_s = time.perf_counter() - t_warm
        for r, (prompts, budgets) in enumerate(steps[1:]):
            order = list(workers.items())
            for name, w in order[::-1] if args.metrics_ab and r % 2 else order:  # A/B: each goes first in turn
                timed(name, lambda: run_worker(w, prompts, budgets, args.n, last[name]))
            if "generate_batch" not in skip:
                timed("generate_batch", lambda: run_generate_batch(model, prompts, budgets, args.n, args, gb_startup))
            if "generate" not in skip:
                timed("generate", lambda: run_generate(model, prompts, budgets, args.n, pad_id))
            ceiling.measure(steps=4 if args.quick else 8)
        engine_attn = {name: w._engine_attn for name, w in workers.items()}
        counting = measure_counting(model, args, steps[1:]) if args.metrics_ab else None
    finally:
        for w in workers.values():
            w.close()
    gaps = {name: logprob_gap(model, batches[0], args.gap_rows) for name, batches in last.items()}

    # ceiling: plain decode at the step's rows and mean context, then at the live-row profile
    step_s = ceiling.step_seconds()
    profile_tps = statistics.median(
        sum(b * args.n for b in budgets) / profile_seconds(step_s, budgets, args.n) for _, budgets in steps[1:])

    results = {}
    for name in times:
        tps = [t / s for t, s in zip(tokens[name], times[name])]
        results[name] = {"useful_tokens_per_s": statistics.median(tps), "step_s": statistics.median(times[name]),
                         "tokens_per_step": statistics.median(tokens[name]), "extra_mem_mb": round(mem[name], 1),
                         "attention": engine_attn.get(name), "logprob_gap": gaps.get(name)}
    results["ceiling"] = {"useful_tokens_per_s": rows / step_s[rows], "step_s": step_s[rows], "tokens_per_step": rows}
    results["ceiling@profile"] = {"useful_tokens_per_s": profile_tps}
    if args.bandwidth_tbs:
        results.update(bandwidth_bound(model, args, rows, mean_context, sizes, steps[1:]))
    wtps = results["worker"]["useful_tokens_per_s"]
    ratios = {f"worker/{k}": wtps / v["useful_tokens_per_s"] for k, v in results.items() if k != "worker"}
    goals = {"generate": 2.5, "generate_batch": 2.0, "ceiling": 0.7}  # issue 7: worker / it at least this
    targets = {f"worker>={bound}x {name}": ratios[f"worker/{name}"] >= bound
               for name, bound in goals.items() if f"worker/{name}" in ratios}
    gb = round(statistics.median(gb_startup), 2) if gb_startup else None

    mem_kind = "allocated" if device.type == "cuda" else "RSS"
    print(f"# rollout card: model={label} ({params_m:.1f}M params, {args.dtype}, {device.type}) "
          f"torch={torch.__version__} transformers={transformers.__version__} threads={torch.get_num_threads()}")
    print(f"# step: {args.prompts} prompts x {args.n} samples, prompts {args.prompt_min}-{args.prompt_max} tokens, "
          f"completions {args.gen_min}-{args.gen_max} tokens (per-prompt budgets, EOS emulated, ignore_eos), T=1.0; "
          f"{args.rounds} timed rounds after 1 warmup, medians")
    print(f"# engines: page_size={args.page_size} max_batch_tokens={args.max_batch_tokens} "
          f"num_blocks={args.num_blocks}; worker attention: {engine_attn}; ceiling: DynamicCache decode, {rows} rows, "
          f"context {mean_context}" + (f"; bound: weights + KV read once per decode step at {args.bandwidth_tbs} TB/s"
                                       if args.bandwidth_tbs else ""))
    print(f"# start-up: worker {startup['worker']:.2f} s once (warmup step of all workers {warmup_s:.1f} s); "
          f"generate_batch {'(skipped)' if gb is None else f'{gb} s'} every step; model build {build_s:.1f} s; base RSS {base_rss:.0f} MiB")
    print(f"{'method':<24}{'useful tok/s':>13}{'step s':>9}{'tokens':>8}{f'extra {mem_kind} MiB':>20}"
          f"{'logprob gap':>13}{'worker / it':>13}")
    for name, r in results.items():
        ratio = "" if name == "worker" else f"{ratios[f'worker/{name}']:.2f}x"
        step = f"{r['step_s']:.2f}" if r.get("step_s") is not None else ""
        extra = f"{r['extra_mem_mb']:.0f}" if r.get("extra_mem_mb") is not None else ""
        count = f"{r['tokens_per_step']:.0f}" if r.get("tokens_per_step") is not None else ""
        gap = f"{r['logprob_gap']:.1e}" if r.get("logprob_gap") is not None else ""
        print(f"{name:<24}{r['useful_tokens_per_s']:>13.1f}{step:>9}{count:>8}{extra:>20}{gap:>13}{ratio:>13}")
    print("# targets: " + ", ".join(f"{k} {'MET' if v else 'missed'}" for k, v in targets.items()))
    if counting is not None:
        on, off = results["worker"]["useful_tokens_per_s"], results["worker[metrics stubbed]"]["useful_tokens_per_s"]
        cpu_per_token = {name: statistics.median(c / t for c, t in zip(cpu[name], tokens[name]))
                         for name in ("worker", "worker[metrics stubbed]")}
        cpu_ratio = cpu_per_token["worker[metrics stubbed]"] / cpu_per_token["worker"]
        print(f"# metrics: worker / worker[metrics stubbed] = {on / off:.3f} in wall-clock tokens/s, {cpu_ratio:.3f} "
              f"in tokens per CPU-second (medians of {args.rounds} interleaved rounds); counting took "
              f"{counting['counting_us_per_step']:.1f} us of CPU per engine step, "
              f"{100 * counting['counting_share']:.3f}% of the steps' CPU time ({counting['steps']} steps, "
              f"{counting['calls']} counter calls); one "
              f"worker.metrics() snapshot {counting['snapshot_us']:.0f} us")
        results["metrics"] = {"on_over_stubbed": on / off, "on_over_stubbed_cpu": cpu_ratio, **counting}
    print(f"# peak RSS of the process: {_max_rss_mb():.0f} MiB")
    print(json.dumps({"benchmark": "rollout", "model": label, "params_m": round(params_m, 1), "dtype": args.dtype,
                      "device": device.type, "prompts": args.prompts, "n": args.n, "rounds": args.rounds,
                      "worker_startup_s": round(startup["worker"], 3), "generate_batch_startup_s": gb,
                      "results": results, "ratios": {k: round(v, 3) for k, v in ratios.items()},
                      "targets": targets, "peak_rss_mb": round(_max_rss_mb())}))


def config_of(args, attn: str) -> WorkerConfig:
    return WorkerConfig(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks,
                        attn_implementation=None if attn == "model" else attn)


def measure_counting(model, args, steps) -> dict:
    """Every step run once more on a worker whose counters time themselves: CPU seconds inside them (the calling
    thread's: a process stopped or descheduled meanwhile is not charged) over the process's CPU seconds (every
    thread's). The clock's own cost is charged to the counters: an upper bound."""
    from unittest import mock

    from rollout.engine.observe.counters import Counters

    spent = {"s": 0.0, "calls": 0, "steps": 0}

    class Timed(Counters):
        pass

    for name in ("sampled", "kv_step", "preempted", "row", "episode", "env_step", "weight_update"):
        def timed(self, *a, _f=getattr(Counters, name), _step=name == "kv_step"):
            start = time.thread_time()
            _f(self, *a)
            spent["s"] += time.thread_time() - start
            spent["calls"] += 1
            spent["steps"] += _step

        setattr(Timed, name, timed)
    with mock.patch("rollout.engine.engine.Counters", Timed):
        worker = RolloutWorker(model, config_of(args, args.workers.split(",")[0]))
    try:
        run_worker(worker, *steps[0], args.n)  # warm
        spent.update(s=0.0, calls=0, steps=0)
        start = time.process_time()
        for prompts, budgets in steps:
            run_worker(worker, prompts, budgets, args.n)
        cpu_s = time.process_time() - start
        snap = time.perf_counter()
        for _ in range(100):
            worker.metrics()
        snapshot_us = (time.perf_counter() - snap) / 100 * 1e6
    finally:
        worker.close()
    return {"counting_s": spent["s"], "cpu_s": cpu_s, "counting_share": spent["s"] / cpu_s, "calls": spent["calls"],
            "steps": spent["steps"], "counting_us_per_step": spent["s"] / max(spent["steps"], 1) * 1e6,
            "snapshot_us": snapshot_us}


def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    main()
