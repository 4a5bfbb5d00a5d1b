"""RolloutFleet on this machine: rollout throughput with 1 and 2 Ray actors, and weight-broadcast time.

    python benchmarks/fleet/bench_fleet.py            # 25M model, 8 prompts x 8 samples, 2 timed rounds; 100M broadcast
    python benchmarks/fleet/bench_fleet.py --quick    # tiny model, 4 x 4, 1 round, broadcast of the 25M model (smoke run)

Throughput: one GRPO-shaped step (P prompts of lengths in [16, 96], N samples each at temperature 1.0, each prompt a
completion budget drawn in [gen-min, gen-max], `ignore_eos=True` since the random model's EOS is meaningless), run
four ways, interleaved round by round so machine noise hits them alike (medians shown):
- worker: one in-process `RolloutWorker` with torch using every core (the ceiling a 1-node fleet is judged against);
- fleet x1: one actor, torch using every core;
- fleet x2: two actors, torch using cores / 2 each (default chunks_per_worker=1: one engine batch per actor);
- fleet x2, 2 chunks: the same with chunks_per_worker=2 (each actor's share in 2 chunks: a faster actor can take
  more and a death loses less, at the price of smaller engine batches and a ragged tail per chunk).
Every method gets one warm-up step first. Useful tokens/s = completion tokens asked / wall time of the step.

Broadcast: a full state dict of the `--broadcast-size` model (default 100m, ~0.1 B params, fp32) to a fleet of 2,
best of `--repeats` for every figure (a floor is what is compared; on a shared machine medians of memory-bound
copies swing by 10x with the neighbours' load):
- plain copy: `dst.copy_(src)` of every tensor in this process, once, on one thread: the floor (one read + one
  write of the bytes);
- object store: `fleet.update_weights` (one `ray.put`, each actor reads and applies it, versions and fingerprints
  of both actors checked before it returns);
- ray.put only: the object-store path's one copy into shared memory (the rest is the actors reading, validating
  and applying, then the check);
- gloo group: the same over a torch.distributed gloo group (bucketed broadcast; the group is opened once, untimed);
- verify only: `fleet.weights_fingerprint()` (the sha256 of every weight on each actor, in parallel), the share of
  the two figures above that is the check rather than the transfer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
import transformers

import ray
from rollout import RolloutFleet, RolloutWorker, SamplingParams, WorkerConfig
from rollout.fleet.actor import to_shared
from rollout.testing import SIZES, build_tiny_model, load_tiny_model


def workload(num_prompts: int, n: int, gen_min: int, gen_max: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for _ in range(num_prompts):
        length = int(torch.randint(16, 97, (1,), generator=gen))
        prompts.append(torch.randint(10, vocab, (length,), generator=gen).tolist())
        budget = int(torch.randint(gen_min, gen_max + 1, (1,), generator=gen))
        params.append(SamplingParams(n=n, temperature=1.0, max_new_tokens=budget, ignore_eos=True))
    return prompts, params


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def throughput(path, config: WorkerConfig, args) -> dict:
    vocab = SIZES[args.size][5]
    prompts, params = workload(args.prompts, args.n, args.gen_min, args.gen_max, vocab)
    tokens = sum(p.n * p.max_new_tokens for p in params)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    cpus = {"num_cpus": 0.1}  # three fleets live at once here: the default share assumes one fleet per cluster
    methods = {
        "worker": RolloutWorker(path, config),
        "fleet x1": RolloutFleet(path, num_workers=1, config=config, resources=dict(cpus, torch_threads=cores)),
        "fleet x2": RolloutFleet(path, num_workers=2, config=config,
                                 resources=dict(cpus, torch_threads=max(1, cores // 2))),
        "fleet x2, 2 chunks": RolloutFleet(path, num_workers=2, config=config, chunks_per_worker=2,
                                          resources=dict(cpus, torch_threads=max(1, cores // 2))),
    }
    times = {name: [] for name in methods}
    try:
        for name, method in methods.items():  # warm-up
            batch = method.generate(prompts, params)
            assert batch.num_tokens == tokens, (name, batch.num_tokens, tokens)
        for _ in range(args.rounds):
            for name, method in methods.items():
                times[name].append(timed(lambda: method.generate(prompts, params)))
    finally:
        for method in methods.values():
            method.close()
    return {name: {"seconds": statistics.median(t), "tokens_per_s": tokens / statistics.median(t)}
            for name, t in times.items()} | {"tokens": tokens}


def broadcast(size: str, config: WorkerConfig, repeats: int, tmp: str) -> dict:
    path = build_tiny_model(os.path.join(tmp, size), size=size)
    model, _ = load_tiny_model(path)
    gen = torch.Generator().manual_seed(1)
    states = [{k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
              for _ in range(2)]
    num_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    params = sum(t.numel() for t in states[0].values())
    dst = {k: torch.empty_like(v) for k, v in states[0].items()}

    def plain_copy(state):  # one thread, like ray.put's memcpy (an OpenMP copy stalls on a busy 2-core machine)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        for k, v in state.items():
            dst[k].copy_(v)
        torch.set_num_threads(threads)

    out = {"params": params, "bytes": num_bytes}
    with RolloutFleet(path, num_workers=2, config=config) as fleet:
        version = 0

        def update(i):
            nonlocal version
            version += 1
            fleet.update_weights(states[i % 2], version=version)

        out["object store"] = min(timed(lambda: update(i)) for i in range(repeats))
        out["ray.put only"] = min(timed(lambda: ray.put(to_shared(states[i % 2].items()))) for i in range(repeats))
        out["verify only"] = min(timed(fleet.weights_fingerprint) for _ in range(repeats))
        out["group open"] = timed(lambda: fleet.init_weight_group("gloo"))
        out["gloo group"] = min(timed(lambda: update(i)) for i in range(repeats))
        out["plain copy"] = min(timed(lambda: plain_copy(states[i % 2])) for i in range(repeats))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="25m", choices=sorted(SIZES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--gen-min", type=int, default=16)
    parser.add_argument("--gen-max", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--broadcast-size", default="100m", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.size, args.prompts, args.n, args.gen_max, args.rounds = "tiny", 4, 4, 32, 1
        args.broadcast_size, args.repeats = "25m", 1
    config = WorkerConfig()
    load = os.getloadavg()[0]
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = build_tiny_model(os.path.join(tmp, args.size), size=args.size)
            tput = throughput(path, config, args)
            bcast = broadcast(args.broadcast_size, config, args.repeats, tmp)
    finally:
        ray.shutdown()

    print(f"# bench_fleet: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (load avg "
          f"{load:.1f} at start), torch {torch.__version__}, transformers {transformers.__version__}, ray "
          f"{ray.__version__}")
    print(f"# throughput: {args.size} model, {args.prompts} prompts x {args.n} samples, budgets "
          f"[{args.gen_min}, {args.gen_max}], {tput['tokens']} tokens/step, median of {args.rounds} rounds; "
          f"WorkerConfig defaults")
    print("| method | s/step | useful tokens/s | vs worker | vs fleet x1 |")
    print("|---|---|---|---|---|")
    for name in ("worker", "fleet x1", "fleet x2", "fleet x2, 2 chunks"):
        r = tput[name]
        print(f"| {name} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / tput['worker']['tokens_per_s']:.2f}x | "
              f"{r['tokens_per_s'] / tput['fleet x1']['tokens_per_s']:.2f}x |")
    print(f"\n# broadcast: {args.broadcast_size} model, {bcast['params'] / 1e6:.1f} M params, "
          f"{bcast['bytes'] / 2**20:.0f} MiB fp32, fleet of 2 actors, best of {args.repeats}; "
          f"gloo group opened once in {bcast['group open']:.2f} s")
    print("| path | seconds | GB/s (of the state dict) | vs plain copy |")
    print("|---|---|---|---|")
    for name in ("plain copy", "object store", "ray.put only", "gloo group", "verify only"):
        print(f"| {name} | {bcast[name]:.3f} | {bcast['bytes'] / bcast[name] / 1e9:.2f} | "
              f"{bcast[name] / bcast['plain copy']:.1f}x |")
    print(json.dumps({"bench": "fleet", "size": args.size, "broadcast_size": args.broadcast_size,
                      "throughput": tput, "broadcast": bcast, "load_avg": load}))


if __name__ == "__main__":
    main()
