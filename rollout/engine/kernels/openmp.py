"""The OpenMP runtime's thread pools, as they meet the engine's thread.

torch's CPU ops run their parallel regions on GNU OpenMP (libgomp), which keeps one pool of worker threads per thread
that opens regions. The engine's forward runs on its own thread, so a process that has run torch ops on the caller's
thread (building the model, a training step) holds two pools. Once libgomp manages more threads than there are CPUs,
it throttles every pool: a worker spins ~100 iterations after a region instead of ~300000, then sleeps on a futex,
and each of the forward's next regions wakes it with a system call. Measured on a 2-core machine: a [128, 768] add on
a second thread took 15-100 us with the first thread's pool alive and 7-8 us without it (benchmarks/cpu_kernels/bench_kernels.py,
its "on a second thread" rows), and a whole forward has hundreds of such regions.

`release_callers_pool()` releases the calling thread's pool (OpenMP 5.0's `omp_pause_resource_all`, soft: libgomp
lets that thread's idle workers exit). The engine calls it on the thread that submits a call, which then waits for
the result or submits more; if that thread runs parallel ops again, libgomp starts its workers again (~0.1 ms), and
both pools share the CPUs as they would anyway. `hand_over(lib)` gives a C kernel (decode_kernel.c, elementwise.c)
the libgomp torch runs on (`torch_runtime()`), so its splits run on the engine thread's own team. Only libgomp is touched (the runtime of
torch's Linux wheels); with another runtime, none at all, or `ROLLOUT_OPENMP=0`, nothing is released and the kernels
keep POSIX threads of their own.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

PAUSE_SOFT = 1  # omp_pause_soft


@functools.lru_cache(maxsize=1)
def _runtimes() -> tuple[tuple[str, ctypes.CDLL], ...]:
    """Every libgomp loaded in this process that has omp_pause_resource_all (libgomp >= 9), with its path."""
    if os.environ.get("ROLLOUT_OPENMP", "1") == "0":
        return ()
    paths = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libgomp" in os.path.basename(path) and ".so" in path:
                    paths.add(path)
    except OSError:  # not Linux
        return ()
    found = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD if hasattr(os, "RTLD_NOLOAD") else 0)
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        found.append((path, lib))
    return tuple(found)


def torch_runtime() -> ctypes.CDLL | None:
    """The libgomp torch runs its parallel ops on (the one in torch's folder where several are loaded), or None."""
    runtimes = _runtimes()
    home = os.path.dirname(os.path.dirname(torch.__file__))
    mine = [lib for path, lib in runtimes if path.startswith(home)]
    return (mine or [lib for _, lib in runtimes] or [None])[0]


def hand_over(lib: ctypes.CDLL) -> None:
    """Give a C kernel's library torch's `GOMP_parallel` (its `use_openmp`), so it splits work over the calling
    thread's OpenMP team; without a libgomp here it keeps POSIX threads of its own."""
    runtime = torch_runtime()
    if runtime is not None:
        lib.use_openmp.argtypes = [ctypes.c_void_p]
        lib.use_openmp(ctypes.cast(runtime.GOMP_parallel, ctypes.c_void_p))


def release_callers_pool() -> bool:
    """Let the calling thread's idle OpenMP workers exit (see the module docstring). True where a libgomp did so;
    False where there is none here, or the caller is inside a parallel region (then nothing changes)."""
    done = False
    for _, lib in _runtimes():
        done |= lib.omp_pause_resource_all(PAUSE_SOFT) == 0
    return done
