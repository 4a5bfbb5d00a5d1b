"""RolloutScheduler: FIFO scheduling minus the 1-token fork crash, and minus a stall after preemption.

The engine forks the n samples of a prompt after prefilling all but its last token; when exactly one token is left
(a 1-token prompt, or a prefix-cache hit leaving one token) it schedules a 0-token forward and dies. Here such
children become separate requests that share the cached prefix blocks instead.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.scheduler import FIFOScheduler


SCHEDULER_NAME = "rollout_fifo"
CHILD_SEPARATOR = "__child#"


class RolloutScheduler(FIFOScheduler):
    """FIFO scheduling, minus the 1-token fork crash. For the engine's counts (hooks set by the engine): every
    prefix-cache hit of a request's first admission goes to `on_prefix_hit(request_id, num_tokens)` (a request
    preempted or recomputed after sampling is re-admitted with its logprobs so far: its hits are not new reuse), every
    child split off as a request of its own to `on_split(request_id, num_prompt_tokens)` (it is prompted again), and
    the cache to `on_schedule(cache)` once a step's pages are allocated (the peak of pages in use)."""

    on_prefix_hit: Callable[[str, int], None] | None = None
    on_split: Callable[[str, int], None] | None = None
    on_schedule: Callable[[object], None] | None = None
    verifier: object | None = None  # speculative decoding (the engine's Verifier): a decoding request's drafts join its token

    def schedule_batch(self, token_budget: int, cache_budget: int):
        # upstream's preemption sets block_new_requests (admit nothing new until the survivors make room) and only a
        # request that finishes clears it; when every running request is cancelled instead (an abort or recompute
        # fence, cancels, timeouts, clients gone), none ever finishes and the waiting requests were never admitted
        # again: the engine idled with an empty cache (found by benchmarks/fleet/chaos.py). Nothing running: admit.
        if self.block_new_requests and not self.active_requests:
            self.block_new_requests = False
        if self.verifier is not None:
            decoding = sum(s.status == RequestStatus.DECODING for s in self.active_requests.values())
            self.verifier.start(decoding, token_budget)
        scheduled = super().schedule_batch(token_budget, cache_budget)
        if self.on_schedule is not None:
            self.on_schedule(self.cache)
        return scheduled

    def _infer_request_tokens(self, state, request_ids_to_remove_from_waiting) -> list[int]:
        status = state.status
        if status == RequestStatus.DECODING:  # upstream's own answer, without its prefix-sharing branch's checks
            verifier = self.verifier
            if verifier is not None and (verifier.drafting or len(state.tokens_to_process) > 1):
                return verifier.tokens(state, self.cache)  # its next token, then its drafts
            return state.tokens_to_process
        was_pending = status == RequestStatus.PENDING and not state.is_cpu_offloaded
        tokens = super()._infer_request_tokens(state, request_ids_to_remove_from_waiting)
        # a hit moves the request out of PENDING with its position advanced past the cached tokens, once
        if was_pending and state.status != RequestStatus.PENDING and state.position_offset > 0 \
                and not state.logprobs and self.on_prefix_hit is not None:
            self.on_prefix_hit(state.request_id, state.position_offset)
        return tokens

    def _schedule_request(self, state, request_tokens, token_budget, request_ids_to_remove_from_waiting) -> None:
        if state.num_children > 0 and len(request_tokens) <= 1 and state.status != RequestStatus.DECODING:
            self._split_children(state)
        if state.status == RequestStatus.DECODING and len(request_tokens) > token_budget \
                and self.verifier is not None:
            self.verifier.trim(state, token_budget)  # fewer drafts; upstream would split it like a prompt
            return
        super()._schedule_request(state, request_tokens, token_budget, request_ids_to_remove_from_waiting)

    def _split_children(self, state) -> None:
        for i in range(state.num_children):
            child = state.create_equivalent_initial_request()
            child.request_id = f"{state.request_id}{CHILD_SEPARATOR}{i}"
            child.num_children = 0
            self.add_waiting_request(child)
            if self.on_split is not None:
                self.on_split(child.request_id, len(child.initial_tokens))
        state.num_children = 0

