"""Mixtures of experts under weight updates in flight and KV pressure: every token exact under its own version, and
`batch.routing` the routing of the KV each row's later tokens attended to, with no hole and no stale entry.

The independent reference is a plain forward of the whole row under one version's weights: a row whose every fed
position was computed under version v (mode "wait": v0; "abort", "recompute": v1, the recompute forward having
routed every earlier position again) has exactly that forward's routing."""

from __future__ import annotations

import time

import pytest
import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import load_tiny_model
from conftest import Slowish as SlowEnv, agreement, gaps_by_version, own_routing, perturbed, prompts_of, row_tokens, \
    wait_for_tokens

TOL = 1e-5


@pytest.fixture()
def own(moe_paths):
    """A Qwen3-MoE worker recording routing on its own copy of the weights; the test keeps versions 0 and 1 (every
    weight perturbed, routers included: the two versions route many positions differently)."""
    path = moe_paths["qwen3_moe"]
    v0, _ = load_tiny_model(path)
    v1, _ = load_tiny_model(path)
    v1.load_state_dict(perturbed(v0, 1))
    config = WorkerConfig(page_size=8, max_batch_tokens=48, record_routing=True)
    with RolloutWorker(path, config) as worker:
        yield worker, {0: v0, 1: v1}


def assert_versions_exact(models: dict, batch, expected: set[int]) -> None:
    spans = set(batch.token_versions[batch.completion_mask & batch.action_mask].unique().tolist())
    assert spans == expected, spans
    gaps = gaps_by_version({v: models[v] for v in expected}, batch)
    assert all(gap <= TOL for gap in gaps.values()), gaps


def sampled_some(worker, at_least: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(worker.engine.in_flight().requests.values(), default=0) >= at_least:
            return
        time.sleep(0.001)
    raise AssertionError("no request got going")


def test_recompute_switch_routes_every_row_by_the_new_weights_with_no_stale_position(own):
    worker, models = own
    # shared prompts of several full pages: after the switch, the recomputed siblings hit each other's new pages
    future = worker.submit(prompts_of([5, 27, 40], seed=4), SamplingParams(n=3, max_new_tokens=40,
                                                                            ignore_eos=True, temperature=1.0))
    wait_for_tokens(worker, 6)
    worker.update_weights(models[1].state_dict(), in_flight="recompute")
    batch = future.result(timeout=300)
    assert worker.engine.num_recomputed > 0
    assert all(set(batch.token_versions[r, : int(batch.completion_lengths[r])].tolist()) == {0, 1}
               for r in range(len(batch))), "every row spans the switch"
    assert_versions_exact(models, batch, {0, 1})
    assert agreement(batch, models[1]) >= 0.999
    assert agreement(batch, models[0]) < 0.95, "the old weights route differently: a stale entry would show"


def test_wait_and_abort_switches_record_the_routing_of_the_version_that_ran(own):
    worker, models = own
    params = SamplingParams(n=2, max_new_tokens=30, ignore_eos=True)
    future = worker.submit(prompts_of([12, 20]), params)
    wait_for_tokens(worker, 4)
    worker.update_weights(models[1].state_dict(), in_flight="wait")
    waited = future.result(timeout=300)
    assert_versions_exact(models, waited, {0})
    assert agreement(waited, models[0]) >= 0.999

    future = worker.submit(prompts_of([12, 20]), params)
    wait_for_tokens(worker, 4)
    worker.update_weights(models[0].state_dict(), version=2, in_flight="abort")
    aborted = future.result(timeout=300)
    assert_versions_exact({2: models[0]}, aborted, {2})
    assert agreement(aborted, models[0]) >= 0.999
    assert worker.engine.in_flight().routing_buffers == 0, "no routing buffer outlives its request"


def test_keep_switch_keeps_the_routing_that_built_the_old_kv(own):
    worker, models = own
    future = worker.submit(prompts_of([30, 19], seed=2), SamplingParams(max_new_tokens=40, ignore_eos=True))
    wait_for_tokens(worker, 6)
    worker.update_weights(models[1].state_dict(), in_flight="keep")
    batch = future.result(timeout=300)
    for r in range(len(batch)):
        n = int(batch.completion_lengths[r])
        before = int((batch.token_versions[r, :n] == 0).sum())
        assert 0 < before < n
        # positions fed before the switch (the prompt and all old-version tokens but the last): version 0's routing
        fed = len(batch.prompt_ids[r]) + before - 1
        recorded = batch.routing.rows[r].long().sort(dim=-1).values
        assert recorded.shape[0] == len(row_tokens(batch, r)) - 1
        assert torch.equal(recorded[:fed], own_routing(models[0], row_tokens(batch, r))[:fed])


def test_recompute_switch_during_episodes_routes_observations_by_the_new_weights(own):
    worker, models = own

    class Slowish(SlowEnv):
        @staticmethod
        def observation(turn: int) -> list[int]:  # 9 tokens: more than a page (8) routed by the new weights
            return [11, 12, 13 + turn, 40, 41, 42, 43, 44, 45]

    future = worker.submit(prompts_of([10, 17]), SamplingParams(n=2, max_new_tokens=12, ignore_eos=True),
                           env=Slowish, max_turns=3)
    wait_for_tokens(worker, 2)
    worker.update_weights(models[1].state_dict(), in_flight="recompute")
    batch = future.result(timeout=300)
    assert batch.finish_reason == ["max_turns"] * 4
    assert_versions_exact(models, batch, {0, 1})
    assert agreement(batch, models[1]) >= 0.999


def test_preempted_requests_under_kv_pressure_keep_full_routing_across_a_recompute_switch(moe_paths):
    """Preemption soft resets requests (RolloutOffloading; no CPU swap pool): a resumed request re-prefills, partly
    from pages its siblings cached. Before the switch its routing is its own version's; after a recompute switch,
    the new weights' for every position."""
    path = moe_paths["olmoe"]
    v0, _ = load_tiny_model(path)
    v1, _ = load_tiny_model(path)
    v1.load_state_dict(perturbed(v0, 3))
    config = WorkerConfig(page_size=4, num_blocks=24, max_batch_tokens=32, record_routing=True)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=18, ignore_eos=True)
    prompts = prompts_of([9, 12, 10, 8], seed=9)
    with RolloutWorker(path, config) as worker:
        plain = worker.generate(prompts, params)
        preempted = worker.metrics().preemptions
        assert preempted > 0
        assert_versions_exact({0: v0}, plain, {0})
        assert agreement(plain, v0) >= 0.999
        future = worker.submit(prompts, params)
        sampled_some(worker, 3)  # not all: under this pressure some requests wait unstarted
        worker.update_weights(v1.state_dict(), in_flight="recompute")
        switched = future.result(timeout=300)
        assert worker.metrics().preemptions > preempted
    assert_versions_exact({0: v0, 1: v1}, switched, {0, 1})
    assert agreement(switched, v1) >= 0.999
