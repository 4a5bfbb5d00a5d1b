"""The engine's per-op kernels against torch's ops at the 25M model's shapes: what each one saves, per call.

    python benchmarks/cpu_kernels/bench_kernels.py            # ~1 min
    python benchmarks/cpu_kernels/bench_kernels.py --rows 4,16,64,256

Each row is the mean of a timed loop after a warm-up, both paths in the same process, back to back:
- RMSNorm (hidden 512): transformers' LlamaRMSNorm (torch's ops) against elementwise.rms_norm (the same bits);
- rotary (8 query heads, 4 KV heads, head dim 64): apply_rotary_pos_emb against elementwise.rotary (the same bits);
- KV write (4 KV heads x 64, into a 100k-row cache): the allocator's two index_copy_ against decode_kernel.paged_write;
- linear (oneDNN): the live weight against the packed one (onednn.PackedWeights), per shape of the 25M model;
- decode attention (GRPO-shaped: groups of n = 8 rows sharing 96 prompt tokens, then 64 or 400 tokens of their own;
  4 KV heads x 64, 2-4 query heads per KV head as in the 25M / ~100M / ~350M models; a 12-layer cache, one call per
  layer as the engine makes them, so each layer's keys come from memory, not the CPU cache): decode_kernel.c's
  portable loop (built with -mno-avx512f; the compiler's own vectorisation) against its AVX-512 path;
- OpenMP: a [rows, 768] add and a SiLU of [rows, 2048] on a second thread (as the engine's forward runs), first with
  the calling thread's OpenMP pool alive, then after openmp.release_callers_pool() (what the engine does at submit);
- forward: one 64-token forward of the 25M model with its linears on oneDNN, through a TorchFunctionMode (the engine
  until 2026-12-03) against the patched nn.Linear.forward (now).
Prints the machine card first (fp32 GEMM rate, CPU flags).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders
import machine  # benchmarks/machine.py: the GEMM rate and CPU flags
from rollout.engine.kernels import decode_kernel, elementwise, native, onednn, openmp
from rollout.engine.upstream import install_linear
from rollout.testing import build_tiny_model, load_tiny_model
from transformers.models.llama import modeling_llama


def mean_us(fn, seconds: float = 0.3) -> float:
    for _ in range(20):
        fn()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        count += 1
    return (time.perf_counter() - start) / count * 1e6


def line(name: str, rows: int, torch_us: float, ours_us: float) -> None:
    print(f"| {name} | {rows} | {torch_us:.1f} | {ours_us:.1f} | {torch_us / ours_us:.2f}x |")


def elementwise_rows(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 512, generator=g)
    norm = modeling_llama.LlamaRMSNorm(512)
    torch_norm = modeling_llama.LlamaRMSNorm.forward.__dict__.get("__wrapped__", modeling_llama.LlamaRMSNorm.forward)
    line("RMSNorm", rows, mean_us(lambda: torch_norm(norm, x)),
         mean_us(lambda: elementwise.rms_norm(x, norm.weight, norm.variance_epsilon)))
    q = torch.randn(1, rows, 8, 64, generator=g).transpose(1, 2)
    k = torch.randn(1, rows, 4, 64, generator=g).transpose(1, 2)
    cos, sin = torch.randn(1, rows, 64, generator=g), torch.randn(1, rows, 64, generator=g)
    line("rotary", rows, mean_us(lambda: elementwise._ORIGINAL_ROTARY(q, k, cos, sin)),
         mean_us(lambda: elementwise.rotary(q, k, cos, sin)))
    keys, values = torch.zeros(100_000, 4, 64), torch.zeros(100_000, 4, 64)
    index = torch.randperm(100_000, generator=g)[:rows]
    k_new, v_new = k[0].transpose(0, 1), torch.randn_like(k)[0].transpose(0, 1)

    def index_copy():
        keys.index_copy_(0, index, k_new)
        values.index_copy_(0, index, v_new)

    line("KV write", rows, mean_us(index_copy), mean_us(lambda: decode_kernel.paged_write(k_new, v_new, keys, values,
                                                                                          index)))


def decode_rows(rows: int, portable) -> None:
    g = torch.Generator().manual_seed(rows)
    page, n, prompt, layers = 16, 8, 96, 12
    for rep, own in ((2, 64), (3, 64), (4, 64), (3, 400)):
        lens, table, pages = [], [], 0
        for _ in range(max(1, rows // n)):
            shared = list(range(pages, pages + prompt // page))
            pages += len(shared)
            for _ in range(n):
                mine = list(range(pages, pages + own // page))
                pages += len(mine)
                table.append(shared + mine)
                lens.append(prompt + own)
        rows_here = len(lens)
        cache = [(torch.randn(pages * page, 4, 64, generator=g), torch.randn(pages * page, 4, 64, generator=g))
                 for _ in range(layers)]
        q = torch.randn(rows_here, 4 * rep, 64, generator=g)
        out = torch.empty_like(q)
        table_t, lens_t, positions = torch.tensor(table), torch.tensor(lens), torch.arange(rows_here)

        def step():  # one decode step's attention: every layer once
            for keys, values in cache:
                decode_kernel.paged_decode(q, keys, values, table_t, lens_t, positions, out, page, None)

        ours = mean_us(step, 1.0) / layers
        kernel = decode_kernel.load
        decode_kernel.load = lambda flags=(): portable
        try:
            base = mean_us(step, 1.0) / layers
        finally:
            decode_kernel.load = kernel
        line(f"decode attention, {rep} q heads / KV head, {prompt}+{own} keys (portable -> AVX-512)", rows_here,
             base, ours)


def openmp_rows(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, y, gate = torch.randn(rows, 768, generator=g), torch.randn(rows, 768, generator=g), torch.randn(rows, 2048)
    ops = {"add": lambda: x + y, "SiLU": lambda: torch.nn.functional.silu(gate)}

    def on_a_second_thread() -> dict[str, float]:
        box = {}
        worker = threading.Thread(target=lambda: box.update({k: mean_us(fn) for k, fn in ops.items()}))
        worker.start()
        worker.join()
        return box

    x + y  # the calling thread's pool exists, as after building a model or a training step
    alive = on_a_second_thread()
    openmp.release_callers_pool()
    released = on_a_second_thread()
    for name in ops:
        line(f"{name} on a second thread (caller's OpenMP pool alive -> released)", rows, alive[name], released[name])


def linear_rows(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    for out_f, in_f in ((1536, 512), (512, 1536), (8192, 512)):
        x, weight = torch.randn(rows, in_f, generator=g), torch.randn(out_f, in_f, generator=g) * 0.02
        packed = onednn.PackedWeights().packed(weight)
        line(f"linear {out_f}x{in_f} (live -> packed)", rows, mean_us(lambda: onednn._linear(x, weight, None)),
             mean_us(lambda: onednn._linear(x, packed, None)))


class _Mode(TorchFunctionMode):
    """The engine's linears as they were dispatched until 2026-12-03: a mode that sees every torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and onednn._eligible(args[0], args[1], args[2] if len(args) > 2 else
                                                                   kwargs.get("bias")):
            return onednn._bucketed_linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))
        return func(*args, **kwargs)


def forward_rows() -> None:
    model, _ = load_tiny_model(build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-25m", size="25m"))
    ids = torch.randint(10, 8000, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), _Mode():
        mode = mean_us(lambda: model(ids), 2.0)
    install_linear(onednn.FLAG, onednn.linear)  # what an engine that chose oneDNN does
    with torch.no_grad(), onednn.OneDNNLinears(_Live()):  # the live weights, as the mode read them: only the
        patched = mean_us(lambda: model(ids), 2.0)  # dispatch differs
    line("forward, 64 tokens (mode -> patched nn.Linear)", 64, mode, patched)


class _Live(onednn.PackedWeights):
    """Packs nothing: every linear reads its live weight."""

    def packed(self, weight):
        return weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4,16,64,128,512")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print(machine.card())
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; times in us, mean of a 0.3 s loop")
    print("| op | rows | torch | ours | speed-up |\n| --- | ---: | ---: | ---: | ---: |")
    rows = [int(r) for r in args.rows.split(",")]
    if elementwise.load() is not None and decode_kernel.load() is not None:
        for r in rows:
            elementwise_rows(r)
        portable = decode_kernel.load(("-mno-avx512f",)) if "avx512f" in native.cpuinfo("flags").split() \
            else None
        for r in (r for r in rows if portable is not None and r >= 8):
            decode_rows(r, portable)
    else:
        print("# no C compiler here: the fused kernels are not built")
    if openmp.torch_runtime() is not None and torch.get_num_threads() > 1:
        for r in rows:
            openmp_rows(r)
    if onednn.available():
        for r in rows:
            linear_rows(r)
        forward_rows()


if __name__ == "__main__":
    main()
