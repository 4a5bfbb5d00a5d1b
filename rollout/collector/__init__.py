"""The collector: over-sampling, dynamic sampling and partial rollouts over any `Rollouts` (worker or fleet).

`collector.py` (RolloutCollector, nonzero_std, PromptsExhausted), `source.py` (its prompt stream: each prompt drawn
becomes a group with its place in the stream). May import: rollout.base and rollout.model (the pad-id fallback);
it drives a worker or a fleet only through the `Rollouts` contract (tests/test_layout.py checks it).
"""

from .collector import PromptsExhausted, RolloutCollector, nonzero_std

__all__ = ["PromptsExhausted", "RolloutCollector", "nonzero_std"]
