"""The OpenMP pools (rollout/engine/kernels/openmp.py): the thread that submits a call lets its idle workers go, so the engine
thread's parallel ops are not throttled; the decode kernel runs on the engine thread's own OpenMP team, with the same
results as on its own POSIX threads."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest
import torch

from rollout.engine.kernels import decode_kernel, openmp

needs_libgomp = pytest.mark.skipif(openmp.torch_runtime() is None, reason="torch here does not run on libgomp")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _until(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@needs_libgomp
def test_releasing_a_threads_pool_lets_its_workers_exit_and_they_come_back_on_use():
    before = torch.get_num_threads()
    x = torch.randn(512, 2048)
    box = {}

    def on_a_fresh_thread():  # a thread with no pool yet, as a trainer's thread before its first op
        torch.set_num_threads(3)
        start = _threads()
        (x + x).sum()  # a parallel region: libgomp starts this thread's workers
        box["grown"] = _threads() - start
        box["released"] = openmp.release_callers_pool()
        box["gone"] = _until(lambda: _threads() == start)
        (x * 2).sum()  # used again: the workers are started again
        box["back"] = _threads() - start
        openmp.release_callers_pool()

    worker = threading.Thread(target=on_a_fresh_thread)
    worker.start()
    worker.join()
    torch.set_num_threads(before)
    assert box == {"grown": 2, "released": True, "gone": True, "back": 2}


def test_without_libgomp_or_with_the_switch_off_nothing_is_released(monkeypatch):
    monkeypatch.setenv("ROLLOUT_OPENMP", "0")
    openmp._runtimes.cache_clear()
    try:
        assert openmp._runtimes() == () and openmp.torch_runtime() is None
        assert openmp.release_callers_pool() is False
    finally:
        openmp._runtimes.cache_clear()


@needs_libgomp
@pytest.mark.skipif(decode_kernel.load() is None, reason="no C compiler: the kernel cannot be built")
def test_the_decode_kernel_on_the_openmp_team_equals_it_on_its_own_threads():
    g = torch.Generator().manual_seed(0)
    rows, page, lens = 40, 16, [1 + 13 * r for r in range(40)]
    pages = sum(-(-n // page) for n in lens)
    keys, values = torch.randn(pages * page, 4, 64, generator=g), torch.randn(pages * page, 4, 64, generator=g)
    table = torch.zeros(rows, max(-(-n // page) for n in lens), dtype=torch.int64)
    used = 0
    for r, n in enumerate(lens):
        count = -(-n // page)
        table[r, :count] = torch.arange(used, used + count)
        used += count
    q = torch.randn(rows, 12, 64, generator=g)
    outs = []
    lib = decode_kernel.load()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for team in (True, False):
            if not team:
                lib.use_openmp(None)  # the kernel's POSIX threads
            out = torch.empty_like(q)
            assert decode_kernel.paged_decode(q, keys, values, table, torch.tensor(lens), torch.arange(rows), out,
                                              page, 1 / math.sqrt(64))
            outs.append(out)
    finally:
        openmp.hand_over(lib)  # back on the team, as decode_kernel.load() left it
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])  # a row's result does not depend on which thread ran it
