"""Multi-turn episodes: exact across turns, history never recomputed, failures kept to their own episode."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from conftest import PAGE, TOL, prompts_of, reference_logprobs
from rollout import EpisodeSpec, RolloutBatch, RolloutWorker, SamplingParams, Turn, WorkerConfig


@pytest.fixture(scope="module")
def worker(episodes_worker):
    return episodes_worker


class Echo:
    """Answers every turn with a fixed-length observation that depends on the episode and the turn, and a reward
    of 1 per turn; records what it was called with."""

    def __init__(self, prompt_index: int, sample_index: int, obs_len: int = 19) -> None:
        self.key, self.obs_len = (prompt_index, sample_index), obs_len
        self.turns: list[list[int]] = []
        self.closed = 0

    def observation(self) -> list[int]:
        p, s = self.key
        return [(20 + 7 * p + 3 * s + 11 * len(self.turns) + i) % 480 + 10 for i in range(self.obs_len)]

    def step(self, completion_ids: list[int]) -> Turn:
        self.turns.append(list(completion_ids))
        return Turn(observation_ids=self.observation(), reward=1.0)

    def close(self) -> None:
        self.closed += 1


class Recorder:
    """make_env that keeps every environment it made."""

    def __init__(self, cls=Echo, **kwargs) -> None:
        self.cls, self.kwargs, self.envs = cls, kwargs, {}
        self.lock = threading.Lock()

    def __call__(self, prompt_index: int, sample_index: int):
        env = self.cls(prompt_index, sample_index, **self.kwargs)
        with self.lock:
            self.envs[(prompt_index, sample_index)] = env
        return env


def assert_exact_episodes(model, batch: RolloutBatch, temperature: float = 1.0) -> float:
    """Every model token's logprob equals a teacher-forced forward over the whole episode; observation tokens carry
    0.0 and a False action mask. Returns the worst gap."""
    worst = 0.0
    for r in range(len(batch)):
        n = int(batch.completion_lengths[r])
        ids = batch.completion_ids[r, :n].tolist()
        full, _ = reference_logprobs(model, batch.prompt_ids[r], ids, temperature)
        action = batch.action_mask[r, :n]
        assert action.any()
        gap = float((batch.logprobs[r, :n][action] - full[action]).abs().max())
        assert gap <= TOL, (r, gap)
        worst = max(worst, gap)
        assert (batch.logprobs[r, :n][~action] == 0).all() and (batch.sampling_logprobs[r, :n][~action] == 0).all()
        assert not batch.action_mask[r, n:].any()
    return worst


def test_every_model_token_of_every_turn_matches_a_forward_over_the_whole_episode(worker):
    make_env = Recorder()
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, ignore_eos=True, seed=3)
    batch = worker.generate(prompts_of([21, 40, 1]), params, env=make_env, max_turns=3)
    assert_exact_episodes(worker.model, batch)
    assert batch.finish_reason == ["max_turns"] * 6
    assert batch.num_turns.tolist() == [3] * 6 and batch.rewards.tolist() == [3.0] * 6
    assert batch.errors == [""] * 6
    for r in range(len(batch)):
        env = make_env.envs[(int(batch.prompt_index[r]), int(batch.sample_index[r]))]
        # layout: turn, observation, turn, observation, turn (the last turn's observation is not appended)
        expected, obs = [], []
        for k, turn in enumerate(env.turns):
            expected += turn
            if k < len(env.turns) - 1:
                env_obs = Echo(*env.key)
                env_obs.turns = [None] * (k + 1)
                obs = env_obs.observation()
                expected += obs
        assert batch.completion_ids[r, : int(batch.completion_lengths[r])].tolist() == expected
        assert int(batch.action_mask[r].sum()) == sum(len(t) for t in env.turns) == 27
        assert env.closed == 1


def test_top_logprobs_of_every_model_turn_and_none_on_observations(worker):
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=5, ignore_eos=True, seed=2, top_logprobs=4)
    batch = worker.generate(prompts_of([13, 30]), params, env=Recorder(obs_len=6), max_turns=3)
    assert batch.top_ids.shape[2] == 4
    for r in range(len(batch)):
        n = int(batch.completion_lengths[r])
        ids, action = batch.completion_ids[r, :n], batch.action_mask[r, :n]
        with torch.no_grad():
            logits = worker.model(torch.tensor([batch.prompt_ids[r] + ids.tolist()])).logits[0]
        reference = torch.log_softmax(logits[len(batch.prompt_ids[r]) - 1: -1].float() / 0.9, dim=-1)[action]
        listed, values = batch.top_ids[r, :n][action], batch.top_logprobs[r, :n][action]
        assert torch.allclose(values, reference.topk(4, dim=-1).values, atol=TOL, rtol=0)
        assert torch.allclose(reference.gather(1, listed), values, atol=TOL, rtol=0)
        assert (batch.top_ids[r, :n][~action] == -1).all() and torch.isneginf(batch.top_logprobs[r, :n][~action]).all()
        assert int(action.sum()) == 15 and int((~action).sum()) == 12  # three turns, two observations


def test_turn_k_prefills_only_its_observation_and_the_partial_last_page(worker):
    prompts = prompts_of([37, 50], seed=1)
    params = SamplingParams(n=1, max_new_tokens=8, ignore_eos=True)
    batch = worker.generate(prompts, params, env=Recorder(obs_len=13), max_turns=4)
    assert_exact_episodes(worker.model, batch)
    # turn 1 prefills each prompt; turns 2-4 at most the observation, the previous turn's tokens and a partial page
    first_turn = sum(len(p) for p in prompts)
    later_turns = len(prompts) * 3
    assert batch.stats["prefill_tokens"] <= first_turn + later_turns * (13 + 8 + PAGE)
    history = sum(len(p) * 4 + 21 * (1 + 2 + 3) for p in prompts)  # what re-prefilling every turn would cost
    assert batch.stats["prompt_tokens"] == history
    assert batch.stats["reused_tokens"] >= history - first_turn - later_turns * (13 + 8 + PAGE)


def test_without_prefix_caching_the_history_is_recomputed_and_still_exact(tiny_path):
    from rollout.testing import load_tiny_model

    model, _ = load_tiny_model(tiny_path)
    with RolloutWorker(model, WorkerConfig(page_size=PAGE, prefix_caching=False)) as w:
        batch = w.generate(prompts_of([30]), SamplingParams(max_new_tokens=6, ignore_eos=True), env=Echo,
                           max_turns=3)
    assert_exact_episodes(model, batch)
    assert batch.stats["reused_tokens"] == 0 and batch.stats["prefill_tokens"] == batch.stats["prompt_tokens"]


def test_exact_under_kv_pressure_and_prefix_hits_between_episodes_sharing_a_prompt(tiny_path):
    from rollout.testing import load_tiny_model

    model, _ = load_tiny_model(tiny_path)
    # 12 pages of 16 tokens for 8 episodes of ~100 tokens: requests are preempted and re-prefilled
    with RolloutWorker(model, WorkerConfig(page_size=PAGE, num_blocks=12, max_batch_tokens=64)) as w:
        prompt = prompts_of([33], seed=2)
        params = SamplingParams(n=4, max_new_tokens=10, ignore_eos=True)
        first = w.generate(prompt, params, env=Echo, max_turns=3)
        second = w.generate(prompt * 2, params, env=Echo, max_turns=3)
    assert_exact_episodes(model, first)
    assert_exact_episodes(model, second)
    assert second.stats["reused_tokens"] > 0


def test_greedy_episodes_match_at_temperature_one_reference(worker):
    batch = worker.generate(prompts_of([12]), SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True),
                            env=Echo, max_turns=2)
    assert_exact_episodes(worker.model, batch, temperature=0.0)


class DoneAtTurn(Echo):
    def __init__(self, prompt_index, sample_index, done_at: int = 2) -> None:
        super().__init__(prompt_index, sample_index)
        self.done_at = done_at

    def step(self, completion_ids):
        turn = super().step(completion_ids)
        return Turn(turn.observation_ids, reward=0.5, done=len(self.turns) == self.done_at)


def test_done_ends_the_episode_and_the_last_turns_reward_counts(worker):
    batch = worker.generate(prompts_of([10, 15]), SamplingParams(max_new_tokens=4, ignore_eos=True),
                            env=DoneAtTurn, max_turns=5)
    assert batch.finish_reason == ["done", "done"]
    assert batch.num_turns.tolist() == [2, 2] and batch.rewards.tolist() == [1.0, 1.0]
    assert batch.completion_lengths.tolist() == [4 + 19 + 4] * 2


def test_an_episode_spec_runs_the_same_episodes_as_its_fields_given_as_keywords(worker):
    spec = EpisodeSpec(DoneAtTurn, max_turns=5, max_episode_tokens=40)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=3)
    by_spec = worker.generate(prompts_of([10, 15]), params, episode=spec)
    by_keywords = worker.generate(prompts_of([10, 15]), params, **spec.kwargs())
    assert by_spec.finish_reason == by_keywords.finish_reason == ["done", "done"]
    assert torch.equal(by_spec.completion_ids, by_keywords.completion_ids)
    assert torch.equal(by_spec.action_mask, by_keywords.action_mask)
    assert_exact_episodes(worker.model, by_spec)


def test_the_episode_token_budget_ends_it_with_length(worker):
    # budget 30: turn (8) + observation (19) = 27; the next observation would leave no room: "length"
    batch = worker.generate(prompts_of([10]), SamplingParams(max_new_tokens=8, ignore_eos=True), env=Echo,
                            max_turns=5, max_episode_tokens=30)
    assert batch.finish_reason == ["length"] and batch.num_turns.tolist() == [2]
    assert int(batch.completion_lengths[0]) <= 30
    assert_exact_episodes(worker.model, batch)


def test_a_one_token_turn_budget_still_runs_every_turn(worker):
    batch = worker.generate(prompts_of([1]), SamplingParams(max_new_tokens=1, ignore_eos=True),
                            env=Recorder(obs_len=1), max_turns=4)
    assert batch.num_turns.tolist() == [4] and batch.completion_lengths.tolist() == [7]
    assert_exact_episodes(worker.model, batch)


class Faulty(Echo):
    """Episode (0, 0) raises at its second step, (0, 1) hangs, (0, 2) answers an id outside the vocabulary;
    the others are healthy."""

    def step(self, completion_ids):
        turn = super().step(completion_ids)
        kind = self.key[1]
        if len(self.turns) == 2 and kind == 0:
            raise RuntimeError("sandbox crashed")
        if len(self.turns) == 2 and kind == 1:
            time.sleep(3)
        if len(self.turns) == 2 and kind == 2:
            return Turn([5, 10**6])
        return turn


def test_a_failing_environment_ends_only_its_own_episode(worker):
    make_env = Recorder(Faulty)
    start = time.monotonic()
    batch = worker.generate(prompts_of([14]), SamplingParams(n=5, max_new_tokens=5, ignore_eos=True), env=make_env,
                            max_turns=3, env_timeout=1.0)
    assert time.monotonic() - start < 2.9  # nobody waited for the hung step
    assert batch.finish_reason == ["error", "error", "error", "max_turns", "max_turns"]
    assert "RuntimeError: sandbox crashed" in batch.errors[0] and batch.errors[0].startswith("turn 2")
    assert "env_timeout=1.0" in batch.errors[1]
    assert "1000000" in batch.errors[2] and "outside the vocabulary" in batch.errors[2]
    assert batch.errors[3:] == ["", ""]
    assert batch.num_turns.tolist() == [2, 2, 2, 3, 3]
    assert_exact_episodes(worker.model, batch)
    time.sleep(0.3)
    assert all(env.closed == 1 for env in make_env.envs.values())


class AsyncEcho(Echo):
    async def step(self, completion_ids):
        await asyncio.sleep(0.05)
        return super().step(completion_ids)


def test_async_steps_are_awaited(worker):
    batch = worker.generate(prompts_of([9, 9]), SamplingParams(max_new_tokens=3, ignore_eos=True), env=AsyncEcho,
                            max_turns=3)
    assert batch.finish_reason == ["max_turns"] * 2 and batch.rewards.tolist() == [3.0, 3.0]
    assert_exact_episodes(worker.model, batch)


class Slow(Echo):
    """Episode 0's steps take 0.6 s, the others' none."""

    def step(self, completion_ids):
        if self.key[0] == 0:
            time.sleep(0.6)
        return super().step(completion_ids)


def test_episodes_never_wait_for_each_other(worker):
    ends = {}

    class Timed(Slow):
        def close(self):
            ends[self.key] = time.monotonic()

    start = time.monotonic()
    worker.generate(prompts_of([8, 8, 8]), SamplingParams(max_new_tokens=3, ignore_eos=True), env=Timed, max_turns=4)
    # the slow episode needs >= 4 x 0.6 s; the fast ones end before its second step is even back
    assert ends[(0, 0)] - start >= 2.4
    assert max(ends[(1, 0)], ends[(2, 0)]) - start < 1.2


def test_a_weight_refresh_waits_for_whole_episodes(tiny_path):
    from rollout.testing import load_tiny_model

    model, _ = load_tiny_model(tiny_path)
    with RolloutWorker(model, WorkerConfig(page_size=PAGE)) as w:
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault("batch", w.generate(
            prompts_of([8, 8]), SamplingParams(max_new_tokens=3, ignore_eos=True), env=Slow, max_turns=3)))
        thread.start()
        time.sleep(0.3)  # the slow episode is inside an environment step now
        w.refresh()
        thread.join()
    assert result["batch"].policy_version.tolist() == [0, 0]  # nothing of them ran on version 1


def test_a_call_that_times_out_closes_its_environments_and_leaves_nothing_behind(worker):
    make_env = Recorder(Slow)
    with pytest.raises(TimeoutError):
        worker.generate(prompts_of([8, 8, 8]), SamplingParams(max_new_tokens=3, ignore_eos=True), env=make_env,
                        max_turns=4, timeout=1.0)
    time.sleep(0.8)  # the slow step in flight returns; its outcome is dropped
    assert set(make_env.envs) == {(0, 0), (1, 0), (2, 0)}
    assert all(env.closed == 1 for env in make_env.envs.values())
    engine = worker.engine
    state = engine.in_flight()
    assert not state.requests and state.episodes_stepping == 0 and state.reruns == 0
    batch = worker.generate(prompts_of([8]), SamplingParams(max_new_tokens=3, ignore_eos=True), env=Echo, max_turns=2)
    assert_exact_episodes(worker.model, batch)


def test_without_an_environment_the_new_fields_are_neutral(worker):
    batch = worker.generate(prompts_of([5, 9]), SamplingParams(max_new_tokens=4))
    assert torch.equal(batch.action_mask, batch.completion_mask)
    assert batch.rewards.tolist() == [0.0, 0.0] and batch.num_turns.tolist() == [1, 1] and batch.errors == ["", ""]
    assert set(batch.finish_reason) <= {"stop", "length"}


@pytest.mark.parametrize("kwargs, field", [
    (dict(env=Echo, max_turns=0), "max_turns"),
    (dict(env="not a factory"), "env"),
    (dict(max_turns=3), "max_turns"),
    (dict(max_episode_tokens=10), "max_episode_tokens"),
    (dict(env=Echo, max_episode_tokens=10**6), "max_episode_tokens"),
    (dict(env=Echo, env_timeout=0), "env_timeout"),
    (dict(episode=EpisodeSpec(Echo, max_turns=2), env=Echo), "episode"),
    (dict(episode=EpisodeSpec(Echo, max_turns=2), max_turns=3), "episode"),
    (dict(episode={"env": Echo}), "episode"),
])
def test_bad_episode_arguments_are_rejected_before_anything_runs(worker, kwargs, field):
    before = worker.engine.num_prompt_tokens
    with pytest.raises(ValueError, match=field):
        worker.generate(prompts_of([5]), SamplingParams(max_new_tokens=4), **kwargs)
    assert worker.engine.num_prompt_tokens == before


def test_bad_turns_are_rejected_by_turn_itself():
    with pytest.raises(ValueError, match="observation_ids"):
        Turn("some text")
    with pytest.raises(ValueError, match="reward"):
        Turn([1], reward=float("nan"))
