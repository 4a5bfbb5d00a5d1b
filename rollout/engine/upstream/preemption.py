"""RolloutOffloading: upstream's offloading manager, counting the requests it preempts.

Under KV pressure the batch processor calls `offloading_manager.offload_requests()`, which takes requests out of the
scheduler's active set and requeues them: to the CPU swap pool if it has room (none here: `cpu_offload_space` stays
0, see switch.py), else soft reset (their KV dropped, to be prefilled again from their tokens). Every request that
leaves the active set in that call is a preemption; `on_preempt(request_ids)` (set by the engine) gets their ids.
The call runs only under pressure, so the copy of the active ids it takes costs nothing in the common case.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.generation.continuous_batching.offloading_manager import OffloadingManager


class RolloutOffloading(OffloadingManager):
    on_preempt: Callable[[list[str]], None]

    @classmethod
    def adopt(cls, manager: OffloadingManager, on_preempt: Callable[[list[str]], None]) -> None:
        manager.__class__ = cls
        manager.on_preempt = on_preempt

    def offload_requests(self) -> bool:
        active = set(self.scheduler.active_requests)
        offloaded = super().offload_requests()
        preempted = sorted(active - set(self.scheduler.active_requests))
        if preempted:
            self.on_preempt(preempted)
        return offloaded
