"""Observability: a worker's metrics are exact against what its calls returned (plain rows, n > 1, prefix hits,
episodes, a cancel, an engine restart, a sleep and wake, an in-flight update), its Prometheus endpoint serves the
same numbers over loopback HTTP, and every metric is named, typed and documented once."""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from rollout import RolloutWorker, SamplingParams, Turn, WorkerConfig
from rollout.metrics.snapshot import COUNTER, FLEET_METRICS, GAUGE, METRICS, FleetMetrics, WorkerMetrics

PAGE = 16
CONFIG = WorkerConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=128)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture()
def worker(tiny):
    model, tok = tiny
    with RolloutWorker(model, CONFIG, tokenizer=tok) as w:
        yield w


def counted(before: WorkerMetrics, after: WorkerMetrics) -> dict:
    """What the counters say happened between two snapshots."""
    def minus(a, b):
        return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0)} if isinstance(a, dict) else a - b

    return {m.name: minus(getattr(after, m.name), getattr(before, m.name)) for m in METRICS
            if m.kind == COUNTER or m.name == "tokens_by_versions_behind"}


def resent(prompts: list[list[int]], n: int) -> tuple[int, int]:
    """(prompt tokens, reused tokens) of sending cached prompts again with n samples each: a prompt's full pages are
    prefix hits, leaving at least one token; when exactly one is left, its n samples run as n requests (the fork
    would crash upstream), each prompted with the prompt and each hitting its pages."""
    prompt_tokens = reused = 0
    for p in prompts:
        hit = (len(p) - 1) // PAGE * PAGE
        requests = n if hit and hit == len(p) - 1 else 1
        prompt_tokens, reused = prompt_tokens + requests * len(p), reused + requests * hit
    return prompt_tokens, reused


def expected(batch, prompts: list[list[int]], version: int = 0, resent_n: int = 0) -> dict:
    """The counters a call that returned `batch` must add, from the batch and the prompts alone (`resent_n`: the
    prompts were sent before and are sent again with that many samples each)."""
    tokens = int(batch.action_mask.sum())
    behind = collections.Counter(version - v for v in batch.token_versions[batch.action_mask].tolist())
    prompt_tokens, reused = resent(prompts, resent_n) if resent_n else (sum(len(p) for p in prompts), 0)
    return dict(generated_tokens=tokens, prompt_tokens=prompt_tokens, prefix_cache_reused_tokens=reused,
                prefill_tokens=prompt_tokens - reused, rows_finished=dict(collections.Counter(batch.finish_reason)),
                tokens_by_versions_behind=dict(behind))


def assert_idle(m: WorkerMetrics) -> None:
    """Nothing in flight and no page held: nothing leaked."""
    assert (m.requests_waiting, m.requests_running, m.episodes_in_env_step, m.kv_pages_used) == (0, 0, 0, 0)
    assert m.kv_pages_cached + m.kv_pages_free == m.kv_pages_total == CONFIG.num_blocks


# ---------------------------------------------------------------------------------------------- exact counters
def test_counters_equal_the_returned_rows_for_plain_calls_n_samples_and_prefix_hits(worker):
    prompts = prompts_of([5, 20, 33, 40])
    start = worker.metrics()
    assert start == WorkerMetrics.of(*worker.engine.metrics())  # a snapshot is plain data, equal by value
    greedy = worker.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    after_greedy = worker.metrics()
    assert {k: v for k, v in counted(start, after_greedy).items() if v} == {
        k: v for k, v in {**expected(greedy, prompts), "sampled_tokens": int(greedy.completion_lengths.sum())}.items()
        if v}
    # n = 3 of the same prompts: each prompt's n samples share one request and its prefill, and its full pages come
    # from the prefix cache; the 33-token prompt leaves one token after its hit, so its samples run as 3 requests
    sampled = worker.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=10, ignore_eos=True))
    after = worker.metrics()
    delta = counted(after_greedy, after)
    want = expected(sampled, prompts, resent_n=3)
    assert {k: delta[k] for k in want} == want
    assert want["prompt_tokens"] == 5 + 20 + 3 * 33 + 40 and want["prefix_cache_reused_tokens"] == 16 + 3 * 32 + 32
    assert want["rows_finished"] == {"length": 12} and delta["sampled_tokens"] == 12 * 10
    assert sampled.stats == dict(prompt_tokens=want["prompt_tokens"], reused_tokens=want["prefix_cache_reused_tokens"],
                                 prefill_tokens=want["prefill_tokens"], draft_tokens=0, accepted_tokens=0)
    assert after.prefix_cache_hit_rate == after.prefix_cache_reused_tokens / after.prompt_tokens
    assert_idle(after)
    assert after.kv_pages_cached > 0  # the prompts' full pages stay cached for the next call


def test_the_kv_peak_is_the_most_pages_requests_held_at_once(worker):
    # a 30-token prompt and 10 new tokens: 39 positions of KV = 3 pages of 16
    worker.generate([list(range(10, 40))], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert worker.metrics().kv_pages_peak == 3
    # the same prompt, 3 samples: its first page is a prefix hit shared by all three, then 2 pages each
    worker.generate([list(range(10, 40))], SamplingParams(n=3, max_new_tokens=10, ignore_eos=True))
    m = worker.metrics()
    assert m.kv_pages_peak == 1 + 3 * 2 and m.kv_cache_usage == 0.0


class Echo:
    """A fixed observation and reward 1 each turn; `fail_on` (prompt, sample) raises on its first step."""

    def __init__(self, prompt_index: int, sample_index: int, fail: bool = False, delay: float = 0.0) -> None:
        self.key, self.fail, self.delay = (prompt_index, sample_index), fail, delay

    def step(self, completion_ids: list[int]) -> Turn:
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("tool crashed")
        return Turn(observation_ids=[11 + self.key[0], 12, 13], reward=1.0)


def test_episode_counters_equal_the_returned_episodes_and_time_every_environment_step(worker):
    prompts = prompts_of([9, 17])
    before = worker.metrics()

    def make_env(p, s):
        return Echo(p, s, fail=(p, s) == (1, 0), delay=0.02)

    batch = worker.generate(prompts, SamplingParams(n=2, max_new_tokens=5), env=make_env, max_turns=3)
    after = worker.metrics()
    delta = counted(before, after)
    reasons = dict(collections.Counter(batch.finish_reason))
    assert reasons["error"] == 1 and batch.errors.count("") == 3
    assert delta["episodes_finished"] == reasons and delta["rows_finished"] == reasons
    assert delta["generated_tokens"] == int(batch.action_mask.sum()) < int(batch.completion_lengths.sum())
    assert delta["episode_turns"] == int(batch.num_turns.sum())
    assert delta["prompt_tokens"] == batch.stats["prompt_tokens"]  # every turn's whole context
    assert delta["prefix_cache_reused_tokens"] == batch.stats["reused_tokens"]
    assert delta["tokens_by_versions_behind"] == {0: int(batch.action_mask.sum())}
    # one environment step after every model turn, each sleeping 20 ms; the crashed one counts as an error
    steps = after.env_step_seconds
    assert steps.count - before.env_step_seconds.count == int(batch.num_turns.sum()) and delta["env_step_errors"] == 1
    assert sum(steps.counts[: steps.bounds.index(0.01) + 1]) == 0 and steps.sum >= 0.02 * steps.count
    assert_idle(after)


# ---------------------------------------------------------------------------------------------- across life events
def test_a_cancelled_call_leaves_no_request_or_page_behind_and_later_counts_stay_exact(worker):
    prompts = prompts_of([6, 11, 8])
    before = worker.metrics()
    future = worker.submit(prompts, SamplingParams(n=2, max_new_tokens=900, ignore_eos=True))
    deadline = time.monotonic() + 60
    while worker.metrics().sampled_tokens == before.sampled_tokens and time.monotonic() < deadline:
        time.sleep(0.002)
    running = worker.metrics()
    assert running.requests_running > 0 and running.kv_pages_used > 0
    assert future.cancel()
    deadline = time.monotonic() + 30
    while worker.metrics().requests_running and time.monotonic() < deadline:
        time.sleep(0.01)
    cancelled = worker.metrics()
    delta = counted(before, cancelled)
    assert delta["sampled_tokens"] > 0  # the engine worked ...
    assert delta["generated_tokens"] == 0 and delta["rows_finished"] == {}  # ... and no row finished
    assert_idle(cancelled)
    batch = worker.generate(prompts, SamplingParams(n=2, max_new_tokens=7))
    after = worker.metrics()
    want = expected(batch, prompts, resent_n=2)
    assert {k: counted(cancelled, after)[k] for k in want} == want
    assert counted(cancelled, after)["sampled_tokens"] == int(batch.completion_lengths.sum())


def test_counters_survive_an_engine_restart_and_count_each_row_once(worker, inject_engine_fault, caplog):
    prompts = prompts_of([7, 12, 30])
    warm = worker.generate(prompts, SamplingParams(n=2, max_new_tokens=6, ignore_eos=True))
    before = worker.metrics()
    inject_engine_fault(5)  # mid-call: the engine thread dies, the worker rebuilds it and re-runs what it lost
    with caplog.at_level(logging.WARNING, logger="rollout"):
        batch = worker.generate(prompts, SamplingParams(n=2, max_new_tokens=20, ignore_eos=True))
    after = worker.metrics()
    delta = counted(before, after)
    assert delta["engine_restarts"] == 1 and len(warm) == len(batch) == 6
    restarts = [r.getMessage() for r in caplog.records
                if r.name == "rollout" and "engine thread died" in r.getMessage()]
    assert len(restarts) == 1 and "RuntimeError: injected engine fault" in restarts[0]  # the fatal error, logged
    assert delta["generated_tokens"] == int(batch.completion_lengths.sum()) == 120  # re-run rows counted once
    assert delta["rows_finished"] == {"length": 6} and delta["sampled_tokens"] >= 120
    assert all(v >= 0 for v in delta.values() if not isinstance(v, dict))  # nothing went backwards
    assert after.kv_pages_peak >= before.kv_pages_peak
    assert_idle(after)


def test_counters_survive_a_sleep_and_wake_and_the_gauges_say_asleep(worker):
    prompts = prompts_of([13, 21])
    first = worker.generate(prompts, SamplingParams(max_new_tokens=8))
    awake = worker.metrics()
    worker.sleep()
    asleep = worker.metrics()
    assert (asleep.sleeping, asleep.kv_pages_total, asleep.kv_pages_used, asleep.kv_pages_free) == (1, 0, 0, 0)
    assert counted(awake, asleep) == {**counted(awake, awake), "engine_sleeps": 1}
    assert asleep.kv_pages_peak == awake.kv_pages_peak and asleep.generated_tokens == int(
        first.completion_lengths.sum())
    batch = worker.generate(prompts, SamplingParams(max_new_tokens=8))  # wakes: a fresh, empty prefix cache
    after = worker.metrics()
    want = expected(batch, prompts)
    assert {k: counted(asleep, after)[k] for k in want} == want
    assert after.sleeping == 0 and after.kv_pages_total == CONFIG.num_blocks


def test_tokens_by_versions_behind_after_an_update_lands_mid_call(tiny_path):
    prompts = prompts_of([7, 20])
    with RolloutWorker(tiny_path, WorkerConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=64)) as worker:
        future = worker.submit(prompts, SamplingParams(n=2, max_new_tokens=60, ignore_eos=True))
        while worker.metrics().sampled_tokens < 20:
            time.sleep(0.001)
        weights = {name: t.clone() for name, t in worker.model.state_dict().items()}
        worker.update_weights(weights, in_flight="recompute")  # lands mid-generation
        batch = future.result(timeout=120)
        m = worker.metrics()
    made = batch.token_versions[batch.action_mask].tolist()
    assert set(made) == {0, 1}  # every row spans the switch
    assert m.tokens_by_versions_behind == dict(collections.Counter(1 - v for v in made))
    assert m.weight_updates == {"recompute": 1} and m.recomputed_requests == 4
    # the KV each request held at the switch, recomputed: its prompt and the tokens it had sampled, but the last
    old = [(int(batch.prompt_index[r]), int((batch.token_versions[r] == 0).sum())) for r in range(len(batch))]
    assert m.recompute_tokens == sum(len(prompts[p]) + k - 1 for p, k in old)
    fence, pause = m.weight_update_seconds["recompute"], m.weight_update_pause_seconds["recompute"]
    assert 0 < pause <= fence


def test_preemptions_count_every_soft_reset_under_kv_pressure(tiny, monkeypatch):
    from transformers.generation.continuous_batching.requests import RequestState

    resets = []
    original = RequestState.create_equivalent_initial_request
    monkeypatch.setattr(RequestState, "create_equivalent_initial_request",
                        lambda self: resets.append(self.request_id) or original(self))
    model, _ = tiny
    # 24 pages of 4 tokens for 8 rows of up to 37 tokens; no prompt leaves a 1-token remainder (no fork split)
    with RolloutWorker(model, WorkerConfig(page_size=4, num_blocks=24, max_batch_tokens=32)) as worker:
        prompts = prompts_of([10, 14, 7, 6])
        batch = worker.generate(prompts, SamplingParams(n=2, max_new_tokens=24, ignore_eos=True))
        m = worker.metrics()
    assert resets and m.preemptions == len(resets)
    assert m.generated_tokens == int(batch.completion_lengths.sum()) == 8 * 24
    assert m.sampled_tokens == m.generated_tokens  # a soft reset keeps its tokens: none is sampled twice


# ---------------------------------------------------------------------------------------------- Prometheus
def scrape(url: str) -> dict[str, float]:
    """`name{label="v",...}` -> value, over a real HTTP GET."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_the_prometheus_endpoint_serves_exact_counts_on_loopback_and_stops_with_the_worker(tiny):
    model, tok = tiny
    prompts = prompts_of([9, 25])
    with RolloutWorker(model, CONFIG, tokenizer=tok) as worker:
        server = worker.serve_metrics(0)
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        with pytest.raises(RuntimeError, match=f"already serves its metrics on {re.escape(server.url)}"):
            worker.serve_metrics(0)
        batch = worker.generate(prompts, SamplingParams(n=2, max_new_tokens=6, stop_token_ids=[7, 8, 9]))
        got = scrape(server.url)
        tokens = int(batch.completion_lengths.sum())
        assert got["rollout_generated_tokens_total"] == tokens == got["rollout_sampled_tokens_total"]
        assert got["rollout_prompt_tokens_total"] == 9 + 25
        for reason, rows in collections.Counter(batch.finish_reason).items():
            assert got[f'rollout_rows_finished_total{{finish_reason="{reason}"}}'] == rows
        assert got["rollout_kv_pages_total"] == CONFIG.num_blocks and got["rollout_kv_pages_used"] == 0
        assert got['rollout_tokens_by_versions_behind_bucket{le="0.0"}'] == tokens
        assert got["rollout_tokens_by_versions_behind_count"] == tokens
        assert got["rollout_tokens_by_versions_behind_sum"] == 0 and got["rollout_policy_version"] == 0
        worker.refresh()
        got = scrape(server.url)
        assert got['rollout_weight_updates_total{in_flight="wait"}'] == 1 and got["rollout_policy_version"] == 1
        assert got['rollout_env_step_seconds_bucket{le="+Inf"}'] == 0
    assert server.closed  # closing the worker stops its endpoint and frees the port
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)
    with socket.socket() as probe:  # nothing listens there any more (TIME_WAIT of the scrapes is no conflict)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", server.port))
        probe.listen()


def test_a_port_in_use_is_an_error_naming_it_and_bad_ports_are_refused(worker):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1 port {port}: .*in use.*Fix: pick "
                                          "another port"):
            worker.serve_metrics(port)
    for bad in (-1, 70000, "9400", True):
        with pytest.raises(ValueError, match="port="):
            worker.serve_metrics(bad)
    server = worker.serve_metrics(0)  # a refused attempt leaves nothing behind: serving still works
    server.close()
    again = worker.serve_metrics(0)  # and a closed endpoint can be replaced
    assert scrape(again.url)["rollout_policy_version"] == 0


# ---------------------------------------------------------------------------------------------- names
def test_every_metric_is_a_snapshot_field_listed_once_and_documented():
    names = [m.name for m in METRICS]
    assert len(set(names)) == len(names)
    assert names == [f.name for f in dataclasses.fields(WorkerMetrics)]
    fleet_fields = [f.name for f in dataclasses.fields(FleetMetrics)][2:]
    assert [m.name for m in FLEET_METRICS] == fleet_fields
    assert all(m.kind in (COUNTER, GAUGE, "histogram") and m.unit and m.help for m in METRICS + FLEET_METRICS)
    doc = DOCS.read_text()
    for metric in METRICS:
        suffix = "_total" if metric.kind == COUNTER else ""
        assert f"`rollout_{metric.name}{suffix}`" in doc, metric.name
    for metric in FLEET_METRICS:
        suffix = "_total" if metric.kind == COUNTER else ""
        assert f"`rollout_fleet_{metric.name}{suffix}`" in doc, metric.name


def test_flat_keys_and_fleet_totals_add_up():
    a = WorkerMetrics(generated_tokens=5, rows_finished={"stop": 2}, tokens_by_versions_behind={0: 4, 2: 1},
                      kv_pages_total=10, kv_pages_used=3, kv_pages_peak=4, prompt_tokens=8,
                      prefix_cache_reused_tokens=2, policy_version=3)
    b = WorkerMetrics(generated_tokens=7, rows_finished={"stop": 1, "length": 3}, tokens_by_versions_behind={0: 7},
                      kv_pages_total=10, kv_pages_used=1, kv_pages_peak=9, prompt_tokens=12, policy_version=3)
    total = a + b
    assert (total.generated_tokens, total.rows_finished) == (12, {"length": 3, "stop": 3})
    assert total.tokens_by_versions_behind == {0: 11, 2: 1} and total.kv_pages_peak == 9
    assert (total.kv_pages_used, total.policy_version, total.prefix_cache_hit_rate) == (4, 3, 2 / 20)
    retired = a.counters_only()
    assert retired.generated_tokens == 5 and retired.kv_pages_used == 0 and retired.kv_pages_peak == 0
    flat = a.flat()
    assert flat["rollout/rows_finished/stop"] == 2.0 and flat["rollout/tokens_by_versions_behind/2"] == 1.0
    assert flat["rollout/tokens_by_versions_behind/mean"] == 2 / 5 and flat["rollout/kv_pages_used"] == 3.0


def test_dispatch_imbalance_is_the_busiest_actors_tokens_over_the_mean_and_an_empty_call_keeps_it():
    from rollout.fleet.meter import FleetMeter

    meter = FleetMeter()
    assert meter.dispatch_imbalance == 1.0
    meter.dispatched({0: 30, 1: 10}, num_actors=2)
    assert meter.dispatch_imbalance == 30 / 20
    meter.dispatched({}, num_actors=2)  # fleet.generate([]): nothing ran anywhere
    assert meter.dispatch_imbalance == 30 / 20
    meter.dispatched({1: 40}, num_actors=2)  # one actor of two ran everything
    assert meter.dispatch_imbalance == 2.0
