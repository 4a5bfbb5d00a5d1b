"""Speculative verify steps inside upstream's engine: a decoding request is fed its next token and k draft tokens in
one forward, every one of those k + 1 positions is sampled by the counter-based sampler, the drafts are kept while
each equals the token sampled before it, and the rest is rolled back.

A row's uniform at a position is a hash of its key and that position (sampling/streams.py) and its token is drawn by inverse
CDF from the logits at that position, so a draft is kept exactly when it *is* the token plain decoding would have
drawn there: the emitted tokens are the first sample, then each further sample while the draft before it matched, up
to a stop id (the k + 1-th sample when every draft matched). Speculation changes the cost, never a token, and every
emitted token's logprob comes from the forward that verified it (the weights of that step's version).

The pieces, one step's life:
- scheduling (`RolloutScheduler._infer_request_tokens`): a decoding request the engine drafts for (`propose`) is
  given `[its next token] + drafts` to process; the step's token budget may trim the drafts;
- inputs (`RowSlotArgs.prepare_tensor_args` -> `StepSampler.prepare` -> `Verifier.plan`): the logits rows to compute
  (each sampling row's first position, then every verify row's draft positions) and their slots, returned as the
  step's `Plan` (carried in its `StepChoice`); the model computes logits only there;
- read-back (`RolloutIOs.prepare_batch_update` -> `StepSampler.accept` -> `Verifier.accept`, under that step's plan):
  per verify row, the tokens it emits and their logprobs; the first goes back through upstream's own update, the
  others are appended after it;
- update (`upstream/processor.py`, `RolloutProcessor.update_batch` -> `Verifier.settle`): the extra tokens appended
  (stopping where the
  request finishes), the request's position moved back to what it really holds, the pages past it freed, and only
  then the pages its kept tokens completed hashed for the prefix cache. Nothing of a rejected draft is ever hashed,
  and no page allocated for one is kept.
Sync steps only (no async batching: the next step's inputs depend on this one's acceptance). Upstream's scheduler,
runner and processor are handed the verifier at construction; the pages a rollback frees are counted by
`upstream.release_pages_past` / `complete_blocks` (the cache allocators' internals stay in upstream/).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..upstream import RequestState, RequestStatus, complete_blocks, release_pages_past

# a decoding request's drafts for the step being scheduled ([] for none), from the engine
Propose = Callable[[RequestState], list[int]]
# after a verify step: (request id, drafted, accepted) for every verify row whose request is still live
Verified = Callable[[list[tuple[str, int, int]]], None]


@dataclass
class Drafted:
    """One request's drafts in the step being prepared."""

    drafts: list[int]
    past: int = 0  # its position before the step (its KV holds positions [0, past))


@dataclass
class Plan:
    """The step's logits rows: columns [0, N) are the sampling rows' first positions (a plain row's only one), the
    columns after them each verify row's draft positions, row by row."""

    indices: torch.Tensor  # [N + M] positions in the step's tokens whose logits are computed
    slots: torch.Tensor  # [N + M] int32 slot of each column's request
    rows: list[tuple[int, int]]  # per sampling row: (first extra column, number of drafts); (0, 0) for a plain one

    @property
    def num_columns(self) -> int:
        return self.indices.shape[0]


@dataclass
class Verifier:
    """What upstream's scheduler, step inputs, read-back and update share about the verify step in flight."""

    propose: Propose
    on_verified: Verified = lambda rows: None  # noqa: E731
    # a step is being scheduled: its decoding requests and its token budget; returns whether it may draft at all
    begin: Callable[[int, int], bool] = lambda num_decoding, token_budget: True  # noqa: E731
    drafting: bool = True  # whether the step being scheduled may draft (`start`)
    # a step's seconds on the engine thread, scheduling to update (the speculator's cost model)
    on_step: Callable[[float], None] = lambda seconds: None  # noqa: E731
    started: float = 0.0  # when the step in flight began scheduling (0: none)
    drafted: dict[str, Drafted] = field(default_factory=dict)
    step_tokens: int = 0  # query tokens of the last step prepared (for the speculator's cost model)
    verified_step: bool = False  # whether that step had verify rows
    sampled_only: bool = False  # whether every query token of that step was sampled (no prompt chunk in it)
    extras: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # tokens after the first, per request

    # ------------------------------------------------------------------ scheduling
    def start(self, num_decoding: int, token_budget: int) -> None:
        """A step is being scheduled with this many decoding requests."""
        self.started = time.perf_counter()
        self.drafting = bool(self.begin(num_decoding, token_budget))

    def ended(self) -> None:
        """The step's update is done: its seconds from scheduling on, which is what a verify row costs (its drafts'
        lookups, its wider forward, its read-back and rollback), not its forward alone."""
        if self.started:
            self.on_step(time.perf_counter() - self.started)
            self.started = 0.0

    def tokens(self, state: RequestState, cache) -> list[int]:
        """A decoding request's tokens for the step being scheduled: its next token, then its drafts (if any). Drafts
        only where the cache has the pages for them now (a draft never makes a request wait, nor preempts one).
        Called for every decoding request of a step that drafts, and for one still holding drafts of a step it was
        left out of."""
        base = state.tokens_to_process[:1]
        drafts = self.propose(state) if base and self.drafting else []
        if drafts and not cache.can_store_request_tokens(state, 1 + len(drafts), dry_run=True):
            drafts = []
        if drafts:
            self.drafted[state.request_id] = Drafted(list(drafts))
            state.tokens_to_process = base + list(drafts)
        elif len(state.tokens_to_process) > 1:  # drafted for a step it was then left out of
            self.drafted.pop(state.request_id, None)
            state.tokens_to_process = base
        return state.tokens_to_process

    def trim(self, state: RequestState, budget: int) -> None:
        """The step's token budget holds only `budget` (>= 1) of the request's tokens: fewer drafts."""
        state.tokens_to_process = state.tokens_to_process[:budget]
        drafted = self.drafted.get(state.request_id)
        if drafted is not None:
            drafted.drafts = drafted.drafts[: budget - 1]
            if not drafted.drafts:
                del self.drafted[state.request_id]

    # ------------------------------------------------------------------ inputs
    def plan(self, requests_in_batch, slots: list[int], device) -> Plan | None:
        """After the step's inputs are laid out (positions advanced): which logits rows to compute, or None for a
        step without drafts. `slots`: the sampling rows' slots, in order."""
        self.step_tokens = sum(future.query_length for future in requests_in_batch)
        if self.drafted:
            scheduled = {future.state.request_id for future in requests_in_batch}
            for request_id in [r for r in self.drafted if r not in scheduled]:
                del self.drafted[request_id]  # scheduled for drafts, then left out of the step (budgets)
        self.verified_step = bool(self.drafted)
        if not self.drafted:
            self.sampled_only = self.step_tokens == len(slots)
            return None
        first, extra, extra_slots, rows = [], [], [], []
        start = 0
        for future in requests_in_batch:
            length = future.query_length
            if future.has_new_token:
                drafted = self.drafted.get(future.state.request_id)
                k = len(drafted.drafts) if drafted is not None else 0
                if drafted is not None:
                    drafted.past = future.state.position_offset - length
                row_first = start + length - 1 - k
                first.append(row_first)
                rows.append((len(extra), k))
                extra.extend(range(row_first + 1, row_first + 1 + k))
                extra_slots.extend([slots[len(first) - 1]] * k)
            start += length
        base = len(first)
        self.sampled_only = self.step_tokens == base + len(extra)
        rows = [(base + column, k) if k else (0, 0) for column, k in rows]
        return Plan(torch.tensor(first + extra, dtype=torch.long).to(device),
                    torch.tensor(slots + extra_slots, dtype=torch.int32).to(device), rows)

    # ------------------------------------------------------------------ read-back
    def accept(self, plan: Plan, request_id: str, stops, row: int, tokens: list[int], values: list[float]
               ) -> list[int]:
        """The output columns of what a sampling row emits (its first sample's column first), under the step's `plan`.
        `stops`: the request's stop ids; `tokens` / `values`: the step's sampled tokens and logprobs by column. The
        tokens after the first are kept for `settle`."""
        drafted = self.drafted.get(request_id)
        if drafted is None:
            return [row]
        start, k = plan.rows[row]
        columns = [row] + list(range(start, start + k))
        emitted = 1
        for i, draft in enumerate(drafted.drafts):
            sampled = tokens[columns[i]]
            if sampled != draft or sampled in stops:
                break
            emitted += 1
        kept = columns[:emitted]
        self.extras[request_id] = [(tokens[c], values[c]) for c in kept[1:]]
        return kept

    # ------------------------------------------------------------------ update
    def hold_blocks(self, requests_in_batch) -> list:
        """Before upstream's update: the verify rows' futures, with their pages' hashing held back (the pages the
        forward completed are known only once acceptance is)."""
        held = []
        for future in requests_in_batch:
            if future.state.request_id in self.drafted:
                future.complete_blocks = {}
                held.append(future)
        return held

    def settle(self, processor, held: list) -> None:
        """After upstream's update (which took each row's first token): the rest of each verify row's tokens, its
        rollback, its pages; outputs for the requests that finished or stream."""
        outputs, verified = [], []
        for future in held:
            state = future.state
            drafted = self.drafted[state.request_id]
            extras = self.extras.pop(state.request_id, [])
            if state.status in (RequestStatus.FINISHED, RequestStatus.PENDING):
                verified.append((state.request_id, len(drafted.drafts), 0))
                continue  # finished on its first token (its pages already freed), or failed
            emitted, finished = 1, False
            for token, logprob in extras:
                emitted += 1
                if state.update_and_check_completion(token, logprob):
                    finished = True
                    break
            verified.append((state.request_id, len(drafted.drafts), emitted - 1))
            if finished:
                processor.scheduler.finish_request(state.request_id)
                processor.scheduler.block_new_requests = False
                outputs.append(state.to_generation_output())
                continue
            kept = drafted.past + emitted  # positions whose KV is the request's own: its inputs up to the last kept
            state.position_offset = kept
            release_pages_past(processor.cache, state.request_id, kept)
            processor.cache.mark_complete_blocks(state, complete_blocks(processor.cache, drafted.past, emitted))
            if state.streaming:
                outputs.append(state.to_generation_output())
        self.drafted.clear()
        self.extras.clear()
        if verified:
            self.on_verified(verified)
        if outputs:
            processor.output_router.deliver_batch(outputs)
