"""Reproducible sampling: a seeded sample's tokens depend on its seed and sample index only; an unseeded one's on the
worker's seed and the call's order. Neither depends on what else is in the batch, the cache size, preemption under KV
pressure or an engine restart."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.continuous_batching.requests import RequestState

from rollout import RolloutWorker, SamplingParams, WorkerConfig

ROOMY = WorkerConfig(num_blocks=256)
# 24 pages of 4 tokens for 6-10 rows of 20-30 tokens: requests are preempted mid-decode and re-prefilled
CRAMPED = WorkerConfig(page_size=4, num_blocks=24, max_batch_tokens=32)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = prompts_of([9, 14, 5], seed=0)
PARAMS = [SamplingParams(n=3, temperature=1.0, max_new_tokens=16, ignore_eos=True),
          SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=16, ignore_eos=True),
          SamplingParams(n=1, temperature=1.3, max_new_tokens=12, ignore_eos=True)]
SEEDED = [SamplingParams(n=2, temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=77),
          SamplingParams(n=2, temperature=0.9, top_p=0.8, max_new_tokens=16, ignore_eos=True, seed=78)]


@pytest.fixture()
def soft_resets(monkeypatch) -> list[int]:
    """Generated lengths of requests preempted mid-decode and re-prefilled."""
    resets: list[int] = []
    original = RequestState.create_equivalent_initial_request
    monkeypatch.setattr(RequestState, "create_equivalent_initial_request",
                        lambda self: resets.append(self.generated_len()) or original(self))
    return resets


def rollouts(model, config: WorkerConfig, calls: list[tuple[list, list]]) -> tuple[list[list[list[int]]], int]:
    """Token lists of each call, on a fresh worker; and how many times its engine restarted."""
    with RolloutWorker(model, config) as worker:
        tokens = [worker.generate(prompts, params).completion_token_lists() for prompts, params in calls]
        return tokens, worker.engine.num_restarts


def test_unseeded_rollouts_repeat_for_one_worker_seed_and_call_order_whatever_the_cache(tiny, soft_resets):
    model, _ = tiny
    calls = [(PROMPTS, PARAMS), (PROMPTS, PARAMS)]
    roomy, _ = rollouts(model, ROOMY, calls)
    cramped, _ = rollouts(model, CRAMPED, calls)
    assert any(n > 0 for n in soft_resets), "the cramped cache preempted requests mid-decode"
    assert cramped == roomy
    assert roomy[0] != roomy[1]  # the call's order keys its streams: a second call is a fresh draw
    other_seed, _ = rollouts(model, WorkerConfig(num_blocks=256, seed=1), calls[:1])
    assert other_seed[0] != roomy[0]


def test_unseeded_rollouts_repeat_after_an_engine_restart(tiny, inject_engine_fault):
    model, _ = tiny
    clean, _ = rollouts(model, ROOMY, [(PROMPTS, PARAMS)])
    inject_engine_fault(4)  # mid-call
    recovered, restarts = rollouts(model, ROOMY, [(PROMPTS, PARAMS)])
    assert restarts == 1 and recovered == clean


def test_seeded_samples_repeat_whatever_the_batch_preemption_or_restart(tiny, soft_resets, inject_engine_fault):
    model, _ = tiny
    (alone,), _ = rollouts(model, ROOMY, [(PROMPTS[:2], SEEDED)])
    crowd = prompts_of([20, 3, 11, 17], seed=5)
    (crowded,), _ = rollouts(model, CRAMPED, [(crowd[:2] + PROMPTS[:2] + crowd[2:], PARAMS[:2] + SEEDED + PARAMS[:2])])
    assert any(n > 0 for n in soft_resets)
    assert crowded[5:9] == alone  # rows 5-8: the two seeded prompts' samples, after the first two prompts' 5
    inject_engine_fault(4)  # mid-call
    (recovered,), restarts = rollouts(model, ROOMY, [(crowd[:1] + PROMPTS[:2], PARAMS[:1] + SEEDED)])
    assert restarts == 1 and recovered[3:] == alone
