"""TurnTrace: the time from an environment's answer to the next turn's first token, and the engine idling while a
turn is ready, as bench_episodes.py reports them."""

from __future__ import annotations

import pytest
import torch

from rollout import RolloutWorker, SamplingParams, Turn, WorkerConfig
from rollout.engine import TurnTrace
from rollout.engine.trace import idle_while_waiting


def test_idle_while_waiting_counts_only_waits_outside_every_step():
    steps = [(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)]
    # a wait inside steps: no idle; one spanning the gap 2-3: 1 s; two overlapping waits in the gap count once
    assert idle_while_waiting([(0.5, 1.5)], steps) == 0.0
    assert idle_while_waiting([(1.5, 3.5)], steps) == pytest.approx(1.0)
    assert idle_while_waiting([(2.2, 2.6), (2.4, 2.8), (5.0, 5.5)], steps) == pytest.approx(0.6 + 0.5)
    assert idle_while_waiting([], steps) == 0.0 and idle_while_waiting([(0.0, 1.0)], []) == 1.0


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
