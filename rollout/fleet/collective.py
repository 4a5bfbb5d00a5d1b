"""Weight broadcast over a torch.distributed group: the trainer is rank 0, fleet actors are ranks 1..N.

The group is stateless: its own TCPStore and ProcessGroup object, never the default group, so a trainer that
already runs DDP/FSDP keeps its own `init_process_group` untouched. Tensors travel in buckets: each bucket is one
flat tensor of one dtype, at most `bucket_mb` (a lone bigger tensor gets a bucket of its own), so a 7B model is a
few hundred broadcasts, not thousands. Receivers take them one of two ways:
- `receive`: every bucket staged before anything is applied, so the update stays atomic whatever arrives (cost: one
  extra copy of the weights on each receiver while it lands);
- `stream`: each bucket handed over as it lands, in one staging buffer per dtype reused for every bucket (cost: the
  largest bucket, `bucket_mb`). Atomic towards rollouts (the receiver applies all buckets inside one fence) but not
  towards failure: a sender that dies mid-stream leaves the earlier buckets applied. RolloutFleet streams, because it
  validates the whole update before sending and replaces a receiver whose update failed midway.

Backends: "nccl" (GPU tensors; each rank on its own GPU) or "gloo" (CPU tensors; how it is tested here). The fleet
uses it through `transport.Collective`.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..base.errors import invalid

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Entry:
    """One named tensor's place in a WeightBucket."""

    name: str
    shape: tuple[int, ...]
    offset: int  # elements into the bucket
    numel: int


@dataclass(frozen=True)
class WeightBucket:
    """Tensors of one dtype that travel as one flat broadcast: `entries` say where each lies in it."""

    dtype: torch.dtype
    numel: int
    entries: tuple[Entry, ...]


def layout(items: list[tuple[str, torch.Tensor]], bucket_mb: float = 256) -> list[WeightBucket]:
    """Group tensors by dtype, in order, into buckets of at most bucket_mb."""
    limit = int(bucket_mb * 2**20)
    buckets: list[WeightBucket] = []
    filling: dict[torch.dtype, list[Entry]] = {}
    for name, tensor in items:
        entries = filling.setdefault(tensor.dtype, [])
        used = sum(e.numel for e in entries)
        if entries and (used + tensor.numel()) * tensor.element_size() > limit:
            buckets.append(WeightBucket(tensor.dtype, used, tuple(entries)))
            entries.clear()
            used = 0
        entries.append(Entry(name, tuple(tensor.shape), used, tensor.numel()))
    for dtype, entries in filling.items():
        if entries:
            buckets.append(WeightBucket(dtype, sum(e.numel for e in entries), tuple(entries)))
    return buckets


def pack(bucket: WeightBucket, tensors: dict[str, torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """flat: [bucket.numel] on `device`."""
    return torch.cat([tensors[e.name].detach().to(device=device, dtype=bucket.dtype).reshape(-1)
                      for e in bucket.entries])


def unpack(bucket: WeightBucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views into flat, one per entry, in their shapes."""
    return {e.name: flat[e.offset: e.offset + e.numel].view(e.shape) for e in bucket.entries}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class WeightGroup:
    """One rank of a broadcast group. Rank 0 hosts the store; construction blocks until every rank has joined."""

    def __init__(self, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300) -> None:
        if backend not in BACKENDS:
            raise invalid("backend", backend, f"must be one of {BACKENDS}",
                          "use 'nccl' for GPU actors, 'gloo' for CPU actors")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(self.store, rank, world_size, options)

    def send(self, buckets: list[WeightBucket], tensors: dict[str, torch.Tensor]) -> None:
        """Rank 0: broadcast every bucket."""
        for bucket in buckets:
            self.group.broadcast(pack(bucket, tensors, self.device), 0).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stream(self, buckets: list[WeightBucket]) -> Iterator[dict[str, torch.Tensor]]:
        """Ranks 1..N: the tensors of each bucket as it lands, as views of a staging buffer per dtype that the next
        bucket overwrites: consume (copy) a bucket before asking for the next."""
        staging: dict[torch.dtype, torch.Tensor] = {}
        for bucket in buckets:
            if bucket.dtype not in staging:
                largest = max(b.numel for b in buckets if b.dtype == bucket.dtype)
                staging[bucket.dtype] = torch.empty(largest, dtype=bucket.dtype, device=self.device)
            flat = staging[bucket.dtype][: bucket.numel]
            self.group.broadcast(flat, 0).wait()  # on NCCL, the current stream waits for it: later copies see it
            yield unpack(bucket, flat)

    def receive(self, buckets: list[WeightBucket]) -> dict[str, torch.Tensor]:
        """Ranks 1..N: every tensor of every bucket, staged before the caller applies any."""
        out: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.device)
            self.group.broadcast(flat, 0).wait()
            out.update(unpack(bucket, flat))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out
