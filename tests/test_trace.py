"""TurnTrace: the time from an environment's answer to the next turn's first token, and the engine idling while a
turn is ready, as bench_episodes.py reports them."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from rollout import RolloutWorker, SamplingParams, Turn, WorkerConfig
from rollout.engine import TurnTrace
from rollout.engine.episodes.episode import Episode
from rollout.engine.episodes.stepper import Stepper
from rollout.engine.observe.trace import idle_while_waiting, wait_parts


def test_idle_while_waiting_counts_only_waits_outside_every_step():
    steps = [(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)]
    # a wait inside steps: no idle; one spanning the gap 2-3: 1 s; two overlapping waits in the gap count once
    assert idle_while_waiting([(0.5, 1.5)], steps) == 0.0
    assert idle_while_waiting([(1.5, 3.5)], steps) == pytest.approx(1.0)
    assert idle_while_waiting([(2.2, 2.6), (2.4, 2.8), (5.0, 5.5)], steps) == pytest.approx(0.6 + 0.5)
    assert idle_while_waiting([], steps) == 0.0 and idle_while_waiting([(0.0, 1.0)], []) == 1.0


def test_wait_parts_split_each_wait_into_the_boundary_the_steps_begun_and_the_tokens_step():
    steps = [(0.0, 1.0), (1.1, 2.0), (2.1, 4.0), (4.1, 4.5)]
    # ready at 0.5 (step 0 running): 0.6 s to step 1's start, its token after step 1 (0.9 s long): 1 step begun;
    # ready at 1.5: 0.6 s to step 2's start, token after step 3 (0.4 s): 2 steps begun; ready at 2.05: 0.05 s to
    # step 2's start, token after it (1.9 s): 1 step begun
    parts = wait_parts([(0.5, 2.05), (1.5, 4.6), (2.05, 4.05)], steps)
    assert parts["boundary_p50_s"] == pytest.approx(0.6)
    assert parts["steps_started_p50"] == 1.0
    assert parts["token_step_p50_s"] == pytest.approx(0.9)
    assert wait_parts([], steps) == {"boundary_p50_s": 0.0, "steps_started_p50": 0.0, "token_step_p50_s": 0.0}


class _Slow:
    def __init__(self, seconds: float, started: threading.Event) -> None:
        self.seconds, self.started = seconds, started

    def step(self, completion_ids):
        self.started.set()
        time.sleep(self.seconds)
        return Turn([5], done=True)


def _episode(env) -> Episode:
    episode = Episode(lambda p, s: env, max_turns=2, max_tokens=64, vocab_size=100, prompt=[1, 2])
    episode.env, episode.last_turn = env, [3]
    return episode


def test_a_plain_steps_outcome_is_handed_over_on_its_pool_thread_while_the_event_loop_is_busy():
    stepper, started, outcomes = Stepper(4), threading.Event(), []
    try:
        begin = time.perf_counter()
        def record(turn, error, seconds):
            outcomes.append((turn, error, seconds, threading.current_thread().name, time.perf_counter() - begin))

        stepper.step(_episode(_Slow(0.2, started)), 0, 0, None, record)
        assert started.wait(10)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), stepper._loop)  # the loop is free until now...
        blocker = asyncio.run_coroutine_threadsafe(_block(2.0), stepper._loop)  # ...then held for 2 s
        deadline = time.perf_counter() + 1.5
        while not outcomes and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert len(outcomes) == 1, "the outcome waited for the event loop"
        turn, error, seconds, thread, at = outcomes[0]
        assert error is None and turn.observation_ids == [5] and 0.2 <= seconds < 1.5 and at < 1.5
        assert thread.startswith("rollout-env") and thread != "rollout-env-loop"
        blocker.result(10)
        time.sleep(0.1)
        assert len(outcomes) == 1  # the loop's copy of the same outcome was dropped
    finally:
        stepper.shutdown()


async def _block(seconds: float) -> None:
    time.sleep(seconds)  # holds the event loop's thread, as a busy loop would


def test_a_sync_step_past_its_timeout_gives_one_outcome_the_timeout_and_its_late_return_is_dropped():
    stepper, started, outcomes = Stepper(2), threading.Event(), []
    try:
        stepper.step(_episode(_Slow(0.6, started)), 0, 0, 0.2, lambda *outcome: outcomes.append(outcome))
        time.sleep(1.2)  # past the timeout and past the step's own return
        assert len(outcomes) == 1
        turn, error, seconds = outcomes[0]
        assert turn is None and isinstance(error, TimeoutError) and 0.2 <= seconds < 0.6
    finally:
        stepper.shutdown()


class Echo:
    def __init__(self, prompt_index, sample_index):
        self.turns = 0

    def step(self, completion_ids):
        self.turns += 1
        return Turn([11, 12, 13], done=self.turns == 3)


def test_a_traced_call_times_every_turn_after_the_first_and_an_untraced_one_records_nothing(tiny):
    model, _ = tiny
    prompts = [torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 30)]
    params = SamplingParams(n=2, max_new_tokens=4, ignore_eos=True)
    with RolloutWorker(model, WorkerConfig(page_size=16)) as worker:
        worker.engine.trace = trace = TurnTrace()
        worker.generate(prompts, params, env=Echo, max_turns=3)
        worker.engine.trace = None
        worker.generate(prompts, params, env=Echo, max_turns=3)
    summary = trace.summary()
    assert summary["turns"] == 4 * 2  # 4 episodes, turns 2 and 3 each
    assert all(0 < b - a < 30 for a, b in trace.waits)
    # a turn's first token comes after a whole step that started once its observation was ready (its prefill)
    assert all(any(a <= s and e <= b for s, e in trace.steps) for a, b in trace.waits)
    assert summary["steps"] >= 3 * 4 and 0 <= summary["idle_with_ready_fraction"] < 1
