"""TurnTrace: when an episode's next turn is ready and when the engine serves it, for benchmarks and diagnosis.

Off by default (`Engine.trace is None`: nothing is recorded, nothing costs). `engine.trace = TurnTrace()` records
- every engine step's start and end (the loop thread, `RolloutManager._generation_step`);
- for every turn after an episode's first: when its environment answered (the observation is ready) and when the
  engine sampled that turn's first token (the end of the step that prefilled it).

`summary()` gives the ready -> first-token latency per turn (p50, p99) against the median step, and the fraction of
the traced wall time during which some turn was ready and no step was running: the engine idling while it had work.
"""

from __future__ import annotations

import statistics
import threading
import time


class TurnTrace:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.steps: list[tuple[float, float]] = []
        self.waits: list[tuple[float, float]] = []  # (observation ready, first token of the next turn)
        self._ready: dict[str, float] = {}
        self._lock = threading.Lock()

    def step(self, start: float, end: float) -> None:
        self.steps.append((start, end))

    def ready(self, request_id: str, at: float) -> None:
        with self._lock:
            self._ready[request_id] = at

    def sampled(self, request_ids: list[str], at: float) -> None:
        """One step's sampled requests (engine thread): the first token of a traced turn ends its wait."""
        if not self._ready:
            return
        with self._lock:
            for request_id in request_ids:
                ready = self._ready.pop(request_id, None)
                if ready is not None:
                    self.waits.append((ready, at))

    def summary(self, end: float | None = None) -> dict[str, float]:
        end = time.perf_counter() if end is None else end
        wall = max(end - self.start, 1e-9)
        latencies = sorted(b - a for a, b in self.waits)
        durations = sorted(b - a for a, b in self.steps)
        return {
            "turns": len(latencies),
            "latency_p50_s": _quantile(latencies, 0.5), "latency_p99_s": _quantile(latencies, 0.99),
            "step_p50_s": statistics.median(durations) if durations else 0.0, "steps": len(durations),
            "idle_with_ready_s": idle_while_waiting(self.waits, self.steps),
            "idle_with_ready_fraction": idle_while_waiting(self.waits, self.steps) / wall, "wall_s": wall,
        }


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
