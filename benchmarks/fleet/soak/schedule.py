"""The fault schedule: drawn from the seed alone, so a seed names a run (its faults, their times and targets).

Faults arrive as a Poisson process (mean gap `mean_gap_s`), each of a kind drawn with the weights below; a Ray node
kill (the slowest to recover: the node re-joins after `rejoin_s`) is placed separately, once per `node_every_s` of
the run (at least once), away from the ends of the run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# kind -> relative weight. Engine deaths and actor kills cost a rebuild each (seconds on 2 cores): fewer of them.
WEIGHTS = {
    "actor_kill": 1.0,
    "engine_death_fleet": 1.0,
    "engine_death_server": 1.5,
    "env_raise": 1.0,
    "env_hang": 1.0,
    "env_garbage": 1.0,
    "disconnect": 2.0,
    "cancel": 1.5,
    "timeout": 1.5,
    "sleep_wake_fleet": 0.7,
    "sleep_wake_server": 1.0,
    "kv_exhaustion": 1.0,
    "oversized": 1.5,
    "malformed": 2.0,
}
KINDS = ("node_kill", *WEIGHTS)


@dataclass(frozen=True)
class Fault:
    """One fault: `kind` at `at_s` seconds into the run; `arg` (drawn) picks its target and variant."""

    id: int
    at_s: float
    kind: str
    arg: int


def draw(seed: int, duration_s: float, mean_gap_s: float = 2.0, node_every_s: float = 240.0,
         warmup_s: float = 3.0) -> list[Fault]:
    """The faults of a run of `duration_s` seconds, in time order. The same arguments give the same list."""
    rng = random.Random(f"chaos-schedule-{seed}")
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    timed: list[tuple[float, str, int]] = []
    t = warmup_s
    while True:
        t += rng.expovariate(1.0 / mean_gap_s)
        if t >= duration_s:
            break
        timed.append((t, rng.choices(kinds, weights)[0], rng.randrange(1 << 30)))
    num_nodes = max(1, int(duration_s // node_every_s))
    span = duration_s / num_nodes
    for k in range(num_nodes):  # one per span, in its middle half: the run sees the kill and the re-join
        timed.append((k * span + span * rng.uniform(0.25, 0.6), "node_kill", rng.randrange(1 << 30)))
    timed.sort()
    return [Fault(i, round(at, 3), kind, arg) for i, (at, kind, arg) in enumerate(timed)]
