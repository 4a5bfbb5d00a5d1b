"""The shared vocabulary: what every layer says to every other (a leaf: imports torch only).

`params.py` (SamplingParams), `config.py` (WorkerConfig and its in-flight modes), `batch.py` (RolloutBatch, Row, the
rewards check), `env.py` (the Environment protocol, Turn, EpisodeSpec), `routing.py` (Routing: a MoE row's experts),
`speculation.py` (Speculation: draft sources and limits for speculative rollouts), `errors.py` (InvalidArgument and
the checks that build it), `structured.py` (Structured: what a constrained row must write; its grammar is built by
xgrammar, an optional dependency imported only then), `rollouts.py` (the `Rollouts` and `RolloutsFuture` contracts
every worker, fleet and consumer keeps). May import: torch (and xgrammar, lazily, in structured.py); nothing else of
rollout (tests/test_layout.py checks it). Public: what `__all__` names, and trainers_integration may import it.
"""

from .batch import RolloutBatch, Row, rewards_tensor
from .config import WorkerConfig, check_in_flight
from .env import EnvFactory, Environment, EpisodeSpec, Turn
from .errors import InvalidArgument, check_int, invalid, preview
from .params import SamplingParams
from .rollouts import Rollouts, RolloutsFuture
from .routing import Routing
from .speculation import Speculation
from .structured import Structured

__all__ = ["EnvFactory", "Environment", "EpisodeSpec", "InvalidArgument", "RolloutBatch", "Rollouts",
           "RolloutsFuture", "Routing", "Row", "SamplingParams", "Speculation", "Structured", "Turn", "WorkerConfig",
           "check_in_flight", "check_int", "invalid", "preview", "rewards_tensor"]
