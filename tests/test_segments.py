"""Episodes whose environment restarts the next turn from new context_ids: one exact row per segment, per-turn rewards
on the right tokens, bad contexts ending only their own episode."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import PAGE, TOL, prompts_of, reference_logprobs

from rollout import RolloutBatch, RolloutWorker, SamplingParams, Turn, WorkerConfig
from rollout.base.batch import Row


@pytest.fixture(scope="module")
def worker(episodes_worker):
    return episodes_worker


class Rewriter:
    """A chat whose template drops earlier reasoning: after turn k the next context is the prompt, then each earlier
    turn's last two tokens only (its "answer"), then an observation that depends on the episode and the turn. Turns
    listed in `append_at` answer with a plain observation instead (the segment goes on). Reward k + 1 at turn k."""

    def __init__(self, prompts: list[list[int]], prompt_index: int, sample_index: int,
                 append_at: tuple[int, ...] = ()) -> None:
        self.prompt, self.key, self.append_at = prompts[prompt_index], (prompt_index, sample_index), append_at
        self.turns: list[list[int]] = []
        self.contexts: list[list[int]] = []

    def observation(self) -> list[int]:
        p, s = self.key
        return [(30 + 5 * p + 3 * s + 13 * len(self.turns) + i) % 480 + 10 for i in range(7)]

    def step(self, completion_ids: list[int]) -> Turn:
        self.turns.append(list(completion_ids))
        reward = float(len(self.turns))
        if len(self.turns) in self.append_at:
            return Turn(observation_ids=self.observation(), reward=reward)
        context = list(self.prompt)
        for turn in self.turns:
            context += turn[-2:] + self.observation()
        self.contexts.append(context)
        return Turn(context_ids=context, reward=reward)


class Maker:
    def __init__(self, cls=Rewriter, prompts=None, **kwargs) -> None:
        self.cls, self.prompts, self.kwargs, self.envs = cls, prompts, kwargs, {}
        self.lock = threading.Lock()

    def __call__(self, prompt_index: int, sample_index: int):
        env = self.cls(self.prompts, prompt_index, sample_index, **self.kwargs)
        with self.lock:
            self.envs[(prompt_index, sample_index)] = env
        return env


def assert_exact_rows(model, batch: RolloutBatch, temperature: float = 1.0) -> None:
    """Every model token's logprob equals a teacher-forced forward of its own row: the segment's prompt and
    completion; observation tokens carry 0.0, version -1 and a False action mask."""
    for r in range(len(batch)):
        n = int(batch.completion_lengths[r])
        full, _ = reference_logprobs(model, batch.prompt_ids[r], batch.completion_ids[r, :n].tolist(), temperature)
        action = batch.action_mask[r, :n]
        assert action.any(), r
        gap = float((batch.logprobs[r, :n][action] - full[action]).abs().max())
        assert gap <= TOL, (r, gap)
        assert (batch.logprobs[r, :n][~action] == 0).all() and (batch.token_versions[r, :n][~action] == -1).all()


def test_every_segment_is_a_row_exact_against_a_forward_of_its_own_prompt(worker):
    prompts = prompts_of([21, 40, 1])
    make_env = Maker(prompts=prompts)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, ignore_eos=True, seed=3)
    before = worker.metrics()
    batch = worker.generate(prompts, params, env=make_env, max_turns=3)
    after = worker.metrics()
    assert len(batch) == 3 * 2 * 3  # 6 episodes of 3 turns, each restarted after turns 1 and 2
    # the metrics count every row the batch holds, and each episode once
    assert after.rows_finished.get("max_turns", 0) - before.rows_finished.get("max_turns", 0) == 18
    assert after.episodes_finished.get("max_turns", 0) - before.episodes_finished.get("max_turns", 0) == 6
    assert after.generated_tokens - before.generated_tokens == int(batch.action_mask.sum())
    assert_exact_rows(worker.model, batch)
    assert batch.episode_index.tolist() == [e for e in range(6) for _ in range(3)]
    assert batch.segment_index.tolist() == [0, 1, 2] * 6
    assert batch.prompt_index.tolist() == [p for p in range(3) for _ in range(6)]
    assert batch.sample_index.tolist() == [0, 0, 0, 1, 1, 1] * 3
    assert batch.finish_reason == ["max_turns"] * 18 and batch.errors == [""] * 18
    assert batch.num_turns.tolist() == [3] * 18 and batch.rewards.tolist() == [6.0] * 18
    for r in range(len(batch)):
        env = make_env.envs[(int(batch.prompt_index[r]), int(batch.sample_index[r]))]
        segment = int(batch.segment_index[r])
        assert batch.prompt_ids[r] == (env.prompt if segment == 0 else env.contexts[segment - 1])
        n = int(batch.completion_lengths[r])
        assert batch.completion_ids[r, :n].tolist() == env.turns[segment]  # one model turn per segment
        assert batch.action_mask[r, :n].all()
        # the turn's reward on its last token
        assert batch.turn_rewards[r, :n].tolist() == [0.0] * (n - 1) + [segment + 1.0]
    assert float(batch.turn_rewards.sum()) == 6 * 6.0


def test_a_segment_that_goes_on_after_a_rewrite_keeps_its_observations_and_rewards(worker):
    prompts = prompts_of([30, 12], seed=1)
    make_env = Maker(prompts=prompts, append_at=(2,))
    params = SamplingParams(n=1, max_new_tokens=6, ignore_eos=True)
    batch = worker.generate(prompts, params, env=make_env, max_turns=3)
    # segment 0: turn 1; segment 1: turn 2, its observation, turn 3
    assert batch.segment_index.tolist() == [0, 1, 0, 1] and batch.episode_index.tolist() == [0, 0, 1, 1]
    assert batch.completion_lengths.tolist() == [6, 6 + 7 + 6] * 2
    assert_exact_rows(worker.model, batch)
    second = batch.turn_rewards[1]
    assert second[5] == 2.0 and second[18] == 3.0 and float(second.sum()) == 5.0
    assert batch.action_mask[1, 6:13].tolist() == [False] * 7


def test_greedy_segment_rows_are_exact(worker):
    prompts = prompts_of([12, 33], seed=2)
    batch = worker.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True),
                            env=Maker(prompts=prompts), max_turns=2)
    assert batch.segment_index.tolist() == [0, 1, 0, 1]
    assert_exact_rows(worker.model, batch, temperature=0.0)


class Extender(Rewriter):
    """Answers the whole chat as context_ids, but it always extends the history: one segment, as observations."""

    def step(self, completion_ids):
        self.turns.append(list(completion_ids))
        history = list(self.prompt) + [t for k, turn in enumerate(self.turns) for t in
                                       turn + (self.observations[k] if k < len(self.turns) - 1 else [])]
        self.observations.append(self.observation())
        return Turn(context_ids=history + self.observations[-1], reward=1.0)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.observations: list[list[int]] = []


def test_context_ids_that_extend_the_history_are_an_observation_in_one_segment(worker):
    prompts = prompts_of([17], seed=3)
    make_env = Maker(Extender, prompts=prompts)
    batch = worker.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True), env=make_env, max_turns=3)
    assert len(batch) == 1 and batch.segment_index.tolist() == [0] and batch.prompt_ids[0] == prompts[0]
    env = make_env.envs[(0, 0)]
    expected = env.turns[0] + env.observations[0] + env.turns[1] + env.observations[1] + env.turns[2]
    assert batch.completion_ids[0, : int(batch.completion_lengths[0])].tolist() == expected
    assert_exact_rows(worker.model, batch)
    assert batch.stats["reused_tokens"] > 0  # turns 2 and 3 hit the cached pages of the history


def test_segment_rows_are_exact_under_kv_pressure(tiny_path):
    from rollout.testing import load_tiny_model

    model, _ = load_tiny_model(tiny_path)
    prompts = prompts_of([33, 20], seed=4)
    # 10 pages of 16 tokens for 6 episodes of up to ~80-token contexts: requests are preempted and re-prefilled
    with RolloutWorker(model, WorkerConfig(page_size=PAGE, num_blocks=10, max_batch_tokens=64)) as w:
        batch = w.generate(prompts, SamplingParams(n=3, max_new_tokens=10, ignore_eos=True),
                           env=Maker(prompts=prompts, append_at=(1,)), max_turns=4)
    assert batch.segment_index.tolist() == [0, 1, 2] * 6
    assert_exact_rows(model, batch)


def test_a_recompute_update_mid_episode_keeps_every_segment_exact_under_its_own_versions(tiny_path):
    from rollout.testing import load_tiny_model

    v0, _ = load_tiny_model(tiny_path)
    v1, _ = load_tiny_model(tiny_path)
    gen = torch.Generator().manual_seed(1)
    v1.load_state_dict({k: t + 0.3 * torch.randn(t.shape, generator=gen) * t.std()
                        if t.is_floating_point() and t.numel() > 1 else t.clone() for k, t in v0.state_dict().items()})
    prompts = prompts_of([10, 17], seed=5)

    rewritten = threading.Event()

    class Slowish(Rewriter):
        def step(self, completion_ids):
            time.sleep(0.05)
            turn = super().step(completion_ids)
            if len(self.turns) == 2:  # an episode is in its second segment: the others are mid-turn
                rewritten.set()
            return turn

    with RolloutWorker(tiny_path, WorkerConfig(page_size=PAGE, max_batch_tokens=64)) as w:
        future = w.submit(prompts, SamplingParams(n=2, max_new_tokens=30, ignore_eos=True),
                          env=Maker(Slowish, prompts=prompts, append_at=(2,)), max_turns=4)
        assert rewritten.wait(120)
        w.update_weights(v1.state_dict(), in_flight="recompute")
        batch = future.result(timeout=120)
    assert batch.finish_reason == ["max_turns"] * len(batch) and batch.segment_index.tolist() == [0, 1, 2] * 4
    assert set(batch.token_versions[batch.action_mask].tolist()) == {0, 1}
    models = {0: v0, 1: v1}
    for r in range(len(batch)):
        n = int(batch.completion_lengths[r])
        ids = batch.completion_ids[r, :n].tolist()
        for version, model in models.items():
            at = batch.token_versions[r, :n] == version
            if at.any():
                full, _ = reference_logprobs(model, batch.prompt_ids[r], ids)
                assert float((batch.logprobs[r, :n][at] - full[at]).abs().max()) <= TOL, (r, version)


class BadContext(Rewriter):
    """Episode sample 0 answers context ids outside the vocabulary, 1 a context longer than a request may hold,
    2 an empty one, 3 text; the others rewrite healthily."""

    def step(self, completion_ids):
        turn = super().step(completion_ids)
        kind = self.key[1]
        if kind == 0:
            return Turn(context_ids=[5, 10**6])
        if kind == 1:
            return Turn(context_ids=[7] * 10**5)
        if kind == 2:
            return Turn(context_ids=[])
        if kind == 3:
            return Turn(context_ids="the chat")
        return turn


def test_bad_context_ids_end_only_their_own_episode_with_an_error(worker):
    prompts = prompts_of([14])
    batch = worker.generate(prompts, SamplingParams(n=6, max_new_tokens=5, ignore_eos=True),
                            env=Maker(BadContext, prompts=prompts), max_turns=2)
    assert batch.sample_index.tolist() == [0, 1, 2, 3, 4, 4, 5, 5]
    assert batch.finish_reason == ["error"] * 4 + ["max_turns"] * 4
    assert "context_ids token id 1000000 is outside the vocabulary" in batch.errors[0]
    assert "context_ids has 100000 tokens" in batch.errors[1] and "one request may hold" in batch.errors[1]
    assert "context_ids" in batch.errors[2] and "at least one token" in batch.errors[2]
    assert "context_ids" in batch.errors[3] and "list of int token ids" in batch.errors[3]
    assert all(e.startswith("turn 1") for e in batch.errors[:4]) and batch.errors[4:] == [""] * 4
    assert batch.num_turns.tolist() == [1] * 4 + [2] * 4
    assert_exact_rows(worker.model, batch)


def test_turn_rejects_context_ids_that_are_not_one_answer():
    with pytest.raises(ValueError, match="context_ids"):
        Turn(context_ids=[])
    with pytest.raises(ValueError, match="context_ids"):
        Turn(context_ids=[1, 2.5])
    with pytest.raises(ValueError, match="observation_ids.*context_ids"):
        Turn(observation_ids=[1], context_ids=[2])
    assert Turn(context_ids=torch.tensor([3, 4])).context_ids == [3, 4]


def test_append_only_episodes_put_each_turn_reward_on_its_last_model_token(worker):
    class Rewarded:
        def __init__(self, prompt_index, sample_index):
            self.turns = 0

        def step(self, completion_ids):
            self.turns += 1
            return Turn(observation_ids=[11] * 3, reward=0.5 * self.turns, done=self.turns == 3)

    batch = worker.generate(prompts_of([9]), SamplingParams(max_new_tokens=4, ignore_eos=True), env=Rewarded,
                            max_turns=5)
    assert len(batch) == 1 and batch.episode_index.tolist() == [0] and batch.segment_index.tolist() == [0]
    assert batch.turn_rewards[0].tolist() == [0, 0, 0, 0.5, 0, 0, 0, 0, 0, 0, 1.0, 0, 0, 0, 0, 0, 0, 1.5]
    assert float(batch.rewards[0]) == 3.0


def test_without_an_environment_each_row_is_its_own_episode(worker):
    batch = worker.generate(prompts_of([5, 9]), SamplingParams(n=2, max_new_tokens=4))
    assert batch.episode_index.tolist() == [0, 1, 2, 3] and batch.segment_index.tolist() == [0] * 4
    assert not batch.turn_rewards.any()


def test_rows_round_trip_keeps_segments_and_turn_rewards():
    rows = [Row(0, 0, [1, 2], [3, 4], [-0.1, -0.2], [-0.1, -0.2], "done", 0, turn_rewards=[0.0, 1.0]),
            Row(0, 0, [5], [6], [-0.3], [-0.3], "done", 0, segment_index=1, turn_rewards=[2.0]),
            Row(1, 0, [1], [7], [-0.4], [-0.4], "done", 0)]
    batch = RolloutBatch.from_rows(rows)
    assert batch.episode_index.tolist() == [0, 0, 1] and batch.segment_index.tolist() == [0, 1, 0]
    assert batch.turn_rewards.tolist() == [[0.0, 1.0], [2.0, 0.0], [0.0, 0.0]]
    again = RolloutBatch.from_rows(batch.rows())
    assert torch.equal(again.turn_rewards, batch.turn_rewards) and torch.equal(again.segment_index,
                                                                               batch.segment_index)
