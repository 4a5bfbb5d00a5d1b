"""Speculator: which decoding requests the engine drafts for, how many tokens, from which source, and what came of it.

The verify step's mechanics live in verifier.py; this is the engine's side of it, on the engine thread:
- `propose(state)`: a decoding request's draft tokens for the step being scheduled. Drafted: requests whose sampling
  does not depend on their own earlier tokens within a step (no penalties, logit bias or min_new_tokens: their
  adjustments are counted once per step on the device; no grammar: its matcher advances once per step), with at
  least two tokens left to their budget (a draft never reaches past `max_new_tokens`). Each request keeps its
  `RowDrafts` (drafts.py), fed the tokens it accepted since the last step. A source that raises gives that request
  no drafts, never an error.
- `begin(num_decoding, token_budget)`: the step's draft length, never more than lets every decoding request fit the
  step's token budget with its drafts. "always" drafts that far; "auto" picks by the cost model below, and rests a
  request whose own drafts keep failing (its acceptance, a moving average, below `MIN_ACCEPTANCE`) or whose sources
  found nothing for it `MAX_MISSES` steps in a row: `REST_STEPS` steps undrafted, its drafter not even fed, then a
  retry.
- `done(request_id, prompt, completion)`: a model turn that finished feeds the history source (same-prompt drafts).
- `verified(rows)`: per verify row, drafted and accepted counts (metrics, the calls' stats, "auto"'s acceptance).

The cost model ("auto") is measured on this machine as the engine runs, never assumed: `StepCosts` keeps a moving
average of a step's seconds by its query tokens (powers-of-two buckets, interpolated), fed by every step. Draft
acceptance is geometric: each draft is kept with probability q given the one before it was (estimated from what
verify steps kept); a request offered a draft gets one with probability h (its sources found something and it was
not resting), and looking costs c seconds of the engine thread per request offered (both moving averages of what
offering cost and found). For D decoding requests and k drafts, a step emits D (1 + h (q + ... + q^k)) tokens in
cost(D (1 + h k)) + D c seconds; "auto" drafts the k with the most tokens per second if that beats plain decoding by
`MIN_GAIN`, which is 0 where the forward's cost grows with its tokens (wide steps on a compute-bound device), where
drafts are rarely kept, or where they are rarely found (a random model: the lookups were 12% of its engine loop
when every step offered them).

Steps are timed on the engine thread from scheduling to update (a verify row's lookups, wider forward, read-back and
rollback all cost there), and only steps whose every query token is sampled (decode and verify rows) are kept.

While the model says no, h and q would never be measured again (a policy that starts repeating itself, a second
epoch's history): "auto" then probes, offering drafts to the first `PROBE_ROWS` requests of a step whose width
could pay with drafts found and kept often enough (`GOOD_DRAFTS`), as many as would pay there (or, where a width is
not measured yet, as many as would measure it in a step of all its requests), at most every `PROBE_EVERY` steps and
while the probes' lookups stay under `PROBE_SHARE` of the engine's step seconds; a probe that covered its whole step
(fewer than `PROBE_ROWS` requests) and emitted more tokens a second than a plain step lets the next step probe again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...base.config import WorkerConfig
from ...base.errors import invalid
from ...base.speculation import Speculation
from .drafts import DraftIndex
from ..upstream import history
from .verifier import Verifier

log = logging.getLogger("rollout")

MIN_ACCEPTANCE = 0.25  # "auto": accepted / drafted below this (moving average) and a request rests
REST_STEPS = 8  # steps a request with failing drafts goes undrafted before it tries again
MAX_MISSES = 2  # "auto": steps in a row with no draft found before a request rests
SWEEP_EVERY = 1024  # proposals between sweeps of the drafters of requests no longer live
PRIOR_ACCEPTANCE = 0.3  # q before any verify step kept or rejected a draft (worth two verify rows)
MIN_GAIN = 1.1  # "auto" drafts only where the model predicts at least this many times plain decoding's tokens/s
PRIOR_FOUND = 0.5  # h before any request was offered a draft (worth two offers)
PROBE_ROWS = 16  # requests offered drafts in a probe step ("auto", while the cost model says no)
PROBE_EVERY = 16  # steps at least between two probes
PROBE_SHARE = 0.01  # probes' lookups, at most this share of the engine's step seconds
GOOD_DRAFTS = 0.9  # q at which a step width is probed: drafts found and kept that often would pay there
EVERY_REQUEST = 1 << 62  # offers_left outside a probe


class StepCosts:
    """Moving averages of a step's query tokens and seconds in power-of-two buckets of its tokens (steps whose
    every query token is sampled: decode and verify rows), apart for steps with and without verify rows (a verify
    step also pays its read-back and rollback). A width between two measured buckets is interpolated; past the last
    one of its bucket, and in a bucket never measured above one that was, scaled as if linear (never optimistic:
    "auto" widens its drafts a bucket at a time where that pays, and never tries a wide verify step it has no
    measurement near, which cost a compute-bound step up to 3x its plain cost each time)."""

    def __init__(self) -> None:
        self.points: dict[tuple[bool, int], tuple[float, float]] = {}  # (verify, bucket) -> (tokens, seconds)
        self.once: set[tuple[bool, int]] = set()  # buckets measured once: cold (new kernels' shapes, fresh pages)

    @staticmethod
    def bucket(tokens: int) -> int:
        return max(tokens, 1).bit_length()  # 1 -> 1, 2-3 -> 2, 4-7 -> 3, ...

    def observe(self, tokens: int, seconds: float, verify: bool) -> None:
        key = (verify, self.bucket(tokens))
        old = self.points.get(key)
        if old is None:  # a first measurement is kept only until a second replaces it
            self.points[key] = (tokens, seconds)
            self.once.add(key)
        elif key in self.once:
            self.points[key] = (tokens, seconds)
            self.once.discard(key)
        else:
            self.points[key] = (0.8 * old[0] + 0.2 * tokens, 0.8 * old[1] + 0.2 * seconds)

    def cost(self, tokens: int, verify: bool, extrapolate: bool = True) -> float | None:
        """Seconds a step of `tokens` query tokens takes, or None if its bucket was never measured. A verify step is
        never taken to cost less than a plain one of as many tokens (the two are measured at other times, and a
        verify step that looked cheaper by noise made "auto" draft where nothing was found); a verify bucket never
        measured takes the plain step's cost (a step whose requests were offered drafts and found none runs plain,
        so a verify bucket may never be measured where drafts are rarely found)."""
        if not verify:
            return self._cost(tokens, False, extrapolate)
        seconds = self._cost(tokens, True, extrapolate)
        if seconds is None:
            return self._cost(tokens, False, extrapolate)
        plain = self._cost(tokens, False, False, again=False)  # a floor only where plain steps were measured
        return seconds if plain is None else max(seconds, plain)

    def _cost(self, tokens: int, verify: bool, extrapolate: bool, again: bool = True) -> float | None:
        """`extrapolate`: cost a bucket never measured from the one below, else None (and, with `again`, a bucket
        measured once only, so that exploring measures it again warm)."""
        b = self.bucket(tokens)
        here = self.points.get((verify, b))
        if here is not None and not extrapolate and again and (verify, b) in self.once:
            here = None
        if here is None:
            below = [key[1] for key in self.points if key[0] == verify and key[1] < b] if extrapolate else []
            if not below:
                return None
            at, seconds = self.points[(verify, max(below))]
            return seconds * tokens / at
        at, seconds = here
        near = self.points.get((verify, b + 1 if tokens > at else b - 1))
        if near is None or near[0] == at:
            return seconds * max(tokens / at, 1.0)
        return seconds + (near[1] - seconds) * (tokens - at) / (near[0] - at)


class Acceptance:
    """q, the probability that a draft is kept given the one before it was: kept drafts over kept drafts plus
    verify rows that rejected one (a geometric model's estimate), over a moving window."""

    def __init__(self) -> None:
        self.kept, self.rejected = 2 * PRIOR_ACCEPTANCE, 2 * (1.0 - PRIOR_ACCEPTANCE)

    def observe(self, drafted: int, accepted: int) -> None:
        self.kept = 0.99 * self.kept + accepted
        self.rejected = 0.99 * self.rejected + (accepted < drafted)

    @property
    def q(self) -> float:
        return self.kept / (self.kept + self.rejected)


def best_draft_length(rows: int, q: float, max_k: int, costs: StepCosts, found: float = 1.0,
                      host: float = 0.0, explore: bool = False) -> int:
    """The drafts per request (0..max_k) with the most tokens per second for a step of `rows` decoding requests, if
    that beats plain decoding by `MIN_GAIN` (the model's own error margin). `found`: the share of requests that get a
    draft (h); `host`: seconds of the engine thread per request offered one (c). A bucket never measured (or measured
    once) is returned when it is the next candidate after a length that pays, or with `explore` (a probe) after any;
    otherwise it is costed from the one below, as if linear."""
    plain = costs.cost(rows, verify=False)
    if plain is None:
        return 0  # plain steps of this width measure themselves first
    best, best_rate, kept = 0, MIN_GAIN * rows / plain, 0.0
    for k in range(1, max_k + 1):
        kept += q ** k
        tokens = rows + max(1, round(rows * found * k))
        seconds = costs.cost(tokens, verify=True, extrapolate=False)
        if seconds is None and (explore or best > 0):
            return k  # never measured (or once, cold): a probe, or a step past a length that pays, measures it
        if seconds is None:
            seconds = costs.cost(tokens, verify=True)
            if seconds is None:
                return best
        rate = rows * (1.0 + found * kept) / (seconds + rows * host)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class Offers:
    """What offering drafts to requests found and cost ("auto"): h, the share of offered requests that got a draft,
    and c, engine-thread seconds per request offered; moving averages over steps. Also the seconds probes spent."""

    def __init__(self) -> None:
        self.offered, self.found = 2.0, 2.0 * PRIOR_FOUND
        self.per_request = 0.0  # c: unknown until measured (a first step that offers measures it)
        self.step_offered, self.step_found, self.step_seconds = 0, 0, 0.0
        self.probe_seconds = 0.0  # what probe steps' lookups took
        self.step_seconds_total = 0.0  # the steps' seconds since the engine started (scheduling to update)
        self.since_probe = PROBE_EVERY  # steps since the last probe
        self.paid = False  # the last probe covered its whole step and emitted more tokens a second than plain

    def offer(self, found: bool, seconds: float) -> None:
        self.step_offered += 1
        self.step_found += found
        self.step_seconds += seconds

    def end_step(self, probe: bool) -> None:
        """Fold the last step's offers into the moving averages. A probe that paid (a thin step's every request
        offered, more tokens a second than a plain step) lets the next step probe too: a verify step that paid."""
        self.since_probe = PROBE_EVERY if probe and self.paid else 0 if probe else self.since_probe + 1
        self.paid = False
        if self.step_offered:  # quick to follow: a probe of one request that finds a draft moves h halfway to 1
            self.offered = 0.5 * self.offered + self.step_offered
            self.found = 0.5 * self.found + self.step_found
            per_request = self.step_seconds / self.step_offered
            self.per_request = per_request if not self.per_request else 0.8 * self.per_request + 0.2 * per_request
            if probe:
                self.probe_seconds += self.step_seconds
        self.step_offered, self.step_found, self.step_seconds = 0, 0, 0.0

    @property
    def h(self) -> float:
        return self.found / self.offered

    def may_probe(self) -> bool:
        return self.since_probe >= PROBE_EVERY and self.probe_seconds <= PROBE_SHARE * self.step_seconds_total


@dataclass
class RowState:
    """One request's drafter and what it has seen."""

    drafts: object  # drafts.RowDrafts
    fed: int = 0  # completion tokens given to the drafter so far
    acceptance: float = 1.0  # moving average of accepted / drafted (optimistic start)
    rest: int = 0  # steps left undrafted ("auto")
    misses: int = 0  # steps in a row its sources had no draft for it ("auto")


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
    def __init__(self, spec: Speculation, index, eligible: Callable[[str], bool],
                 on_row: Callable[[str, int, int], None] = lambda request_id, drafted, accepted: None,
                 sampling: Callable[[str], Any] = lambda request_id: None) -> None:
        self.spec = spec
        self.sampling = sampling  # request id -> its sampler.RowSpec (the draft model draws with it)
        self.on_row = on_row  # each verify row's (request id, drafted, accepted): the engine counts them per call
        self.index = index  # drafts.DraftIndex
        self.eligible = eligible  # request id -> may it be drafted (its sampling params allow it)
        self.rows: dict[str, RowState] = {}
        self.counts = SpeculationCounts()
        self.costs = StepCosts()
        self.acceptance = Acceptance()
        self.offers = Offers()
        self.k = spec.max_draft_tokens if spec.mode == "always" else 0  # drafts per request this step
        self.probe = False  # "auto": this step offers drafts to a few requests only, to measure h and q
        self.offers_left = EVERY_REQUEST  # requests this step may still offer drafts to (a probe: `PROBE_ROWS`)
        self._verifier: Verifier | None = None
        self._probe_result: tuple[int, int] | None = None  # a whole-step probe's (drafted, accepted), until timed
        self._proposals = 0

    @classmethod
    def of(cls, config: WorkerConfig, eligible: Callable[[str], bool], on_row: Callable[[str, int, int], None],
           draft_model: Any = None, sampling: Callable[[str], Any] = lambda request_id: None
           ) -> "Speculator | None":
        """The engine's speculator, or None when the config has speculation off. `draft_model`: the "model"
        source's runner (draft_model.DraftModel), which the worker loads and checks against the policy; `sampling`:
        a request's sampler.RowSpec, which the draft model draws its tokens with."""
        spec = config.speculation
        if spec is None or spec.mode == "off":
            return None
        if "model" in spec.drafts and draft_model is None:
            raise invalid("speculation.draft_model", type(spec.draft_model).__name__, "was not loaded for this engine",
                          "build the engine through RolloutWorker, which loads and checks the draft model")
        return cls(spec, DraftIndex(spec, draft_model), eligible, on_row, sampling)

    def verifier(self) -> Verifier:
        """The verifier a new manager's scheduler, runner and processor are handed (verifier.py)."""
        self._verifier = Verifier(propose=self.propose, on_verified=self.verified, begin=self.begin,
                                  on_step=self.timed)
        return self._verifier

    def timed(self, seconds: float) -> None:
        """A step took this long on the engine thread, scheduling to update (after its update): the cost model
        learns it."""
        verifier, offers = self._verifier, self.offers
        offers.step_seconds_total += seconds
        if verifier is not None and verifier.step_tokens and verifier.sampled_only:
            # decode and verify steps only: a prompt chunk's tokens compute no logits, so a step with one costs
            # less per token than the verify step it would be taken for (by ~the lm_head's share of the forward).
            # The step's lookups are left out: the model adds them per request offered.
            self.costs.observe(verifier.step_tokens, max(seconds - offers.step_seconds, 0.0),
                               verify=verifier.verified_step)
        if self._probe_result is not None and verifier is not None:
            drafted, accepted = self._probe_result
            rows = verifier.step_tokens - drafted
            plain = self.costs.cost(rows, verify=False)
            offers.paid = plain is not None and (rows + accepted) / seconds > rows / plain  # beat a plain step
            self._probe_result = None

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

    def begin(self, num_decoding: int, token_budget: int) -> bool:
        """A step is being scheduled with this many decoding requests: its draft length, at most what lets every
        decoding request fit the step's token budget with its drafts ("auto": the cost model's pick, or a probe).
        Returns whether the step drafts at all."""
        self._begin(num_decoding, token_budget)
        return self.k > 0

    def _begin(self, num_decoding: int, token_budget: int) -> None:
        fits = token_budget // num_decoding - 1 if num_decoding else 0
        longest = max(0, min(self.spec.max_draft_tokens, fits))
        if self.spec.mode != "auto":
            self.k = longest
            return
        offers = self.offers
        offers.end_step(self.probe)
        self.k, self.probe, self.offers_left = 0, False, EVERY_REQUEST
        if not longest:
            return
        q = self.acceptance.q
        self.k = best_draft_length(num_decoding, q, longest, self.costs, offers.h, offers.per_request)
        if self.k or not offers.may_probe():
            return
        probe = best_draft_length(num_decoding, GOOD_DRAFTS, longest, self.costs, explore=True)
        if probe:  # a width where good drafts would pay: the draft length they would pay at, or a bucket to measure
            self.k, self.probe, self.offers_left = probe, True, PROBE_ROWS

    def propose(self, state) -> list[int]:
        if self.k < 1 or self.offers_left < 1:
            return []
        left = None if state.max_new_tokens is None else state.max_new_tokens - state.generated_len()
        mode, k = self.spec.mode, self.k if left is None else min(self.k, left - 1)
        if k < 1 or not self.eligible(state.request_id):
            return []
        self.offers_left -= 1
        start = time.perf_counter()
        draft = self._draft(state, k, mode)
        if mode == "auto":
            self.offers.offer(bool(draft), time.perf_counter() - start)
        return draft

    def _draft(self, state, k: int, mode: str) -> list[int]:
        self._sweep()
        try:
            resting = self.rows.get(state.request_id)
            if mode == "auto" and resting is not None and resting.rest > 0:  # before feeding it: a rest costs nothing
                resting.rest -= 1
                return []
            row = self._row(state)
            draft = list(row.drafts.propose(k))[:k]
            if mode == "auto":
                row.misses = 0 if draft else row.misses + 1
                if row.misses >= MAX_MISSES:  # nothing to draft from: rest, then look again
                    row.rest, row.misses = REST_STEPS, 0
            return draft
        except Exception as error:  # a failing source: no drafts for this request, never a wrong token
            log.warning("rollout: draft source failed for request %s (%s); it is not drafted", state.request_id,
                        error)
            self.rows.pop(state.request_id, None)
            return []

    def verified(self, rows: list[tuple[str, int, int]]) -> None:
        counts = self.counts
        if self.probe and self.offers_left > 0:  # a probe that offered every request of its step: judged in `timed`
            self._probe_result = (sum(row[1] for row in rows), sum(row[2] for row in rows))
        for request_id, drafted, accepted in rows:
            counts.drafted += drafted
            counts.accepted += accepted
            counts.verify_rows += 1
            counts.emitted += accepted + 1
            self.acceptance.observe(drafted, accepted)
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
        if row is None or len(completion) < row.fed:  # new, or re-run from its prompt under the same id
            drafts = self.index.row(list(prompt), self.sampling(state.request_id))
            row = self.rows[state.request_id] = RowState(drafts)
        if len(completion) > row.fed:
            row.drafts.extend(completion[row.fed:])
            row.fed = len(completion)
        return row

    def _sweep(self) -> None:
        self._proposals += 1
        if self._proposals % SWEEP_EVERY == 0:
            for request_id in [r for r in self.rows if not self.eligible(r)]:
                del self.rows[request_id]
