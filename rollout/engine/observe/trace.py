"""TurnTrace: when an episode's next turn is ready and when the engine serves it, for benchmarks and diagnosis.

Off by default (`Engine.trace is None`: nothing is recorded, nothing costs). `engine.trace = TurnTrace()` records
- every engine step's start and end (the loop thread, `RolloutManager._generation_step`);
- for every turn after an episode's first: when its environment answered (the observation is ready) and when the
  engine sampled that turn's first token (the end of the step that prefilled it).

`summary()` gives the ready -> first-token latency per turn (p50, p99) against the median step, and the fraction of
the traced wall time during which some turn was ready and no step was running: the engine idling while it had work.
It also splits each wait where it went: `boundary` (ready -> the start of the first step after it: the step already
running when the turn became ready finishing), `steps_started` (steps that began before the first token was sampled:
1 when the first step after the observation served the turn) and the duration of the step that sampled it (the
token's step: it prefilled the observation alongside every other row of that step).
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time


class TurnTrace:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.steps: list[tuple[float, float]] = []
        self.waits: list[tuple[float, float]] = []  # (observation ready, first token of the next turn)
        self._ready: dict[str, float] = {}
        self._mutex = threading.Lock()

    def step(self, start: float, end: float) -> None:
        self.steps.append((start, end))

    def ready(self, request_id: str, at: float) -> None:
        with self._mutex:
            self._ready[request_id] = at

    def sampled(self, request_ids: list[str], at: float) -> None:
        """One step's sampled requests (engine thread): the first token of a traced turn ends its wait."""
        if not self._ready:
            return
        with self._mutex:
            for request_id in request_ids:
                ready = self._ready.pop(request_id, None)
                if ready is not None:
                    self.waits.append((ready, at))

    def summary(self, end: float | None = None) -> dict[str, float]:
        end = time.perf_counter() if end is None else end
        wall = max(end - self.start, 1e-9)
        latencies = sorted(b - a for a, b in self.waits)
        durations = sorted(b - a for a, b in self.steps)
        idle = idle_while_waiting(self.waits, self.steps)
        return {
            "turns": len(latencies),
            "latency_p50_s": _quantile(latencies, 0.5), "latency_p99_s": _quantile(latencies, 0.99),
            "step_p50_s": statistics.median(durations) if durations else 0.0, "steps": len(durations),
            "idle_with_ready_s": idle, "idle_with_ready_fraction": idle / wall, "wall_s": wall,
            **wait_parts(self.waits, self.steps),
        }


def wait_parts(waits: list[tuple[float, float]], steps: list[tuple[float, float]]) -> dict[str, float]:
    """Medians of where each wait went: `boundary_p50_s` (ready -> the next step's start), `steps_started_p50` (steps
    begun between ready and the first token) and `token_step_p50_s` (the duration of the step before the token)."""
    steps = sorted(steps)
    starts = [a for a, _ in steps]
    boundary, started, token_step = [], [], []
    for ready, token in waits:
        first, last = bisect.bisect_right(starts, ready), bisect.bisect_left(starts, token)
        started.append(float(last - first))
        if first < len(starts) and first < last:
            boundary.append(starts[first] - ready)
            token_step.append(steps[last - 1][1] - steps[last - 1][0])
    return {"boundary_p50_s": _quantile(sorted(boundary), 0.5), "steps_started_p50": _quantile(sorted(started), 0.5),
            "token_step_p50_s": _quantile(sorted(token_step), 0.5)}


def idle_while_waiting(waits: list[tuple[float, float]], steps: list[tuple[float, float]]) -> float:
    """Seconds covered by some wait interval and by no step interval."""
    waiting = _union(waits)
    busy = _union(steps)
    total, j = 0.0, 0
    for a, b in waiting:
        covered = 0.0
        while j < len(busy) and busy[j][1] <= a:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < b:
            covered += min(b, busy[k][1]) - max(a, busy[k][0])
            k += 1
        total += (b - a) - covered
    return total


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]
