"""RolloutCollector: the filter, partial rollouts exact across updates, staleness aborts, failing rewards, dry
prompt sources, cancellation leaving nothing behind, episodes carried with their environment."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import reference_logprobs, settled
from rollout import (PromptsExhausted, RolloutCollector, RolloutWorker, SamplingParams, Turn, WorkerConfig,
                     nonzero_std)

# fp32 noise of 100-token rows against a plain forward: 4e-6 to 7e-6 here, 1.05e-5 seen on CI (batch composition
# varies with timing). A token scored under a neighbouring version's weights is off by 1e-2 to 1 (measured).
TOL = 3e-5
STOPS = list(range(10, 15))  # the tiny model hits one of these after 1 to 100+ tokens: lengths spread widely
LONG = SamplingParams(n=2, max_new_tokens=100, stop_token_ids=STOPS)


def prompts_of(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(20, 500, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: t + 0.3 * torch.randn(t.shape, generator=gen) * t.std() if t.is_floating_point() and t.numel() > 1
            else t.clone() for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def versions(tiny_path):
    """The weights of versions 0..3 (each a perturbation of the last), as models for teacher forcing."""
    from rollout.testing import load_tiny_model

    models = {0: load_tiny_model(tiny_path)[0]}
    for v in (1, 2, 3):
        models[v] = load_tiny_model(tiny_path)[0]
        models[v].load_state_dict(perturbed(models[v - 1], v))
    return models


@pytest.fixture()
def own(tiny_path):
    """A worker holding its own copy of the weights (version 0)."""
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16, max_batch_tokens=64)) as worker:
        yield worker


def assert_nothing_left(worker) -> None:
    """The engine holds nothing of the collector's: no pending request, call or ledger entry, an empty scheduler."""
    engine = worker.engine
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and ((state := engine.in_flight()).requests or state.calls):
        time.sleep(0.01)
    time.sleep(0.2)  # the loop drops cancelled requests at its next step
    assert settled(engine), engine.in_flight()
    scheduler = engine.manager.batch_processor.scheduler
    assert not scheduler.active_requests and not scheduler.waiting_requests


def wait_progress(worker, tokens: int = 6, timeout: float = 30.0) -> None:
    """Until every request in flight has sampled `tokens` more (or finished): an update now lands mid-row."""
    engine = worker.engine
    start = {rid: n for rid, n in engine.in_flight().requests.items() if n}  # those that have sampled tokens
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = engine.in_flight().requests
        if all(rid not in now or now[rid] >= n + tokens for rid, n in start.items()):
            return
        time.sleep(0.002)
    raise AssertionError("the requests in flight made no progress")


def worst_gap(models: dict, batch) -> float:
    """Max |logprob - teacher-forced forward under the weights of the token's own version| over the batch."""
    worst = 0.0
    for r in range(len(batch)):
        n = int(batch.completion_lengths[r])
        ids = batch.completion_ids[r, :n].tolist()
        versions = batch.token_versions[r, :n]
        for version in [v for v in versions.unique().tolist() if v >= 0]:  # -1: observations
            full, _ = reference_logprobs(models[version], batch.prompt_ids[r], ids)
            at = versions == version
            worst = max(worst, float((batch.logprobs[r, :n][at] - full[at]).abs().max()))
    return worst


def parity_reward(group):
    """A reward with zero variance for every prompt whose first token is even (all 0), and the completion
    length's parity otherwise."""
    if group.prompt_ids[0][0] % 2 == 0:
        return torch.zeros(len(group))
    return (group.completion_lengths % 2).float()


def test_the_filter_returns_only_accepted_groups_with_their_rewards_and_counts_the_rest(own):
    prompts = prompts_of(24)
    with RolloutCollector(own, prompts, LONG, reward_fn=parity_reward, accept=nonzero_std, over_sample=1.5,
                          partial=False) as collector:
        batch = collector.next_batch(num_groups=3)
    stats = batch.stats
    assert stats["accepted_groups"] == 3 and len(batch) == 6
    groups = batch.prompt_index.view(3, 2)
    assert (groups[:, 0] == groups[:, 1]).all() and (groups[1:, 0] > groups[:-1, 0]).all()  # oldest prompt first
    for g in range(3):
        rows = slice(2 * g, 2 * g + 2)
        index = int(batch.prompt_index[2 * g])
        assert batch.prompt_ids[2 * g] == prompts[index]  # prompt_index: the prompt's position in the stream
        assert torch.equal(batch.rewards[rows], (batch.completion_lengths[rows] % 2).float())
        assert batch.rewards[rows].std() > 0
    assert stats["rejected_groups"] >= 1  # some drawn prompt had an even first token before 3 were accepted
    assert stats["over_generated_tokens"] > 0 and stats["staleness_hist"] == {0: batch.num_tokens}
    assert_nothing_left(own)  # partial=False: the leftovers were cancelled


def test_over_sampling_keeps_that_many_groups_in_flight(own):
    sizes = []
    submit = own.submit

    def recording(prompts, *args, **kwargs):
        sizes.append(len(prompts))
        return submit(prompts, *args, **kwargs)

    own.submit = recording
    with RolloutCollector(own, prompts_of(40), LONG, over_sample=2.5, partial=True) as collector:
        batch = collector.next_batch(4)
        assert sizes[0] == 10 and batch.stats["accepted_groups"] == 4
        assert batch.stats["in_flight_groups"] + 4 <= sum(sizes)
    assert_nothing_left(own)


def test_carried_rows_are_exact_under_each_tokens_version_across_two_and_three_updates(own, versions):
    spans, seen = [], set()

    def check(batch) -> None:
        assert worst_gap(versions, batch) <= TOL  # every token, under the weights of its own version
        assert max(batch.stats["staleness_hist"]) <= 3
        for r in range(len(batch)):
            v = batch.token_versions[r, : int(batch.completion_lengths[r])]
            assert (v[1:] >= v[:-1]).all()  # versions only move forward along a row
            spans.append(len(v.unique()))
            seen.update(v.tolist())

    # max_staleness=3: a row carried across two updates is kept whenever its group finishes, so the test does not
    # depend on it finishing between the second update and the third (on some machines none did)
    with RolloutCollector(own, prompts_of(60, seed=1), LONG, over_sample=3.0, partial=True,
                          max_staleness=3) as collector:
        for version in (1, 2, 3, None):
            check(collector.next_batch(2))
            if version is not None:
                wait_progress(own, tokens=2)  # soon, so rows in flight now outlive the next update too
                own.update_weights(versions[version].state_dict(), in_flight="recompute")
        for _ in range(8):  # the groups carried across two updates come back as they finish (oldest first)
            if max(spans) >= 3:
                break
            check(collector.next_batch(2))
    assert seen == {0, 1, 2, 3} and max(spans) >= 3, spans  # rows carried across two updates, exact throughout
    assert_nothing_left(own)


def test_a_carried_row_older_than_max_staleness_is_aborted_and_regenerated(own, versions):
    prompts = prompts_of(30, seed=2)
    submitted: dict[int, set] = {}  # policy version at submit -> the prompts submitted then
    submit = own.submit

    def recording(wave, *args, **kwargs):
        submitted.setdefault(own.policy_version, set()).update(tuple(p) for p in wave)
        return submit(wave, *args, **kwargs)

    own.submit = recording
    with RolloutCollector(own, prompts, LONG, over_sample=3.0, partial=True, max_staleness=1) as collector:
        first = collector.next_batch(2)
        assert first.stats["in_flight_groups"] > 0
        wait_progress(own)
        own.update_weights(versions[1].state_dict(), in_flight="recompute")
        own.update_weights(versions[2].state_dict(), in_flight="recompute")  # two updates: v0 tokens are 2 behind
        batch = collector.next_batch(4)
        assert batch.stats["aborted_rows"] > 0
        assert set(batch.stats["staleness_hist"]) <= {0, 1}
        assert int(batch.token_versions[batch.action_mask].min()) >= 1
        assert worst_gap(versions, batch) <= TOL
        later = [collector.next_batch(4) for _ in range(3)]
    for b in [batch, *later]:  # a regenerated prompt keeps its position in the stream
        assert all(b.prompt_ids[r] == prompts[int(b.prompt_index[r])] for r in range(len(b)))
    left_at_v0 = submitted[0] - {tuple(prompts[i]) for i in first.prompt_index.tolist()}
    assert left_at_v0 and left_at_v0 <= submitted[2]  # every v0 group not returned in time was generated again
    assert_nothing_left(own)


def test_a_raising_reward_fn_fails_only_its_group_and_the_collector_goes_on(own):
    calls = {"n": 0}
    lock = threading.Lock()

    def flaky(group):
        with lock:
            calls["n"] += 1
            if calls["n"] % 3 == 1:
                raise KeyError("judge unavailable")
        return torch.arange(len(group), dtype=torch.float32)

    with RolloutCollector(own, prompts_of(30), LONG, reward_fn=flaky, over_sample=1.0) as collector:
        batch = collector.next_batch(4)
        assert batch.stats["accepted_groups"] == 4 and batch.stats["failed_groups"] >= 1
        assert any("KeyError" in e and "judge unavailable" in e and "prompt_index" in e for e in collector.errors)
        assert batch.rewards.view(4, 2).tolist() == [[0.0, 1.0]] * 4
        wrong = RolloutCollector(own, prompts_of(4), LONG, reward_fn=lambda g: [1.0, 2.0, 3.0])
        with pytest.raises(PromptsExhausted):  # every group failed (wrong reward count): nothing to return
            wrong.next_batch(2)
        assert all("3 rewards for a group of 2 rows" in e for e in wrong.errors) and len(wrong.errors) == 4
        wrong.close()
    assert_nothing_left(own)


def test_partial_false_cancels_the_leftovers_and_close_leaves_nothing_behind(own):
    with RolloutCollector(own, prompts_of(40), LONG, over_sample=6.0, partial=False) as collector:
        batch = collector.next_batch(1)  # the first of six groups to finish: the others are cut short
        assert batch.stats["in_flight_groups"] == 0 and batch.stats["aborted_rows"] >= 2
        assert batch.stats["over_generated_tokens"] > 0
        assert_nothing_left(own)  # nothing keeps running between calls
    collector = RolloutCollector(own, prompts_of(40), LONG, over_sample=3.0, partial=True)
    collector.next_batch(2)
    assert own.engine.in_flight().requests  # partial: the leftovers run on
    collector.close()
    assert_nothing_left(own)
    with pytest.raises(RuntimeError, match="closed"):
        collector.next_batch(1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(over_sample=0.5), "over_sample"), (dict(over_sample=float("nan")), "over_sample"),
    (dict(accept="yes"), "accept"), (dict(reward_fn=3), "reward_fn"), (dict(max_staleness=-1), "max_staleness"),
    (dict(max_staleness=1.5), "max_staleness"), (dict(partial="no"), "partial"), (dict(prompts="abc"), "prompts"),
    (dict(prompts=[]), "prompts"), (dict(prompts=iter([[1, 2]]), cycle=True), "cycle"),
    (dict(sampling=[SamplingParams()]), "sampling"), (dict(max_turns=3), "max_turns"),
])
def test_bad_arguments_are_value_errors_naming_the_field_before_anything_is_submitted(own, kwargs, field,
                                                                                      monkeypatch):
    monkeypatch.setattr(own, "submit", lambda *a, **k: pytest.fail("submitted"))
    kwargs = {"prompts": prompts_of(4), **kwargs}
    with pytest.raises(ValueError, match=f"{field}="):
        RolloutCollector(own, **kwargs)
    with RolloutCollector(own, prompts_of(4)) as collector:
        for bad in (0, -2, 1.0, True):
            with pytest.raises(ValueError, match="num_groups="):
                collector.next_batch(bad)


def test_a_bad_prompt_is_refused_by_name_and_the_others_are_kept(own):
    prompts = prompts_of(3) + [[1, 2, 100000]] + prompts_of(3, seed=5)
    with RolloutCollector(own, prompts, LONG, over_sample=1.0) as collector:
        with pytest.raises(ValueError, match="prompt_index 3 of the prompt stream .dropped."):
            collector.next_batch(7)
        batch = collector.next_batch(6)  # the three before it were accepted and kept, the three after still come
    assert sorted(set(batch.prompt_index.tolist())) == [0, 1, 2, 4, 5, 6]


class OverRay:
    """A Rollouts whose refusals come back as Ray relays an actor's error: a RayTaskError(InvalidArgument), whose
    message starts with the remote call's traceback (not with "prompt N: ") and whose attributes are the error's."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def __getattr__(self, name: str):
        return getattr(self.worker, name)

    def submit(self, *args, **kwargs):
        from ray.exceptions import RayTaskError

        from rollout import InvalidArgument

        try:
            return self.worker.submit(*args, **kwargs)
        except InvalidArgument as error:
            raise RayTaskError("RolloutActor.submit", f"Traceback (most recent call last): ...\n{error!r}",
                               error).as_instanceof_cause() from None


def test_the_refused_prompt_is_found_by_its_index_whatever_the_message_says(own):
    pytest.importorskip("ray")
    prompts = prompts_of(2) + [[1, 100000]] + prompts_of(2, seed=5)
    with RolloutCollector(OverRay(own), prompts, LONG, over_sample=1.0) as collector:
        with pytest.raises(ValueError, match="prompt_index 2 of the prompt stream .dropped."):
            collector.next_batch(5)
        batch = collector.next_batch(4)  # exactly that prompt was dropped: the others come
    assert sorted(set(batch.prompt_index.tolist())) == [0, 1, 3, 4]
    assert len(collector.errors) == 1 and "prompt_index 2 " in collector.errors[0]


def test_a_dry_prompt_source_returns_what_it_has_then_raises(own):
    with RolloutCollector(own, prompts_of(5), LONG, over_sample=2.0) as collector:  # a list is used once
        first = collector.next_batch(3)
        short = collector.next_batch(3)
        assert first.stats["prompts_exhausted"] == 0 and short.stats["prompts_exhausted"] == 1
        assert sorted(set(first.prompt_index.tolist()) | set(short.prompt_index.tolist())) == [0, 1, 2, 3, 4]
        with pytest.raises(PromptsExhausted, match="ran dry"):
            collector.next_batch(1)
    with RolloutCollector(own, prompts_of(2), LONG, cycle=True) as collector:  # cycled: endless
        indices = [i for _ in range(3) for i in collector.next_batch(2).prompt_index.tolist()]
        assert sorted(set(indices)) == list(range(6))
    stream = (p for p in prompts_of(3))  # any iterator, read lazily
    with RolloutCollector(own, stream, LONG) as collector:
        assert len(collector.next_batch(5)) == 6
        with pytest.raises(PromptsExhausted):
            collector.next_batch(1)
    assert_nothing_left(own)


class Serial:
    """An environment that ends after 1 turn for the first prompt of a wave and after 5 for the others; each
    observation is [its own serial number, its turn]: a row whose observations all carry one serial number in
    turn order was stepped by one environment object from start to end."""

    made: list["Serial"] = []
    lock = threading.Lock()

    def __init__(self, prompt_index: int, sample_index: int) -> None:
        with Serial.lock:
            self.serial = 100 + len(Serial.made)
            Serial.made.append(self)
        self.turns, self.last = 0, 1 if prompt_index == 0 else 5

    def step(self, completion_ids):
        self.turns += 1
        time.sleep(0.01)
        return Turn(observation_ids=[self.serial, 40 + self.turns], reward=float(self.turns),
                    done=self.turns == self.last)


def test_a_carried_episode_resumes_where_it_was_with_its_environment(own, versions):
    Serial.made = []
    params = SamplingParams(n=2, max_new_tokens=8, stop_token_ids=STOPS)
    with RolloutCollector(own, prompts_of(4, seed=3), params, over_sample=4.0, partial=True, env=Serial,
                          max_turns=5) as collector:
        first = collector.next_batch(1)  # the one-turn episodes: the others are mid-episode
        assert first.num_turns.tolist() == [1, 1] and first.stats["in_flight_groups"] == 3
        wait_progress(own, tokens=2)
        own.update_weights(versions[1].state_dict(), in_flight="recompute")
        batch = collector.next_batch(3)
    carried = batch.stats["carried_rows"]
    assert carried == 6 and batch.num_turns.tolist() == [5] * 6 and batch.rewards.tolist() == [15.0] * 6
    for r in range(len(batch)):
        model = batch.token_versions[r][batch.action_mask[r]]
        assert set(model.tolist()) == {0, 1}  # carried across the update, not restarted
        observed = batch.completion_ids[r][~batch.action_mask[r] & batch.completion_mask[r]].view(-1, 2)
        assert len(set(observed[:, 0].tolist())) == 1 and observed[:, 1].tolist() == [41, 42, 43, 44]
    assert (batch.token_versions[~batch.action_mask] == -1).all()
    assert worst_gap(versions, batch) <= TOL
    assert_nothing_left(own)


def test_sampling_may_be_a_function_of_the_prompt_giving_its_groups_params(own):
    prompts = prompts_of(8, seed=6)

    def budget(prompt) -> int:
        return 2 + len(prompt)

    def per_prompt(prompt):
        return SamplingParams(n=3 if len(prompt) % 2 else 2, max_new_tokens=budget(prompt), ignore_eos=True)

    with RolloutCollector(own, prompts, per_prompt, over_sample=1.5, partial=False) as collector:
        batch = collector.next_batch(4)
    for r in range(len(batch)):
        prompt = prompts[int(batch.prompt_index[r])]
        assert batch.prompt_ids[r] == prompt and int(batch.completion_lengths[r]) == budget(prompt)
    sizes = torch.bincount(batch.prompt_index)
    assert all(int(sizes[i]) == per_prompt(prompts[i]).n for i in set(batch.prompt_index.tolist()))
    with RolloutCollector(own, prompts, lambda p: {"n": 2}) as collector:
        with pytest.raises(ValueError, match=r"prompt_index 0 of the prompt stream \(dropped\).*sampling="):
            collector.next_batch(1)
    assert_nothing_left(own)


def test_drafted_rows_carried_across_updates_are_exact_under_each_tokens_version(tiny_path, versions):
    """The collector on a speculating worker: rows verified with drafts (greedy rows of the tiny model fall into
    loops that their own context drafts) and carried across "recompute" updates keep every token exact under the
    weights of its own version."""
    from rollout import Speculation

    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=100, stop_token_ids=STOPS)
    config = WorkerConfig(page_size=16, max_batch_tokens=64, speculation=Speculation(mode="always"))
    seen, spans = set(), []
    with RolloutWorker(tiny_path, config) as worker:
        with RolloutCollector(worker, prompts_of(40, seed=3), greedy, over_sample=3.0, partial=True,
                              max_staleness=2) as collector:
            for version in (1, 2, None):
                batch = collector.next_batch(2)
                assert worst_gap(versions, batch) <= TOL
                for r in range(len(batch)):
                    v = batch.token_versions[r, : int(batch.completion_lengths[r])]
                    assert (v[1:] >= v[:-1]).all()
                    seen |= set(v.tolist())
                    spans.append(len(v.unique()))
                if version is not None:
                    wait_progress(worker, tokens=2)
                    worker.update_weights(versions[version].state_dict(), in_flight="recompute")
        counts = worker.engine.speculation
        assert_nothing_left(worker)
    assert {0, 1} <= seen and max(spans) >= 2, (seen, spans)  # a row carried across an update
    assert counts.accepted > 0 and counts.rolled_back > 0, counts
