"""Colocation with a trainer: sleep frees the KV cache and the engine's buffers (measured in process RSS), wake
re-allocates them, and rollouts after a wake are exact, current and never read KV cached before the sleep. On the
host, the KV cache costs the pages its tokens fill, not its budget."""

from __future__ import annotations

import threading

import psutil
import pytest
import torch

from conftest import reference_logprobs
from rollout import RolloutWorker, SamplingParams, WorkerConfig

TOL = 1e-5
KV_MB = 512  # large next to everything else the process holds, so its release stands out of the RSS noise


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20  # no gc.collect here: sleep must free without help


def assert_exact(model, batch, params: SamplingParams) -> None:
    for r, completion in enumerate(batch.completion_token_lists()):
        full, truncated = reference_logprobs(model, batch.prompt_ids[r], completion, params.temperature,
                                             params.top_k, params.top_p)
        assert torch.allclose(batch.logprobs[r, : len(completion)], full, atol=TOL, rtol=0)
        assert torch.allclose(batch.sampling_logprobs[r, : len(completion)], truncated, atol=TOL, rtol=0)


@pytest.fixture()
def worker(tiny):
    model, tok = tiny
    w = RolloutWorker(model, WorkerConfig(kv_cache_memory_mb=KV_MB), tokenizer=tok)
    yield w
    w.close()


def fill_every_page(worker) -> None:
    """What a long run leaves behind: every page of the KV cache written (its tokens are not read again)."""
    worker.engine.manager.batch_processor.cache.cache_tensor.fill_(0)


def test_sleep_releases_the_kv_budget_and_wake_serves_exact_rollouts_again(worker):
    params = SamplingParams(n=3, temperature=0.9, top_k=40, max_new_tokens=10)
    prompts = [prompt_of(20, seed=1), prompt_of(7, seed=2)]
    worker.generate(prompts, params)
    fill_every_page(worker)
    awake = rss_mb()
    worker.sleep()
    asleep = rss_mb()
    assert worker.is_sleeping and not worker.engine.is_alive()
    assert awake - asleep >= 0.9 * KV_MB, (awake, asleep)
    worker.wake()
    assert not worker.is_sleeping and worker.engine.is_alive()
    assert rss_mb() - asleep < 0.1 * KV_MB  # a fresh cache: no page is committed before a token is written to it
    batch = worker.generate(prompts, params)
    assert len(batch) == 6 and batch.policy_version.tolist() == [0] * 6
    assert_exact(worker.model, batch, params)


def test_a_host_kv_cache_costs_the_pages_its_tokens_fill_not_its_budget(tiny):
    model, _ = tiny
    before = rss_mb()
    budget_mb = 2 * KV_MB
    with RolloutWorker(model, WorkerConfig(kv_cache_memory_mb=budget_mb)) as worker:
        started = rss_mb()
        # 1 GiB of KV budget (2M tokens); what is committed is the engine's bookkeeping of its blocks
        assert started - before < 0.05 * budget_mb, (before, started)
        cache = worker.engine.manager.batch_processor.cache
        assert int(cache.cache_tensor.count_nonzero()) == 0  # and it reads as zeros, as upstream's torch.zeros did
        worker.generate([prompt_of(40, seed=6)], SamplingParams(n=4, max_new_tokens=30, ignore_eos=True))
        # 4 x 70 tokens of KV (512 bytes each): well under a MiB, whatever the budget
        assert rss_mb() - started < 0.05 * KV_MB


def test_generate_on_a_sleeping_worker_wakes_it_and_sleep_waits_for_in_flight_calls(worker):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=60, ignore_eos=True)
    result = {}
    caller = threading.Thread(target=lambda: result.setdefault("batch", worker.generate([prompt_of(30)], params)))
    caller.start()
    while not worker.engine.in_flight().requests and "batch" not in result:  # until the call is in the engine
        threading.Event().wait(0.005)
    worker.sleep()  # waits for it: every row finished before the engine stopped
    assert worker.is_sleeping and not worker.engine.in_flight().requests
    caller.join(timeout=30)  # the caller's own return (building its batch) comes after the engine's part
    assert result["batch"].completion_lengths.tolist() == [60] * 4
    assert worker.is_sleeping  # the call never needed the engine again: it was complete when sleep returned
    batch = worker.generate([prompt_of(5, seed=3)], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert not worker.is_sleeping and len(batch) == 1
    worker.sleep()
    worker.sleep()  # a second sleep is a no-op
    assert worker.is_sleeping


def test_weights_updated_while_asleep_are_served_after_wake_and_no_cached_prefix_survives(worker):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    prompt = prompt_of(3 * 16 + 1, seed=4)  # three full pages: cached as a prefix by the first call
    before = worker.generate([prompt], greedy)
    worker.sleep()
    gen = torch.Generator().manual_seed(5)
    new = {name: p.detach() + 0.5 * torch.randn(p.shape, generator=gen) * p.detach().std()
           for name, p in worker.model.named_parameters()}
    assert worker.update_weights(new) == 1
    assert worker.is_sleeping  # an update does not wake the worker
    after = worker.generate([prompt], greedy)
    assert after.policy_version.tolist() == [1]
    assert_exact(worker.model, after, greedy)
    assert after.completion_token_lists() != before.completion_token_lists()
