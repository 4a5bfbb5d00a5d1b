"""Cost of refresh() and update_weights() against the floor: a plain torch copy of the same bytes.

    python benchmarks/fleet/bench_weights.py            # tiny and ~100M models, about a minute on 2 cores
    python benchmarks/fleet/bench_weights.py --sizes tiny
    python benchmarks/fleet/bench_weights.py --lora     # 25M model, rank-8 LoRA on every projection: adapter-only vs full

refresh() on a shared model copies nothing: its cost is the fence (pause the engine loop, forget prefix hashes).
update_weights() validates every tensor (name, shape, finite) before copying in place; fingerprint() hashes all
bytes. Figures are medians of --repeats runs, ratios against the plain copy measured in the same run.

--lora: a PEFT model (rank-8 adapters on every attention and MLP projection, `trainers_integration.lora`) and what
one sync after an optimizer step moves and costs: the full state dict against the adapter alone (PEFT's names,
`get_peft_model_state_dict`, what the trainers send). On a worker holding its own copy, and on a RolloutFleet of
--fleet-workers actors built from the PEFT model (object store; and, with --group, the gloo weight group).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from rollout import RolloutWorker, WorkerConfig
from rollout.model.weights import fingerprint as full_fingerprint
from rollout.testing import build_tiny_model, load_tiny_model


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(size: str, repeats: int) -> dict:
    path = build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-{size}", size=size)
    model, _ = load_tiny_model(path)
    source = {n: t.detach().clone() for n, t in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in source.values())
    targets = dict(model.state_dict())
    with RolloutWorker(model, WorkerConfig(num_blocks=64)) as worker:
        worker.generate([[1, 2, 3]])
        plain = median_seconds(lambda: [targets[n].copy_(t) for n, t in source.items()], repeats)
        refresh = median_seconds(worker.refresh, repeats)
        update = median_seconds(lambda: worker.update_weights(source), repeats)
        stream = median_seconds(lambda: worker.update_weights(iter(source.items())), repeats)
        fingerprint = median_seconds(lambda: full_fingerprint(model), max(1, repeats // 2))  # every byte (a
        # worker's own weights_fingerprint() re-reads only what changed since its last call)
    return {"size": size, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "mbytes": round(nbytes / 2**20, 1), "plain_copy_s": plain, "refresh_s": refresh,
            "update_weights_s": update, "update_stream_s": stream, "fingerprint_s": fingerprint,
            "update_over_copy": update / plain, "refresh_over_copy": refresh / plain}


def nbytes(weights: dict) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def measure_lora(size: str, rank: int, repeats: int, fleet_workers: int, group: bool) -> list[dict]:
    import copy

    from trainers_integration.lora import PROJECTIONS, add_lora, trainable
    from trainers_integration.rollouts import policy_weights

    path = build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-{size}", size=size)
    model, _ = load_tiny_model(path)
    policy = add_lora(model, rank=rank, seed=0)
    with torch.no_grad():
        for param in trainable(policy):  # a trained-looking adapter (LoRA's B starts at zero)
            param.normal_(0, 0.02)
    full = {n: t.detach().clone() for n, t in policy.state_dict().items()}
    adapter = policy_weights(policy)
    payloads = {"full state dict": full, "adapter only": adapter}
    rows = []
    with RolloutWorker(copy.deepcopy(policy), WorkerConfig(num_blocks=64)) as worker:
        worker.generate([[1, 2, 3]])
        for what, weights in payloads.items():
            rows.append(dict(where="worker (own copy)", what=what, tensors=len(weights), mbytes=nbytes(weights) / 2**20,
                             seconds=median_seconds(lambda w=weights: worker.update_weights(w), repeats)))
    if fleet_workers:
        from rollout import RolloutFleet

        with RolloutFleet(policy, num_workers=fleet_workers, config=WorkerConfig(num_blocks=64)) as fleet:
            transports = [("object store", None)] + ([("gloo group", "gloo")] if group else [])
            for transport, backend in transports:
                if backend is not None:
                    fleet.init_weight_group(backend)
                for what, weights in payloads.items():
                    seconds = median_seconds(lambda w=weights: fleet.update_weights(w), repeats)
                    rows.append(dict(where=f"fleet x{fleet_workers} ({transport})", what=what, tensors=len(weights),
                                     mbytes=nbytes(weights) / 2**20, seconds=seconds))
            assert fleet.weights_fingerprint() == full_fingerprint(policy)
    params = sum(p.numel() for p in policy.parameters())
    print(f"# lora card: {size} Llama, {params / 1e6:.1f}M params; rank-{rank} LoRA on {','.join(PROJECTIONS)}: "
          f"{sum(p.numel() for p in trainable(policy)) / 1e6:.2f}M adapter params; fp32, cpu, "
          f"threads={torch.get_num_threads()}, medians of {repeats}")
    print(f"{'where':<28}{'update':<18}{'tensors':>8}{'MiB':>9}{'ms':>10}{'vs full':>9}")
    for r in rows:
        base = next(x for x in rows if x["where"] == r["where"] and x["what"] == "full state dict")
        r["vs_full"] = r["seconds"] / base["seconds"]
        print(f"{r['where']:<28}{r['what']:<18}{r['tensors']:>8}{r['mbytes']:>9.2f}{r['seconds'] * 1e3:>10.1f}"
              f"{r['vs_full']:>8.3f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,100m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lora", action="store_true", help="adapter-only against full updates (see above)")
    parser.add_argument("--lora-size", default="25m")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--fleet-workers", type=int, default=2, help="0: skip the fleet")
    parser.add_argument("--group", action="store_true", help="also time the fleet's gloo weight group")
    args = parser.parse_args()
    if args.lora:
        rows = measure_lora(args.lora_size, args.lora_rank, args.repeats, args.fleet_workers, args.group)
        print(json.dumps({"benchmark": "weights_lora", "size": args.lora_size, "rank": args.lora_rank,
                          "results": rows}))
        return
    print(f"# weights card: sizes={args.sizes} repeats={args.repeats} torch={torch.__version__} "
          f"threads={torch.get_num_threads()} device=cpu fp32")
    rows = [measure(size, args.repeats) for size in args.sizes.split(",")]
    print(f"{'size':<6}{'params':>8}{'MiB':>8}{'copy ms':>10}{'refresh ms':>12}{'update ms':>11}{'stream ms':>11}"
          f"{'update/copy':>13}{'fprint ms':>11}")
    for r in rows:
        print(f"{r['size']:<6}{r['params_m']:>7}M{r['mbytes']:>8}{r['plain_copy_s'] * 1e3:>10.2f}"
              f"{r['refresh_s'] * 1e3:>12.2f}{r['update_weights_s'] * 1e3:>11.2f}{r['update_stream_s'] * 1e3:>11.2f}"
              f"{r['update_over_copy']:>12.2f}x{r['fingerprint_s'] * 1e3:>11.1f}")
    print(json.dumps({"benchmark": "weights", "results": rows}))


if __name__ == "__main__":
    main()
