"""The worker's streaming hooks: `submit(..., on_tokens=...)` and `RolloutFuture.add_done_callback` (what the server
streams and awaits with)."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from rollout import RolloutWorker, SamplingParams, WorkerConfig


@pytest.fixture(scope="module")
def worker(tiny_path):
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16, max_batch_tokens=64)) as w:
        yield w


def collect():
    seen: dict[tuple[int, int], list] = {}
    lock = threading.Lock()

    def on_tokens(prompt_index, sample_index, ids, logprobs, versions, top):
        with lock:
            seen.setdefault((prompt_index, sample_index), []).append((list(ids), list(logprobs), list(versions)))

    return seen, on_tokens


def test_every_step_reports_the_row_so_far_and_the_row_completes_it(worker):
    seen, on_tokens = collect()
    params = SamplingParams(n=3, max_new_tokens=20, ignore_eos=True, seed=4)
    prompts = [[5, 6, 7, 8, 9], [11]]  # a 1-token prompt with n > 1: its samples are split, not forked
    batch = worker.submit(prompts, params, on_tokens=on_tokens).result(timeout=60)
    plain = worker.generate(prompts, params)
    assert batch.completion_token_lists() == plain.completion_token_lists()  # streaming changes nothing
    assert sorted(seen) == [(p, s) for p in range(2) for s in range(3)]
    for r, row in enumerate(batch.rows()):
        reports = seen[(row.prompt_index, row.sample_index)]
        assert [len(ids) for ids, _, _ in reports] == list(range(1, 20))  # the 20th comes with the row
        for ids, logprobs, versions in reports:
            n = len(ids)
            assert ids == row.completion_ids[:n] and logprobs == row.logprobs[:n] and versions == [0] * n


def test_streaming_is_refused_for_episodes_before_anything_runs(worker):
    with pytest.raises(ValueError, match="on_tokens"):
        worker.submit([[1, 2, 3]], env=lambda p, s: None, on_tokens=lambda *a: None)


def test_done_callbacks_run_once_for_finished_cancelled_and_late_registrations(worker):
    calls, ran = [], threading.Event()
    future = worker.submit([[3, 4, 5]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    future.add_done_callback(lambda f: (calls.append(("early", f.result().num_tokens)), ran.set()))
    future.result(timeout=60)
    assert ran.wait(10)  # on the supervisor thread, just after the result is ready (as concurrent.futures does)
    future.add_done_callback(lambda f: calls.append(("late", f.done())))  # already over: runs at once, here
    assert calls == [("early", 4), ("late", True)]
    long = worker.submit([[3, 4, 5]], SamplingParams(max_new_tokens=500, ignore_eos=True))
    cancelled = threading.Event()
    long.add_done_callback(lambda f: cancelled.set() if f.cancelled() else None)
    assert long.cancel() and cancelled.wait(10)
    with pytest.raises(CancelledError):
        long.result()


def test_a_restarted_engine_streams_the_row_again_from_its_first_token(tiny_path, inject_engine_fault):
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16, max_batch_tokens=64)) as w:
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, seed=9)
        expected = w.generate([[7, 8, 9]], params).completion_token_lists()[0]
        inject_engine_fault(at_step=6)
        seen, on_tokens = collect()
        batch = w.submit([[7, 8, 9]], params, on_tokens=on_tokens).result(timeout=60)
        assert w.engine.num_restarts == 1 and batch.completion_token_lists()[0] == expected
        lengths = [len(ids) for ids, _, _ in seen[(0, 0)]]
        assert lengths[0] == 1 and 1 in lengths[1:] and lengths[-1] == 11  # reported again from the start
        assert all(ids == expected[: len(ids)] for ids, _, _ in seen[(0, 0)])  # the same seeded tokens again
