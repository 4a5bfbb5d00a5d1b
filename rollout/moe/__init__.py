"""Mixture-of-experts support: finding and proving a model's routers (`routers.py`), and replaying recorded routing
in a trainer's forward (`replay.py`). What a rollout records is `rollout.base.routing.Routing`; the engine's recorder
(rollout/engine/observe/recorder.py) fills it. May import: torch and rollout.base (tests/test_layout.py checks it).
"""

from ..base.routing import Routing, routing_dtype
from .replay import replay_routing
from .routers import Router, capture_routing, find_routers, gate_weights, layer_name

__all__ = ["Router", "Routing", "capture_routing", "find_routers", "gate_weights", "layer_name", "replay_routing",
           "routing_dtype"]
