"""Metrics: one snapshot of what the rollout layer has done and holds, with stable names and units.

    m = worker.metrics()                  # WorkerMetrics: counters since the worker started, gauges now
    m.generated_tokens, m.kv_pages_used, m.rows_finished["stop"], m.tokens_by_versions_behind[1]
    tracker.log(m.flat(), step=step)      # {"rollout/generated_tokens": ..., "rollout/rows_finished/stop": ...}
    fleet.metrics()                       # FleetMetrics: .total (every actor, replaced ones included), .actors

`METRICS` and `FLEET_METRICS` are the one list of names, kinds, units and meanings: the snapshot's fields, the
Prometheus exposition (rollout/metrics/prometheus.py: `rollout_<name>`, counters with `_total`), the trackers' keys
(`rollout/<name>`) and docs/observability.md all follow it (tests/test_metrics.py checks they agree).

Counters only grow for the life of a worker, across engine restarts and sleeps; a fleet's totals keep what replaced
actors had counted (as of the last snapshot taken of them). Everything here is plain data: it pickles (fleet actors
send it) and compares by value. Nothing is counted here: the engine counts (rollout/engine/observe/counters.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclass(frozen=True)
class Metric:
    """name: the snapshot field (Prometheus: `rollout_<name>`, `_total` added to counters). label: the key of a
    per-label dict (finish_reason, in_flight). combine: how a fleet total is made from its actors'."""

    name: str
    kind: str
    unit: str
    help: str
    label: str | None = None
    combine: str = "sum"  # or "max"


METRICS: tuple[Metric, ...] = (
    Metric("generated_tokens", COUNTER, "tokens", "model tokens of finished rows (episodes: the model's turns, "
           "observations excluded); equals the action tokens of the rows returned"),
    Metric("sampled_tokens", COUNTER, "tokens", "every token the engine sampled, including those of requests later "
           "cancelled, aborted by a weight update or failed (throughput of the engine itself)"),
    Metric("prompt_tokens", COUNTER, "tokens", "tokens the engine's requests were prompted with (a prompt's n "
           "samples: once, unless they run as separate requests; an episode: each turn's whole context)"),
    Metric("prefix_cache_reused_tokens", COUNTER, "tokens", "of prompt_tokens, served by the prefix cache"),
    Metric("prefill_tokens", COUNTER, "tokens", "of prompt_tokens, prefilled (prompt_tokens - "
           "prefix_cache_reused_tokens)"),
    Metric("rows_finished", COUNTER, "rows", "finished rows (samples and episodes) by finish reason",
           label="finish_reason"),
    Metric("episodes_finished", COUNTER, "episodes", "finished multi-turn episodes by finish reason",
           label="finish_reason"),
    Metric("episode_turns", COUNTER, "turns", "model turns of finished episodes"),
    Metric("preemptions", COUNTER, "requests", "requests whose KV the engine dropped under KV pressure, to be "
           "prefilled again (soft resets)"),
    Metric("engine_restarts", COUNTER, "restarts", "engine threads that died and were rebuilt (their requests re-run)"),
    Metric("engine_sleeps", COUNTER, "sleeps", "sleep() calls that freed the KV cache"),
    Metric("aborted_samples", COUNTER, "samples", "samples cancelled by in_flight=\"abort\" updates and re-run"),
    Metric("weight_updates", COUNTER, "updates", "weight updates and refreshes by in_flight mode", label="in_flight"),
    Metric("weight_update_seconds", COUNTER, "seconds", "time updates held the engine's fence (new calls wait; "
           "\"wait\" includes draining the calls in flight)", label="in_flight"),
    Metric("weight_update_pause_seconds", COUNTER, "seconds", "time updates kept the engine loop paused (no forward "
           "runs)", label="in_flight"),
    Metric("recomputed_requests", COUNTER, "requests", "requests in flight whose KV a \"recompute\" update recomputed"),
    Metric("recompute_tokens", COUNTER, "tokens", "KV tokens recomputed under the new weights by \"recompute\" "
           "updates"),
    Metric("env_step_errors", COUNTER, "steps", "environment steps that raised or timed out"),
    Metric("draft_tokens", COUNTER, "tokens", "speculation: draft tokens fed to verify forwards"),
    Metric("draft_accepted_tokens", COUNTER, "tokens", "of draft_tokens, kept (each the very token plain decoding "
           "samples there)"),
    Metric("draft_rolled_back_tokens", COUNTER, "tokens", "of draft_tokens, rolled back (their KV positions freed)"),
    Metric("draft_verify_row_steps", COUNTER, "row-steps", "a row's step that verified drafts (one forward position "
           "per draft, plus its own)"),
    Metric("tokens_by_versions_behind", HISTOGRAM, "tokens", "model tokens of finished rows by how many versions "
           "the engine's weights had moved on from those that made the token, when the row finished"),
    Metric("env_step_seconds", HISTOGRAM, "seconds", "environment step latency (make_env included on the first)"),
    Metric("requests_waiting", GAUGE, "requests", "engine requests submitted and not yet scheduled"),
    Metric("requests_running", GAUGE, "requests", "engine requests scheduled (prefilling or decoding; a prompt's "
           "n samples count as n once its prefill forks)"),
    Metric("episodes_in_env_step", GAUGE, "episodes", "episodes whose environment step is running"),
    Metric("kv_pages_total", GAUGE, "pages", "KV cache size (0 while asleep)"),
    Metric("kv_pages_used", GAUGE, "pages", "pages held by requests"),
    Metric("kv_pages_cached", GAUGE, "pages", "pages held only by the prefix cache (evicted first under pressure)"),
    Metric("kv_pages_free", GAUGE, "pages", "pages neither used nor cached"),
    Metric("kv_pages_peak", GAUGE, "pages", "most pages held by requests at once since the worker started (fleet: "
           "the most of any actor)", combine="max"),
    Metric("prefix_cache_hit_rate", GAUGE, "ratio", "prefix_cache_reused_tokens / prompt_tokens since the start"),
    Metric("draft_tokens_per_row_step", GAUGE, "tokens", "speculation: tokens a verifying row's step emits on average "
           "((draft_accepted_tokens + draft_verify_row_steps) / draft_verify_row_steps; 1 without drafts)"),
    Metric("draft_history_bytes", GAUGE, "bytes", "speculation: memory the history draft source holds"),
    Metric("policy_version", GAUGE, "version", "the weights version rows are generated with now", combine="max"),
    Metric("sleeping", GAUGE, "workers", "1 while the worker sleeps (fleet: actors asleep)"),
)

FLEET_METRICS: tuple[Metric, ...] = (
    Metric("actors_ready", GAUGE, "actors", "actors started and alive"),
    Metric("actor_replacements", COUNTER, "actors", "actors replaced after they died, hung or timed out"),
    Metric("dispatch_imbalance", GAUGE, "ratio", "the last generate call's busiest actor's tokens over the mean of "
           "the actors' (1.0 = perfectly even)"),
    Metric("weight_syncs", COUNTER, "updates", "update_weights calls that reached every actor"),
    Metric("weight_sync_seconds", COUNTER, "seconds", "time update_weights took, from send to every actor agreeing"),
    Metric("weight_sync_bytes", COUNTER, "bytes", "bytes of tensors update_weights sent (once, whatever the actors)"),
)

VERSIONS_BEHIND_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32)  # Prometheus buckets of tokens_by_versions_behind


@dataclass(frozen=True)
class Histogram:
    """Observations by upper bound: counts[i] of values <= bounds[i] (and above bounds[i-1]); counts[-1] above all."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0
    count: int = 0

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def __add__(self, other: "Histogram") -> "Histogram":
        if other.bounds != self.bounds:
            raise ValueError(f"histograms with bounds {self.bounds} and {other.bounds} cannot be added")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)), self.sum + other.sum,
                         self.count + other.count)


@dataclass(frozen=True)
class WorkerMetrics:
    """One worker's snapshot (see METRICS for every field's unit and meaning)."""

    generated_tokens: int = 0
    sampled_tokens: int = 0
    prompt_tokens: int = 0
    prefix_cache_reused_tokens: int = 0
    prefill_tokens: int = 0
    rows_finished: dict[str, int] = field(default_factory=dict)
    episodes_finished: dict[str, int] = field(default_factory=dict)
    episode_turns: int = 0
    preemptions: int = 0
    engine_restarts: int = 0
    engine_sleeps: int = 0
    aborted_samples: int = 0
    weight_updates: dict[str, int] = field(default_factory=dict)
    weight_update_seconds: dict[str, float] = field(default_factory=dict)
    weight_update_pause_seconds: dict[str, float] = field(default_factory=dict)
    recomputed_requests: int = 0
    recompute_tokens: int = 0
    env_step_errors: int = 0
    draft_tokens: int = 0
    draft_accepted_tokens: int = 0
    draft_rolled_back_tokens: int = 0
    draft_verify_row_steps: int = 0
    tokens_by_versions_behind: dict[int, int] = field(default_factory=dict)  # versions behind -> tokens (exact)
    env_step_seconds: Histogram | None = None
    requests_waiting: int = 0
    requests_running: int = 0
    episodes_in_env_step: int = 0
    kv_pages_total: int = 0
    kv_pages_used: int = 0
    kv_pages_cached: int = 0
    kv_pages_free: int = 0
    kv_pages_peak: int = 0
    prefix_cache_hit_rate: float = 0.0
    draft_tokens_per_row_step: float = 1.0
    draft_history_bytes: int = 0
    policy_version: int = 0
    sleeping: int = 0

    @classmethod
    def of(cls, counters: Any, engine: dict[str, int]) -> "WorkerMetrics":
        """From the engine's counters and its own counts (`Engine.metrics()`)."""
        prompt, reused = engine["prompt_tokens"], engine["prefix_cache_reused_tokens"]
        kv_free = engine["kv_pages_total"] - engine["kv_pages_used"] - engine["kv_pages_cached"]
        hist = counters.env_step_seconds
        return cls(
            generated_tokens=counters.generated_tokens, sampled_tokens=counters.sampled_tokens,
            prefill_tokens=prompt - reused, rows_finished=dict(counters.rows_finished),
            episodes_finished=dict(counters.episodes_finished), episode_turns=counters.episode_turns,
            preemptions=counters.preemptions, engine_sleeps=counters.sleeps,
            weight_updates=dict(counters.weight_updates), weight_update_seconds=dict(counters.weight_update_seconds),
            weight_update_pause_seconds=dict(counters.weight_update_pause_seconds),
            recompute_tokens=counters.recompute_tokens, env_step_errors=counters.env_step_errors,
            tokens_by_versions_behind=dict(sorted(counters.tokens_by_versions_behind.items())),
            env_step_seconds=Histogram(hist.bounds, tuple(hist.counts), hist.sum, hist.count),
            kv_pages_free=max(kv_free, 0), kv_pages_peak=counters.kv_pages_peak,
            prefix_cache_hit_rate=reused / prompt if prompt else 0.0,
            draft_tokens_per_row_step=_per_row_step(engine), **engine)

    @property
    def kv_cache_usage(self) -> float:
        """kv_pages_used / kv_pages_total (0 while asleep)."""
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0

    def flat(self, prefix: str = "rollout/") -> dict[str, float]:
        """Every number under a tracker key: `prefix + name`; per label `name/<label>`; a histogram's count and mean
        (`name/count`, `name/mean`), and tokens_by_versions_behind per versions behind (`.../<k>`)."""
        return _flat(self, METRICS, prefix)

    def __add__(self, other: "WorkerMetrics") -> "WorkerMetrics":
        """Two workers together (a fleet's total): sums, or the max where the metric says so."""
        values = {}
        for metric in METRICS:
            a, b = getattr(self, metric.name), getattr(other, metric.name)
            values[metric.name] = _combine(a, b, metric.combine)
        prompt, reused = values["prompt_tokens"], values["prefix_cache_reused_tokens"]
        values["prefix_cache_hit_rate"] = reused / prompt if prompt else 0.0
        values["draft_tokens_per_row_step"] = _per_row_step(values)
        return WorkerMetrics(**values)

    def counters_only(self) -> "WorkerMetrics":
        """The counters and histograms, gauges at 0: what a replaced actor still adds to a fleet's totals."""
        return dataclasses.replace(self, **{m.name: _zero(getattr(self, m.name)) for m in METRICS if m.kind == GAUGE})


@dataclass(frozen=True)
class FleetMetrics:
    """A fleet's snapshot: `total` (every actor's counters, replaced actors' included; gauges of the live ones),
    `actors` (slot -> that slot's live actor), and the fleet's own figures (see FLEET_METRICS)."""

    total: WorkerMetrics
    actors: dict[int, WorkerMetrics]
    actors_ready: int = 0
    actor_replacements: int = 0
    dispatch_imbalance: float = 1.0
    weight_syncs: int = 0
    weight_sync_seconds: float = 0.0
    weight_sync_bytes: int = 0

    def flat(self, prefix: str = "rollout/") -> dict[str, float]:
        """The totals' keys (as WorkerMetrics.flat), plus the fleet's own under `prefix + "fleet_" + name`."""
        return {**self.total.flat(prefix), **_flat(self, FLEET_METRICS, prefix + "fleet_")}


def _flat(snapshot: Any, metrics: tuple[Metric, ...], prefix: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in metrics:
        value = getattr(snapshot, metric.name)
        key = prefix + metric.name
        if isinstance(value, Histogram):
            out[f"{key}/count"], out[f"{key}/mean"] = float(value.count), value.mean
        elif isinstance(value, dict):
            for label, number in value.items():
                out[f"{key}/{label}"] = float(number)
            if metric.kind == HISTOGRAM:  # tokens_by_versions_behind
                count = sum(value.values())
                out[f"{key}/count"] = float(count)
                out[f"{key}/mean"] = sum(k * v for k, v in value.items()) / count if count else 0.0
        elif value is not None:
            out[key] = float(value)
    return out


def _combine(a: Any, b: Any, how: str) -> Any:
    if isinstance(a, dict):
        keys = sorted(set(a) | set(b), key=lambda k: (str(type(k)), k))
        return {k: _combine(a.get(k, 0), b.get(k, 0), how) for k in keys}
    if a is None or b is None:  # a histogram one side has not got
        return b if a is None else a
    return max(a, b) if how == "max" else a + b


def _per_row_step(counts: dict) -> float:
    steps = counts.get("draft_verify_row_steps", 0)
    return (counts.get("draft_accepted_tokens", 0) + steps) / steps if steps else 1.0


def _zero(value: Any) -> Any:
    return 0.0 if isinstance(value, float) else 0


def fleet_total(actors: list[WorkerMetrics], retired: WorkerMetrics | None = None) -> WorkerMetrics:
    """The sum of live actors' snapshots and what replaced actors had counted."""
    total = retired if retired is not None else WorkerMetrics()
    for snapshot in actors:
        total = total + snapshot
    return total
