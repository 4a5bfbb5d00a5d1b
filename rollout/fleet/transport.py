"""How a weight update travels from the fleet's caller to its actors: one interface, two implementations.

A `WeightTransport` has a sending half, run by RolloutFleet in the caller's process under its lock, and a receiving
half, run inside each actor: `FleetActor.receive(transport, payload, version, full)` calls
`transport.receive(actor, payload)` and applies the tensors it returns atomically (`RolloutWorker.update_weights`,
validated again there). A transport that needs per-actor setup (a process group to join) does it through
`FleetActor.connect(transport, *args)`, which calls `transport.connect(actor, *args)`. The fleet itself never
names a transport's internals, so a third transport is one new file: a subclass of `WeightTransport`.

- `ObjectStore` (the default): the state dict goes into Ray's object store once, as numpy views (`to_shared`), and
  every actor reads it in place. What it sends is retained, so a replacement actor can replay it.
- `Collective`: a torch.distributed broadcast group (collective.py) with the caller as rank 0; nothing goes through
  the object store and nothing is retained (a replacement actor copies a live peer's weights instead).

If a transport cannot deliver to every ready actor it raises `TransportFailed`; the fleet then sends the same update
through the object store, so an update is never half-applied.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import ray
import torch

from .actor import from_shared, to_shared
from .collective import WeightGroup, free_port, layout

BUCKET_MB = 256  # the collective's bucket size: a 7B model is a few hundred broadcasts, not thousands


class ActorPool(Protocol):
    """What a transport's sending half may ask of the fleet."""

    def ready(self) -> dict[int, Any]:
        """slot -> actor handle of every started, live actor, in slot order."""

    def on_ready(self, call: Callable[[Any], Any]) -> tuple[dict[int, Any], list[int]]:
        """call(actor) -> object ref on every ready actor; (slot -> value, slots whose actor died: marked down)."""

    def replace(self, slot: int) -> None:
        """Start a new actor in `slot`, synced to the fleet's weights."""

    def await_starts(self) -> None:
        """Wait until every starting actor is ready."""

    def drop(self, slot: int) -> None:
        """Kill the actor in `slot` and mark it down (it is replaced once the fleet's state has settled)."""


class TransportFailed(RuntimeError):
    """Some ready actor did not get the update; the fleet sends it again through the object store."""


class WeightTransport(ABC):
    """One way to bring every ready actor to new weights (see the module docstring)."""

    @abstractmethod
    def send(self, pool: ActorPool, items: list[tuple[str, torch.Tensor]], version: int, full: bool,
             in_flight: str = "wait") -> Any:
        """Apply `items` on every ready actor, at `version`, under `in_flight` (a generate in flight on an actor
        goes on beside the update: `receive` runs in the actor's "weights" concurrency group). Returns what a replacement actor replays to reach this
        update (an object-store payload, as `ObjectStore` sends it), or None when nothing is retained. Raises
        TransportFailed when an actor may have missed it."""

    streamed = False  # True: `receive` yields the update bucket by bucket (applied as it lands, see FleetActor.receive)

    @staticmethod
    @abstractmethod
    def receive(actor: Any, payload: Any) -> Any:
        """In the actor: every tensor of one update, staged (the actor applies them all, or none); or, for a
        transport that streams, an iterator of buckets."""

    @staticmethod
    def connect(actor: Any, *args: Any) -> Any:
        """In the actor: per-actor setup, kept on `actor.links[transport]`. Nothing by default."""
        return None

    def actor_replaced(self) -> None:
        """The fleet replaced an actor: any membership the transport holds is stale."""

    def close(self) -> None:
        """Release what the sending half holds."""


class ObjectStore(WeightTransport):
    """One `ray.put` of numpy views of the tensors; each actor maps them in place (no per-actor copy or unpickle)."""

    def send(self, pool: ActorPool, items: list[tuple[str, torch.Tensor]], version: int, full: bool,
             in_flight: str = "wait") -> Any:
        ref = ray.put(to_shared(items))  # one copy into shared memory; actors read it in place
        # an actor that dies meanwhile is marked down; the fleet replaces it once its state has settled, and the
        # replacement replays `ref`
        pool.on_ready(lambda actor: _receive(actor).remote(ObjectStore, ref, version, full, in_flight))
        return ref

    @staticmethod
    def receive(actor: Any, payload: dict) -> dict[str, torch.Tensor]:
        return from_shared(payload)


class Collective(WeightTransport):
    """Broadcast over a torch.distributed group: this process is rank 0, the ready actors ranks 1..N. The group is
    rebuilt, before the next update, whenever an actor was replaced or died."""

    def __init__(self, pool: ActorPool, backend: str, timeout_s: float = 300) -> None:
        self.backend, self.timeout_s = backend, timeout_s
        self.group: WeightGroup | None = None
        self.stale = False
        self.join(pool)

    def join(self, pool: ActorPool) -> None:
        """(Re)build the group with the actors that are ready now; blocks until every rank has joined."""
        ready = pool.ready()
        host, port = ray.util.get_node_ip_address(), free_port()
        refs = [actor.connect.remote(Collective, self.backend, host, port, rank, len(ready) + 1, self.timeout_s)
                for rank, actor in enumerate(ready.values(), start=1)]
        self.group = None  # leave the previous group first
        self.group = WeightGroup(self.backend, host, port, 0, len(ready) + 1, self.timeout_s)
        ray.get(refs)
        self.stale = False

    def send(self, pool: ActorPool, items: list[tuple[str, torch.Tensor]], version: int, full: bool,
             in_flight: str = "wait") -> None:
        _, lost = pool.on_ready(lambda actor: actor.info.options(concurrency_group="control").remote())
        if lost or self.stale:  # membership changed: rebuild the group with the actors there are now
            for slot in lost:
                pool.replace(slot)
            pool.await_starts()
            self.join(pool)
        buckets = layout(items, bucket_mb=BUCKET_MB)
        ready = pool.ready()
        refs = [_receive(actor).remote(Collective, buckets, version, full, in_flight) for actor in ready.values()]
        try:
            self.group.send(buckets, dict(items))
            ray.get(refs)
            return None
        except Exception as exc:  # a rank died mid-broadcast: drop the group; who did not finish is replaced later
            self.stale = True
            finished, _ = ray.wait(refs, num_returns=len(refs), timeout=5)
            for slot, ref in zip(ready, refs):
                if ref not in finished:
                    pool.drop(slot)
            raise TransportFailed(f"broadcast over the {self.backend} group failed: {exc}") from exc

    @staticmethod
    def connect(actor: Any, backend: str, host: str, port: int, rank: int, world_size: int,
                timeout_s: float) -> int:
        actor.links.pop(Collective, None)  # leave any previous group first (its membership is stale)
        actor.links[Collective] = WeightGroup(backend, host, port, rank, world_size, timeout_s)
        return rank

    streamed = True  # the actor copies each bucket in as it lands (one staging buffer per dtype, not a full copy)

    @staticmethod
    def receive(actor: Any, payload: list) -> Iterator[dict[str, torch.Tensor]]:
        group = actor.links.get(Collective)
        if group is None:
            raise RuntimeError("a collective update reached an actor in no weight group (connect first)")
        return group.stream(payload)

    def actor_replaced(self) -> None:
        self.stale = True

    def close(self) -> None:
        self.group = None


def _receive(actor: Any) -> Any:
    """The actor's `receive`, in its "weights" concurrency group, so that it runs beside a generate in flight."""
    return actor.receive.options(concurrency_group="weights")
