"""FleetResources: what each fleet actor asks the cluster for, and the defaults derived from the cluster.

Pure data (no Ray): rollout.fleet turns it into actor options and a placement group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..base.errors import check_int, invalid

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class FleetResources:
    """Per-actor resources.

    num_cpus: per actor; None: 1 for GPU actors, else a fraction (the actors share half the cluster's CPUs, so a
        replacement can be scheduled while a dead actor's share is still being released; this assumes one fleet per
        cluster: give num_cpus when several fleets share one).
    num_gpus: per actor (a fraction shares a GPU).
    placement: placement-group strategy, one bundle per actor: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD; None: PACK
        for GPU actors, no group for CPU actors.
    torch_threads: intra-op threads per actor; None: this node's CPUs / num_workers for CPU actors, torch's default
        for GPU actors.
    custom: extra Ray resources per actor, e.g. {"accelerator_type:H100": 0.001}.
    """

    num_cpus: float | None = None
    num_gpus: float = 0
    placement: str | None = None
    torch_threads: int | None = None
    custom: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_cpus is not None and (isinstance(self.num_cpus, bool) or
                                          not isinstance(self.num_cpus, (int, float)) or self.num_cpus < 0):
            raise invalid("num_cpus", self.num_cpus, "must be a number >= 0", "use e.g. 0.5 on CPU, 1 on GPU")
        if isinstance(self.num_gpus, bool) or not isinstance(self.num_gpus, (int, float)) or self.num_gpus < 0:
            raise invalid("num_gpus", self.num_gpus, "must be a number >= 0", "use 1 per actor, or 0 on CPU")
        if self.placement is not None and self.placement not in PLACEMENTS:
            raise invalid("placement", self.placement, f"must be one of {PLACEMENTS} or None",
                          "use 'PACK' (actors on as few nodes as possible) or 'SPREAD'")
        if self.torch_threads is not None:
            check_int("torch_threads", self.torch_threads, 1, "use None for the default")

    @classmethod
    def of(cls, value: "FleetResources | dict | None") -> "FleetResources":
        if isinstance(value, FleetResources):
            return value
        if value is not None and not isinstance(value, dict):
            raise invalid("resources", type(value).__name__, "must be a FleetResources, a dict or None",
                          "pass e.g. {'num_gpus': 1}")
        return cls(**(value or {}))

    def cpus(self, cluster_cpus: float, num_workers: int) -> float:
        if self.num_cpus is not None:
            return self.num_cpus
        if self.num_gpus > 0:
            return 1
        return round(min(1.0, cluster_cpus / (2 * num_workers)), 4)  # Ray's resource precision is 1e-4

    def threads(self, num_workers: int) -> int | None:
        if self.torch_threads is not None or self.num_gpus > 0:
            return self.torch_threads
        return max(1, (os.cpu_count() or 1) // num_workers)

    def strategy(self) -> str | None:
        return self.placement or ("PACK" if self.num_gpus > 0 else None)

    def bundle(self, cluster_cpus: float, num_workers: int) -> dict[str, float]:
        """One actor's placement-group bundle."""
        wanted = {"CPU": self.cpus(cluster_cpus, num_workers), "GPU": self.num_gpus, **self.custom}
        bundle = {name: amount for name, amount in wanted.items() if amount}
        if not bundle:
            raise invalid("resources", self, "a placement group needs a non-zero resource per actor",
                          "give num_cpus > 0 or num_gpus > 0, or placement=None")
        return bundle
