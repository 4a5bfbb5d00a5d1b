"""Dispatcher: which actor runs which jobs, by outstanding token load. Pure bookkeeping: no Ray, no torch.

A job is one prompt with all its samples (they share a prefill, so a job is never split across actors) or one
scoring pair. Its cost estimates the tokens it runs: prompt + n * max_new_tokens. Jobs are dealt, biggest first, into
workers * chunks_per_worker chunks, each job to the chunk with the least cost so far (LPT), so chunks carry similar
loads and similar mixes of long and short jobs. The heaviest pending chunk goes to the actor with the least outstanding
load among those with room (`max_in_flight` chunks each; the fleet uses 1, so pending chunks wait in the queue, never
behind a busy actor, and a free or freshly restarted actor pulls the next one). A fast actor drains its load sooner
and so takes more chunks. One chunk per worker gives each engine the biggest batch; more chunks rebalance better when
actors differ in speed and lose less work when one dies.

With `homes` (speculation with "history": the actor whose draft index holds each prompt's earlier completions, or
None), each actor's chunks take its own prompts first, up to HOME_SLACK over an even share of the call's load; the
rest is dealt by load as above, into every actor's chunks. A free actor takes its own heaviest chunk, and only then
another actor's (so a dead or slow actor's prompts still run, without their history).

When an actor dies, every chunk it held goes back to the front of the queue for the others, less the jobs whose
results it streamed back before dying; a job whose actor died `max_attempts` times is reported (it is probably what
kills them) instead of being retried forever.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass


HOME_SLACK = 0.25  # an actor's chunks take its own prompts up to this much over an even share of the load


@dataclass(frozen=True)
class Chunk:
    jobs: tuple[int, ...]  # indices into the call's jobs, ascending
    cost: int
    home: int | None = None  # the actor this chunk's prompts prefer (homes), or None


class Dispatcher:
    def __init__(self, costs: Sequence[int], slots: Iterable[int], chunks_per_worker: int = 1,
                 max_in_flight: int = 1, max_attempts: int = 3, homes: Sequence[int | None] | None = None) -> None:
        if any(c < 1 for c in costs):
            raise ValueError(f"costs must all be >= 1, got min {min(costs)}")
        if homes is not None and len(homes) != len(costs):
            raise ValueError(f"homes must be one per job ({len(costs)}), got {len(homes)}")
        self.costs = list(costs)
        self.max_in_flight = max_in_flight
        self.max_attempts = max_attempts
        slots = list(slots)
        if homes is not None and any(h in slots for h in homes):
            chunks = _deal_home(self.costs, homes, slots, chunks_per_worker)
        else:
            chunks = _deal(self.costs, max(1, len(slots)) * chunks_per_worker)
        self.pending: deque[Chunk] = deque(chunks)
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
            chunk = next((c for c in self.pending if c.home == slot), self.pending[0])  # its own first
            self.pending.remove(chunk)
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
        chunks = [Chunk(tuple(jobs), sum(self.costs[j] for j in jobs), chunk.home)
                  for jobs, chunk in zip(left, chunks) if jobs]
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


def _deal_home(costs: list[int], homes: Sequence[int | None], slots: list[int], per_slot: int) -> list[Chunk]:
    """`per_slot` chunks per actor: each actor's own jobs first (biggest first, while its load stays under an even
    share + HOME_SLACK), then every other job, biggest first, into the least loaded chunk; heaviest chunk first."""
    cap = sum(costs) / len(slots) * (1 + HOME_SLACK)
    bins = [(slot, []) for slot in slots for _ in range(per_slot)]
    load = [0] * len(bins)
    slot_load = dict.fromkeys(slots, 0)
    rest = []

    def put(target: int, job: int) -> None:
        bins[target][1].append(job)
        load[target] += costs[job]

    for job in sorted(range(len(costs)), key=lambda j: -costs[j]):
        home = homes[job]
        if home not in slot_load or slot_load[home] + costs[job] > cap:
            rest.append(job)
            continue
        slot_load[home] += costs[job]
        put(min((b for b in range(len(bins)) if bins[b][0] == home), key=lambda b: (load[b], b)), job)
    for job in rest:
        put(min(range(len(bins)), key=lambda b: (load[b], b)), job)
    chunks = [Chunk(tuple(sorted(jobs)), cost, slot) for (slot, jobs), cost in zip(bins, load) if jobs]
    return sorted(chunks, key=lambda c: -c.cost)
