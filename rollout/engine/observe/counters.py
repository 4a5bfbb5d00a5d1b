"""Counters: what the engine counts as it runs, read by `RolloutWorker.metrics()` (rollout/metrics/snapshot.py names them).

One `Counters` per Engine, kept across engine restarts and sleeps (the manager is rebuilt, this object is not), so
every count only grows. Each update is a few integer operations on a path that already runs once per step, per
finished request, per environment step or per weight update; nothing here runs per token in Python (a row's tokens
are counted by `list.count`, in C). Writers hold the engine's lock, or are the engine thread's own single-integer
updates (`sampled`, `kv_step`, `preempted`); `Engine.metrics` copies them under the lock.

`NullCounters` counts nothing: the benchmark's stubbed build (benchmarks/throughput/bench_rollout.py --metrics-ab) measures
what counting costs against it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

from ..upstream import kv_pages

# seconds: an environment step is a tool call, a sandbox run or a judge; from sub-millisecond to minutes
ENV_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Histogram:
    """Observations by upper bound (`bounds`, ascending; a last bucket above them all), with their sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> "Histogram":
        other = Histogram(self.bounds)
        other.counts, other.sum, other.count = list(self.counts), self.sum, self.count
        return other


class Counters:
    def __init__(self) -> None:
        self.sampled_tokens = 0  # every token the engine sampled, discarded ones included
        self.generated_tokens = 0  # model tokens of finished rows
        self.rows_finished: dict[str, int] = {}  # by finish reason
        self.episodes_finished: dict[str, int] = {}
        self.episode_turns = 0
        self.tokens_by_versions_behind: dict[int, int] = {}  # finished rows' model tokens, by versions behind
        self.preemptions = 0  # requests whose KV the engine dropped under KV pressure (soft resets)
        self.kv_pages_peak = 0
        self.weight_updates: dict[str, int] = {}  # by in_flight mode
        self.weight_update_seconds: dict[str, float] = {}  # the fence held (new submissions wait)
        self.weight_update_pause_seconds: dict[str, float] = {}  # the loop paused (no forward runs)
        self.recompute_tokens = 0  # KV tokens recomputed under new weights by "recompute" updates
        self.env_step_seconds = Histogram(ENV_STEP_BUCKETS)
        self.env_step_errors = 0
        self.sleeps = 0

    # ------------------------------------------------------------------ engine thread, no lock
    def sampled(self, num_tokens: int) -> None:
        self.sampled_tokens += num_tokens

    def kv_step(self, cache) -> None:
        """After each step's scheduling (its pages allocated): the peak of pages held by requests."""
        used = kv_pages(cache)[1]
        if used > self.kv_pages_peak:
            self.kv_pages_peak = used

    def preempted(self, num_requests: int) -> None:
        self.preemptions += num_requests

    # ------------------------------------------------------------------ engine lock held
    def row(self, reason: str, versions: list[int], current: int) -> None:
        """A finished row without an environment: `versions` per token, `current` the engine's version now."""
        self.rows_finished[reason] = self.rows_finished.get(reason, 0) + 1
        if versions and versions.count(versions[0]) == len(versions):  # the common case: one version made the row
            self._behind(current - versions[0], len(versions))
        else:
            for version, num in Counter(versions).items():
                self._behind(current - version, num)
        self.generated_tokens += len(versions)

    def episode(self, reason: str, versions: list[int], current: int, turns: int, rows: int = 1) -> None:
        """A finished episode of `rows` rows (one per segment): `versions` per completion token, -1 on
        observations."""
        self.rows_finished[reason] = self.rows_finished.get(reason, 0) + rows
        self.episodes_finished[reason] = self.episodes_finished.get(reason, 0) + 1
        self.episode_turns += turns
        for version, num in Counter(versions).items():
            if version >= 0:
                self._behind(current - version, num)
                self.generated_tokens += num

    def env_step(self, seconds: float, failed: bool) -> None:
        self.env_step_seconds.observe(seconds)
        self.env_step_errors += failed

    def weight_update(self, mode: str, seconds: float, pause_seconds: float, recompute_tokens: int) -> None:
        self.weight_updates[mode] = self.weight_updates.get(mode, 0) + 1
        self.weight_update_seconds[mode] = self.weight_update_seconds.get(mode, 0.0) + seconds
        self.weight_update_pause_seconds[mode] = self.weight_update_pause_seconds.get(mode, 0.0) + pause_seconds
        self.recompute_tokens += recompute_tokens

    def slept(self) -> None:
        self.sleeps += 1

    def _behind(self, behind: int, num_tokens: int) -> None:
        self.tokens_by_versions_behind[behind] = self.tokens_by_versions_behind.get(behind, 0) + num_tokens

    def copy(self) -> "Counters":
        """A consistent copy (call with the engine's lock held)."""
        other = Counters()
        for name, value in vars(self).items():
            setattr(other, name, value.copy() if hasattr(value, "copy") else value)
        return other


class NullCounters(Counters):
    """Counts nothing (the stubbed build of the cost benchmark)."""

    def sampled(self, num_tokens: int) -> None: ...
    def kv_step(self, cache) -> None: ...
    def preempted(self, num_requests: int) -> None: ...
    def row(self, reason: str, versions: list[int], current: int) -> None: ...
    def episode(self, reason: str, versions: list[int], current: int, turns: int, rows: int = 1) -> None: ...
    def env_step(self, seconds: float, failed: bool) -> None: ...
    def weight_update(self, mode: str, seconds: float, pause_seconds: float, recompute_tokens: int) -> None: ...
