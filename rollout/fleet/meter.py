"""FleetMeter: what a RolloutFleet counts itself, and how its actors' snapshots add up. Pure bookkeeping: no Ray.

The fleet keeps each slot's latest snapshot (`seen`, taken by `RolloutFleet.metrics()`). When a slot's actor is
replaced, the counters of its last snapshot move to `retired`, so the fleet's totals never go down: they hold every
actor's counts as of the last snapshot taken of it (what a dead actor counted after that is lost with it, as are the
rows it had not returned; the fleet re-runs those elsewhere, where they are counted).
"""

from __future__ import annotations

import threading

from ..metrics.snapshot import FleetMetrics, WorkerMetrics, fleet_total


class FleetMeter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seen: dict[int, WorkerMetrics] = {}  # slot -> its live actor's latest snapshot
        self.retired = WorkerMetrics()  # counters of replaced actors
        self.dispatch_imbalance = 1.0
        self.weight_syncs = 0
        self.weight_sync_seconds = 0.0
        self.weight_sync_bytes = 0

    def actor_seen(self, slot: int, snapshot: WorkerMetrics) -> None:
        with self._lock:
            self.seen[slot] = snapshot

    def actor_replaced(self, slot: int) -> None:
        with self._lock:
            last = self.seen.pop(slot, None)
            if last is not None:
                self.retired = self.retired + last.counters_only()

    def dispatched(self, tokens_by_slot: dict[int, int], num_actors: int) -> None:
        """One generate call's tokens (prompt + completion) per actor that ran them, over `num_actors` actors (a call
        with nothing to run leaves the figure as it was)."""
        if not tokens_by_slot:
            return
        mean = sum(tokens_by_slot.values()) / max(num_actors, 1)
        with self._lock:
            self.dispatch_imbalance = max(tokens_by_slot.values()) / mean if mean else 1.0

    def weight_sync(self, seconds: float, num_bytes: int) -> None:
        with self._lock:
            self.weight_syncs += 1
            self.weight_sync_seconds += seconds
            self.weight_sync_bytes += num_bytes

    def snapshot(self, actors_ready: int, actor_replacements: int) -> FleetMetrics:
        with self._lock:
            actors = dict(sorted(self.seen.items()))
            return FleetMetrics(fleet_total(list(actors.values()), self.retired), actors, actors_ready,
                                actor_replacements, self.dispatch_imbalance, self.weight_syncs,
                                self.weight_sync_seconds, self.weight_sync_bytes)
