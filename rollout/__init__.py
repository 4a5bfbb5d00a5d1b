"""rollout: exact, fast, unkillable RL rollouts on transformers' continuous-batching engine."""

from .batch import RolloutBatch
from .config import WorkerConfig
from .env import Environment, EpisodeSpec, Turn
from .params import SamplingParams
from .rollouts import Rollouts

__version__ = "0.1.0"
__all__ = ["Environment", "EpisodeSpec", "FleetResources", "PromptsExhausted", "RolloutBatch", "RolloutCollector",
           "RolloutFleet", "RolloutWorker", "Rollouts", "SamplingParams", "ToolEnvironment", "Turn", "WorkerConfig",
           "nonzero_std", "replay_routing", "score", "serve"]


def __getattr__(name: str):  # heavy imports (transformers, Ray) only when used: `rollout --help` stays instant
    if name == "RolloutWorker":
        from .worker import RolloutWorker

        return RolloutWorker
    if name == "RolloutFleet":  # imports Ray lazily
        from .fleet.fleet import RolloutFleet

        return RolloutFleet
    if name == "FleetResources":
        from .fleet.resources import FleetResources

        return FleetResources
    if name in ("RolloutCollector", "PromptsExhausted", "nonzero_std"):
        from . import collector

        return getattr(collector, name)
    if name == "ToolEnvironment":
        from .tools import ToolEnvironment

        return ToolEnvironment
    if name == "serve":  # imports fastapi and uvicorn lazily
        from .server import serve

        return serve
    if name == "replay_routing":
        from .replay import replay_routing

        return replay_routing
    if name == "score":
        from .scoring import score

        return score
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
