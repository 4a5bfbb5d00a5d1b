"""The fleet layer: RolloutWorker's API on a pool of Ray actors.

Owns every Ray import in the package (tests/test_layout.py checks it). May import the worker layer (`rollout.worker`
and the leaf modules below it) and `rollout.scoring` (to check score pairs on the caller's side), never the engine's
internals directly. Files: `fleet.py` (RolloutFleet: dispatch,
recovery), `future.py` (FleetFuture: a submitted call, its groups streamed as they finish), `actor.py` (the actor
around one worker), `dispatch.py` (token-load dispatch), `resources.py` (placement),
`transport.py` (how weight updates reach the actors: the `WeightTransport` interface, the object store and the
collective; a new transport is one new file), `collective.py` (the torch.distributed group the collective uses),
`meter.py` (the fleet's own metrics and its actors' totals).
"""


def __getattr__(name: str):  # Ray is imported only when the fleet itself is used
    if name == "RolloutFleet":
        from .fleet import RolloutFleet

        return RolloutFleet
    if name == "FleetResources":
        from .resources import FleetResources

        return FleetResources
    raise AttributeError(f"module 'rollout.fleet' has no attribute {name!r}")
