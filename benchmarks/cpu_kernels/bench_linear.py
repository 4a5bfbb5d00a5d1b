"""The engine's linear layers on torch's kernel (its BLAS: MKL) against oneDNN's, per shape, on this machine.

    python benchmarks/cpu_kernels/bench_linear.py                  # the 25M test Llama's linears at 16-512 rows (~1 min)
    python benchmarks/cpu_kernels/bench_linear.py --hidden 1024 --intermediate 2816 --vocab 32768   # the 350M Qwen2's

What `WorkerConfig(cpu_linear=...)` chooses between (rollout/engine/kernels/onednn.py): for each (rows, in, out) shape of a
decode step, the best of 5 timed batches of `F.linear(x, w)` (torch) and of oneDNN's linear on the same live weight
(no packed copy), their GFLOP/s, the ratio, and each one's max |error| against a float64 product (unit-scale inputs,
weights of std 0.02). Prints the machine card first (GEMM rates and ISA flags) and a JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders
import machine  # benchmarks/machine.py: the GEMM rate and CPU flags
from rollout.engine.kernels import onednn


def best_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rows", default="16,48,128,512")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# machine: {machine.card()}")
    print(f"# torch {torch.__version__}, {args.threads} threads; oneDNN available: {onednn.available()}; "
          f"cpu_linear='auto' takes oneDNN here: {onednn.slow_blas()} (vendor {onednn.cpu_vendor() or '?'})")
    print(f"{'in':>6}{'out':>7}{'rows':>6}{'torch us':>10}{'GF/s':>7}{'oneDNN us':>11}{'GF/s':>7}{'ratio':>7}"
          f"{'err torch':>11}{'err oneDNN':>12}")
    shapes = [(args.hidden, args.intermediate), (args.intermediate, args.hidden), (args.hidden, args.hidden),
              (args.hidden, args.vocab)]
    results = []
    gen = torch.Generator().manual_seed(0)
    for k, n in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen)
            exact = x.double() @ w.double().T
            t_torch, t_dnn = best_us(lambda: F.linear(x, w)), best_us(lambda: onednn._linear(x, w, None))
            e_torch = (F.linear(x, w).double() - exact).abs().max().item()
            e_dnn = (onednn._linear(x, w, None).double() - exact).abs().max().item()
            flops = 2 * m * n * k / 1e3
            print(f"{k:>6}{n:>7}{m:>6}{t_torch:>10.1f}{flops / t_torch:>7.0f}{t_dnn:>11.1f}{flops / t_dnn:>7.0f}"
                  f"{t_torch / t_dnn:>6.2f}x{e_torch:>11.1e}{e_dnn:>12.1e}", flush=True)
            results.append(dict(k=k, n=n, rows=m, torch_us=round(t_torch, 1), onednn_us=round(t_dnn, 1),
                                err_torch=e_torch, err_onednn=e_dnn))
    print(json.dumps({"benchmark": "bench_linear", "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
