"""What a benchmark's figures depend on, printed with them: the machine's fp32 GEMM rate and its vector ISA flags
(machines of this project's kind differ by 3x in GEMM speed, and a default tuned on one can lose on another)."""

from __future__ import annotations

import os
import platform
import time


def gemm_gflops(kernel: str = "torch") -> float:
    """fp32 GFLOP/s of a 512 x 2048 @ 2048 x 2048 matmul on the current torch threads (mean of 20, after one), with
    torch's own kernel (its BLAS: MKL) or oneDNN's (`rollout.engine.kernels.onednn`; 0 where this torch has none)."""
    import torch

    a, b = torch.randn(512, 2048), torch.randn(2048, 2048)
    if kernel == "onednn":
        from rollout.engine.kernels import onednn

        if not onednn.available():
            return 0.0
        weight = b.T.contiguous()
        run = lambda: onednn._linear(a, weight, None)  # noqa: E731
    else:
        run = lambda: a @ b  # noqa: E731
    run()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        run()
    return 2 * 512 * 2048 * 2048 * reps / (time.perf_counter() - start) / 1e9


def cpu_flags() -> str:
    """The vector ISA flags that pick MKL's and oneDNN's kernels (AVX2, AVX-512, AVX-512 BF16, AMX)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "?"
    return " ".join(sorted(f for f in flags if f.startswith(("avx512f", "avx512_bf16", "amx", "avx2"))))


def cpu_model() -> str:
    try:
        line = next(line for line in open("/proc/cpuinfo") if line.startswith("model name"))
        return line.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def card() -> str:
    """One line: the CPU, its cores, the GEMM rate and the flags."""
    return (f"{cpu_model()}, {os.cpu_count()} cpus, fp32 GEMM {gemm_gflops():.0f} GFLOP/s torch, "
            f"{gemm_gflops('onednn'):.0f} oneDNN (512x2048x2048), flags: {cpu_flags()}")
