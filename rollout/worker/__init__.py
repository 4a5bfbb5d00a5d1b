"""The worker layer: one engine in this process behind the `Rollouts` contract.

`worker.py` (RolloutWorker: generate, submit, score, weights, sleep, metrics), `future.py` (RolloutFuture: a
submitted call), `validation.py` (a call's inputs turned into validated token-id prompts before anything is
submitted). May import: torch, rollout.base, rollout.moe, rollout.engine, rollout.model, rollout.metrics and
rollout.scoring; never Ray, the fleet, the server or the collector (tests/test_layout.py checks it).
"""

from .future import RolloutFuture
from .worker import RolloutWorker

__all__ = ["RolloutFuture", "RolloutWorker"]
