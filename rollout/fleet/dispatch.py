"""Dispatcher: which actor runs which jobs, by outstanding token load. Pure bookkeeping: no Ray, no torch.

A job is one prompt with all its samples (they share a prefill, so a job is never split across actors) or one
scoring pair. Its cost estimates the tokens it runs: prompt + n * max_new_tokens. Jobs are dealt, biggest first, into
workers * chunks_per_worker chunks, each job to the chunk with the least cost so far (LPT), so chunks carry similar
loads and similar mixes of long and short jobs. The heaviest pending chunk goes to the actor with the least outstanding
load among those with room (`max_in_flight` chunks each; the fleet uses 1, so pending chunks wait in the queue, never
behind a busy actor, and a free or freshly restarted actor pulls the next one). A fast actor drains its load sooner
and so takes more chunks. One chunk per worker gives each engine the biggest batch; more chunks rebalance better when
actors differ in speed and lose less work when one dies.

When an actor dies, every chunk it held goes back to the front of the queue for the others, less the jobs whose
results it streamed back before dying; a job whose actor died `max_attempts` times is reported (it is probably what
kills them) instead of being retried forever.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    jobs: tuple[int, ...]  # indices into the call's jobs, ascending
    cost: int


class Dispatcher:
    def __init__(self, costs: Sequence[int], slots: Iterable[int], chunks_per_worker: int = 1,
                 max_in_flight: int = 1, max_attempts: int = 3) -> None:
        if any(c < 1 for c in costs):
            raise ValueError(f"costs must all be >= 1, got min {min(costs)}")
        self.costs = list(costs)
        self.max_in_flight = max_in_flight
        self.max_attempts = max_attempts
        slots = list(slots)
        self.pending: deque[Chunk] = deque(_deal(self.costs, max(1, len(slots)) * chunks_per_worker))
        self.running: dict[int, list[Chunk]] = {slot: [] for slot in slots}
        self.attempts = [0] * len(self.costs)

    @property
    def finished(self) -> bool:
        return not self.pending and not any(self.running.values())

    def load(self, slot: int) -> int:
        """Outstanding estimated tokens on an actor."""
        return sum(chunk.cost for chunk in self.running.get(slot, ()))

    def assign(self, ready: Iterable[int]) -> list[tuple[int, Chunk]]:
        """Hand out pending chunks to ready actors with room, least loaded first."""
        ready = [slot for slot in ready if slot in self.running]
        out = []
        while self.pending:
            free = [slot for slot in ready if len(self.running[slot]) < self.max_in_flight]
            if not free:
                break
            slot = min(free, key=lambda s: (self.load(s), len(self.running[s]), s))
            chunk = self.pending.popleft()
            self.running[slot].append(chunk)
            out.append((slot, chunk))
        return out

    def complete(self, slot: int, chunk: Chunk) -> None:
        self.running[slot].remove(chunk)

    def fail(self, slot: int, done: Container[int] = ()) -> list[int]:
        """The actor died: requeue everything it held (front of the queue), except the jobs in `done` (results it
        streamed back before dying). Returns the jobs that have now failed `max_attempts` times (the caller gives up
        on them)."""
        chunks, self.running[slot] = self.running[slot], []
        left = [[job for job in chunk.jobs if job not in done] for chunk in chunks]
        chunks = [Chunk(tuple(jobs), sum(self.costs[j] for j in jobs)) for jobs in left if jobs]
        self.pending.extendleft(reversed(chunks))
        lost = [job for chunk in chunks for job in chunk.jobs]
        for job in lost:
            self.attempts[job] += 1
        return [job for job in lost if self.attempts[job] >= self.max_attempts]

    def outstanding(self) -> dict[int, list[int]]:
        """slot -> jobs it holds (running or queued on it)."""
        return {slot: [j for chunk in chunks for j in chunk.jobs] for slot, chunks in self.running.items() if chunks}


def _deal(costs: list[int], num_chunks: int) -> list[Chunk]:
    """Biggest job first, each into the chunk with the least cost so far; empty chunks dropped, jobs in input order
    within a chunk, heaviest chunk first."""
    bins: list[list[int]] = [[] for _ in range(min(num_chunks, len(costs)))]
    load = [0] * len(bins)
    for job in sorted(range(len(costs)), key=lambda j: -costs[j]):
        target = min(range(len(bins)), key=lambda b: (load[b], b))
        bins[target].append(job)
        load[target] += costs[job]
    chunks = [Chunk(tuple(sorted(jobs)), cost) for jobs, cost in zip(bins, load)]
    return sorted(chunks, key=lambda c: -c.cost)
