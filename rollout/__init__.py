"""rollout: exact, fast, unkillable RL rollouts on transformers' continuous-batching engine.

The public API is what `__all__` names (trainers_integration imports nothing else of rollout but `rollout.base`
and `rollout.testing`). Folders name their layer, and dependencies point one way (tests/test_layout.py):
base (the shared vocabulary) <- moe <- engine <- model <- worker <- fleet; scoring, metrics, envs and the collector
sit beside the worker; server and cli on top. Importing rollout changes nothing in transformers: the engine installs
its hooks on upstream's private code when an engine is first built (rollout/engine/upstream/).
"""

from .base.batch import RolloutBatch
from .base.config import WorkerConfig
from .base.env import Environment, EpisodeSpec, Turn
from .base.errors import InvalidArgument
from .base.params import SamplingParams
from .base.rollouts import Rollouts, RolloutsFuture
from .base.speculation import Speculation
from .base.structured import Structured

__version__ = "0.1.0"
__all__ = ["Environment", "EpisodeSpec", "FleetResources", "InvalidArgument", "PromptsExhausted", "RolloutBatch",
           "RolloutCollector", "RolloutFleet", "RolloutWorker", "Rollouts", "RolloutsFuture", "SamplingParams",
           "Speculation", "Structured", "ToolEnvironment", "Turn", "WorkerConfig", "adapters", "fingerprint",
           "nonzero_std", "pad_token_id", "replay_routing", "score", "serve"]

# heavy imports (transformers, Ray, fastapi) only when used: `rollout --help` stays instant
_LAZY = {"RolloutWorker": "worker", "RolloutFleet": "fleet", "FleetResources": "fleet",
         "RolloutCollector": "collector", "PromptsExhausted": "collector", "nonzero_std": "collector",
         "ToolEnvironment": "envs", "serve": "server", "replay_routing": "moe", "score": "scoring",
         "fingerprint": "model.weights", "pad_token_id": "model.loading"}


def __getattr__(name: str):
    if name == "adapters":  # a public module: PEFT adapters' names, exact merge, adapter-only state dicts
        from .model import adapters

        return adapters
    if name not in _LAZY:
        raise AttributeError(f"module 'rollout' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
