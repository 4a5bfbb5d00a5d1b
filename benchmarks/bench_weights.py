"""Cost of refresh() and update_weights() against the floor: a plain torch copy of the same bytes.

    python benchmarks/bench_weights.py            # tiny and ~100M models, about a minute on 2 cores
    python benchmarks/bench_weights.py --sizes tiny

refresh() on a shared model copies nothing: its cost is the fence (pause the engine loop, forget prefix hashes).
update_weights() validates every tensor (name, shape, finite) before copying in place; fingerprint() hashes all
bytes. Figures are medians of --repeats runs, ratios against the plain copy measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from rollout import RolloutWorker, WorkerConfig
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
        fingerprint = median_seconds(worker.weights_fingerprint, max(1, repeats // 2))
    return {"size": size, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "mbytes": round(nbytes / 2**20, 1), "plain_copy_s": plain, "refresh_s": refresh,
            "update_weights_s": update, "update_stream_s": stream, "fingerprint_s": fingerprint,
            "update_over_copy": update / plain, "refresh_over_copy": refresh / plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,100m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
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
