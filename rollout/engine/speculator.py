"""Speculator: which decoding requests the engine drafts for, how many tokens, from which source, and what came of it.

The verify mechanics live in upstream/verify.py; this is the engine's side of it, on the engine thread:
- `propose(state)`: a decoding request's draft tokens for the step being scheduled. Drafted: requests whose sampling
  does not depend on their own earlier tokens within a step (no penalties, logit bias or min_new_tokens: their
  adjustments are counted once per step on the device), with at least two tokens left to their budget (a draft
  never reaches past `max_new_tokens`). Each request keeps its `RowDrafts` (drafts.py), fed the tokens it accepted
  since the last step. A source that raises gives that request no drafts, never an error.
- `mode`: "always" drafts every eligible request; "auto" only where drafting pays by the measured cost model: a
  thin step (few decoding requests: the forward costs about the same with a few more tokens, `thin_rows`), and a
  request whose drafts keep being accepted (its acceptance, a moving average, above `MIN_ACCEPTANCE`; a request
  whose drafts fail rests `REST_STEPS` steps, then tries again).
- `done(request_id, prompt, completion)`: a model turn that finished feeds the history source (same-prompt drafts).
- `verified(rows)`: per verify row, drafted and accepted counts (metrics, and "auto"'s acceptance).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..base.config import WorkerConfig
from ..base.speculation import Speculation
from .drafts import DraftIndex
from .upstream.state import history
from .upstream.verify import Verifier

log = logging.getLogger("rollout")

MIN_ACCEPTANCE = 0.25  # "auto": accepted / drafted below this (moving average) and a request rests
REST_STEPS = 8  # steps a request with failing drafts goes undrafted before it tries again
SWEEP_EVERY = 1024  # proposals between sweeps of the drafters of requests no longer live
THIN_ROWS = 16  # "auto": steps of at most this many decoding requests are drafted (measured: docs/speculation.md)


@dataclass
class RowState:
    """One request's drafter and what it has seen."""

    drafts: object  # drafts.RowDrafts
    fed: int = 0  # completion tokens given to the drafter so far
    acceptance: float = 1.0  # moving average of accepted / drafted (optimistic start)
    rest: int = 0  # steps left undrafted ("auto")


@dataclass
class SpeculationCounts:
    drafted: int = 0  # draft tokens fed to verify forwards
    accepted: int = 0  # of those, kept (each equal to what plain decoding samples there)
    verify_rows: int = 0  # row-steps that verified drafts
    emitted: int = 0  # tokens those row-steps emitted (accepted + one sampled each)

    @property
    def rolled_back(self) -> int:
        return self.drafted - self.accepted


class Speculator:
    def __init__(self, spec: Speculation, index, eligible: Callable[[str], bool], thin_rows: int,
                 on_row: Callable[[str, int, int], None] = lambda request_id, drafted, accepted: None) -> None:
        self.spec = spec
        self.on_row = on_row  # each verify row's (request id, drafted, accepted): the engine counts them per call
        self.index = index  # drafts.DraftIndex
        self.eligible = eligible  # request id -> may it be drafted (its sampling params allow it)
        self.thin_rows = thin_rows
        self.rows: dict[str, RowState] = {}
        self.counts = SpeculationCounts()
        self.decoding = 0  # decoding requests in the step being scheduled
        self._proposals = 0

    @classmethod
    def of(cls, config: WorkerConfig, eligible: Callable[[str], bool],
           on_row: Callable[[str, int, int], None]) -> "Speculator | None":
        """The engine's speculator, or None when the config has speculation off."""
        spec = config.speculation
        if spec is None or spec.mode == "off":
            return None
        return cls(spec, DraftIndex(spec), eligible, THIN_ROWS, on_row)

    def verifier(self) -> Verifier:
        """The hooks a new manager's scheduler, runner and processor call (upstream/verify.py)."""
        return Verifier(propose=self.propose, on_verified=self.verified, begin=self.begin)

    def done(self, request_id: str, prompt: list[int] | None = None, completion: list[int] | None = None) -> None:
        """A request is over: a finished model turn (prompt and completion given) feeds the history source."""
        self.rows.pop(request_id, None)
        if completion:
            try:
                self.index.record(prompt, completion)
            except Exception as error:
                log.warning("rollout: the draft history could not record a completion (%s)", error)

    def metrics(self) -> dict[str, int]:
        """What `RolloutWorker.metrics()` reports of speculation (rollout/metrics/snapshot.py)."""
        counts = self.counts
        return dict(draft_tokens=counts.drafted, draft_accepted_tokens=counts.accepted,
                    draft_rolled_back_tokens=counts.rolled_back, draft_verify_row_steps=counts.verify_rows,
                    draft_history_bytes=int(self.index.memory_bytes))

    def begin(self, num_decoding: int) -> None:
        """A step is being scheduled with this many decoding requests."""
        self.decoding = num_decoding

    def propose(self, state) -> list[int]:
        mode = self.spec.mode
        if mode == "off" or (mode == "auto" and self.decoding > self.thin_rows):
            return []
        left = None if state.max_new_tokens is None else state.max_new_tokens - state.generated_len()
        k = self.spec.max_draft_tokens if left is None else min(self.spec.max_draft_tokens, left - 1)
        if k < 1 or not self.eligible(state.request_id):
            return []
        self._sweep()
        try:
            row = self._row(state)
            if mode == "auto" and row.rest > 0:
                row.rest -= 1
                return []
            return list(row.drafts.propose(k))[:k]
        except Exception as error:  # a failing source: no drafts for this request, never a wrong token
            log.warning("rollout: draft source failed for request %s (%s); it is not drafted", state.request_id,
                        error)
            self.rows.pop(state.request_id, None)
            return []

    def verified(self, rows: list[tuple[str, int, int]]) -> None:
        counts = self.counts
        for request_id, drafted, accepted in rows:
            counts.drafted += drafted
            counts.accepted += accepted
            counts.verify_rows += 1
            counts.emitted += accepted + 1
            self.on_row(request_id, drafted, accepted)
            row = self.rows.get(request_id)
            if row is not None and drafted:
                row.acceptance = 0.5 * row.acceptance + 0.5 * accepted / drafted
                if row.acceptance < MIN_ACCEPTANCE:
                    row.rest, row.acceptance = REST_STEPS, MIN_ACCEPTANCE  # one more chance after the rest

    def clear(self) -> None:
        self.rows.clear()
        self.index.clear()

    def _row(self, state) -> RowState:
        prompt, completion = history(state)
        row = self.rows.get(state.request_id)
        if row is None:
            row = self.rows[state.request_id] = RowState(self.index.row(list(prompt)))
        if len(completion) > row.fed:
            row.drafts.extend(completion[row.fed:])
            row.fed = len(completion)
        return row

    def _sweep(self) -> None:
        self._proposals += 1
        if self._proposals % SWEEP_EVERY == 0:
            for request_id in [r for r in self.rows if not self.eligible(r)]:
                del self.rows[request_id]
