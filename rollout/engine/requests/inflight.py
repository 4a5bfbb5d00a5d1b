"""Requests: the engine's bookkeeping of what it has in flight, one place for it.

- `pending`: engine request id -> the sample it serves (a prompt's head request and its forked children
  `"{id}__child#{i}"`); a sample is in here from its submission until its output is taken, cancelled or aborted;
- `rerun`: samples whose request failed (or was lost with a dead engine, or aborted by a weight update), to be
  submitted again by the supervisor;
- `ledger` (ledger.py): per request, its row parameters and, per sampled token, the sampling logprob, the version and
  the top list;
- `prompt_tokens` / `reused_tokens`: every request's prompt tokens, and those the prefix cache served.

Everything here is read and changed under the engine's lock, except the ledger's per-step records on the engine
thread (which it guards itself by `is_tracked`).
"""

from __future__ import annotations

from collections.abc import Iterable

from .call import Call, Sample
from .ledger import Entry, Ledger
from ..sampling.sampler import RowSpec
from ..upstream import CHILD_SEPARATOR


class Requests:
    def __init__(self) -> None:
        self.pending: dict[str, Sample] = {}
        self.rerun: list[Sample] = []
        self.ledger = Ledger(self.is_pending)
        self.prompt_tokens = 0
        self.reused_tokens = 0

    def is_pending(self, request_id: str) -> bool:
        return request_id in self.pending

    def idle(self) -> bool:
        """Nothing in flight and nothing to re-run."""
        return not self.pending and not self.rerun

    def add(self, request_id: str, group: list[Sample], spec: RowSpec, version: int) -> list[int]:
        """One engine request for the samples of one prompt (the first is its head, the rest its children); returns
        the head's context (its prompt tokens, counted)."""
        for i, sample in enumerate(group):
            sample.version = version
            sample.attempts += 1
            self.pending[request_id if i == 0 else f"{request_id}{CHILD_SEPARATOR}{i - 1}"] = sample
        self.ledger.specs[request_id] = spec
        context = group[0].context()
        self.prompt_tokens += len(context)
        group[0].prompt_tokens += len(context)
        return context

    def take(self, request_id: str) -> tuple[Sample | None, Entry]:
        """A request's output came: its sample (None if it was cancelled or re-run meanwhile) and its entry."""
        return self.pending.pop(request_id, None), self.ledger.pop(request_id)

    def prefix_hit(self, request_id: str, num_tokens: int) -> None:
        self.reused_tokens += num_tokens
        sample = self.pending.get(request_id)
        if sample is not None:
            sample.reused_tokens += num_tokens

    def split(self, request_id: str, num_tokens: int) -> None:
        """A child split off as a request of its own is prompted again."""
        self.prompt_tokens += num_tokens
        sample = self.pending.get(request_id)
        if sample is not None:
            sample.prompt_tokens += num_tokens

    def of_call(self, call: Call) -> list[str]:
        return [request_id for request_id, sample in self.pending.items() if sample.call is call]

    def release(self, call: Call) -> list[str]:
        """Forget every request and re-run of `call`; returns the request ids to cancel in the engine."""
        self.rerun = [s for s in self.rerun if s.call is not call]
        cancelled = self.of_call(call)
        for request_id in cancelled:
            self.pending.pop(request_id)
        self.ledger.drop(cancelled)
        return cancelled

    def lost(self) -> None:
        """The engine died with its cache: every pending sample re-runs."""
        self.rerun.extend(self.pending.values())
        self.pending.clear()
        self.ledger.clear()

    def take_all(self) -> tuple[list[str], list[Sample]]:
        """Everything in flight, forgotten (an "abort" update): the request ids to cancel and the samples that were
        pending or waiting to re-run."""
        request_ids, samples = list(self.pending), list(self.pending.values()) + self.rerun
        self.ledger.drop(self.pending)
        self.pending.clear()
        self.rerun = []
        return request_ids, samples

    def take_rerun(self) -> list[Sample]:
        rerun, self.rerun = self.rerun, []
        return rerun

    def sampled_tokens(self, call: Call, request_ids: Iterable[str]) -> int:
        """Model tokens sampled so far for the samples of `call` whose group is not complete: finished rows, earlier
        turns of episodes, and what its live engine requests sampled."""
        complete = set(call.completed)
        total = sum(len(self.ledger.sampling.get(request_id, ())) for request_id in request_ids)
        for sample in call.samples:
            if sample.prompt_index in complete:
                continue
            if sample.row is not None:
                total += sum(sum(row.action_mask) if row.action_mask is not None else len(row.completion_ids)
                             for row in sample.rows())
            elif sample.episode is not None:
                total += sum(sum(seg.action_mask) for seg in sample.episode.segments)
        return total
