"""Pipeline: asynchronous rollouts for a trainer's loop, with a bound on staleness.

With `async_rollouts=True`, the rollouts of steps t+1 .. t+max_staleness are submitted (`rollouts.submit`) before
step t trains, so generation overlaps training; the weights pushed after each step land on the calls still in
flight under `in_flight` ("recompute" by default: the tokens already sampled keep their exact logprobs under the
version that produced them, the rest continue on the new weights). A batch is trained on only if its oldest model
token is at most `max_staleness` versions behind the policy; an older one is dropped and regenerated on the current
weights (counted in `num_dropped`), never trained on silently.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from rollout import EpisodeSpec, RolloutBatch, Rollouts, SamplingParams

from .rollouts import PromptsExhausted


def staleness(batch: RolloutBatch, version: int) -> int:
    """How many versions behind `version` the oldest model token of the batch is (0 for an empty batch)."""
    produced = batch.token_versions[batch.action_mask]
    return 0 if produced.numel() == 0 else version - int(produced.min())


class Pipeline:
    def __init__(self, rollouts: Rollouts, prompts: Callable[[int], Any], sampling: SamplingParams,
                 chat_template: bool, episodes: EpisodeSpec | None, max_staleness: int) -> None:
        self.rollouts, self.prompts, self.sampling = rollouts, prompts, sampling
        self.chat_template, self.episodes, self.max_staleness = chat_template, episodes, max_staleness
        self.ahead: deque = deque()  # futures of steps next_step - len(ahead) .. next_step - 1, in order
        self.next_step = 0
        self.exhausted = False
        self.num_dropped = 0

    def batch(self, step: int, version: int) -> RolloutBatch:
        """The batch of `step`, no more than `max_staleness` behind `version`; the next steps are submitted before
        it returns, so they generate while this one trains."""
        self.fill(step)
        if not self.ahead:
            raise PromptsExhausted(f"the prompt iterable ran out at step {step}")
        batch = self.ahead.popleft().result()
        while staleness(batch, version) > self.max_staleness:
            self.num_dropped += 1
            batch = self.submit(step).result()  # the same step's prompts, on the current weights
        self.fill(step)
        return batch

    def fill(self, step: int) -> None:
        """Submit every step up to `step + max_staleness`: submitted while the rollout side holds version v (that
        of step `step`), the last of them is trained at version v + max_staleness at the latest."""
        while not self.exhausted and self.next_step <= step + self.max_staleness:
            try:
                self.ahead.append(self.submit(self.next_step))
            except PromptsExhausted:
                self.exhausted = True
                return
            self.next_step += 1

    def submit(self, step: int):
        extra = self.episodes.kwargs() if self.episodes is not None else {}
        return self.rollouts.submit(self.prompts(step), sampling=self.sampling, chat_template=self.chat_template,
                                    **extra)

    def close(self) -> None:
        """Cancel the rollouts submitted ahead."""
        while self.ahead:
            self.ahead.popleft().cancel()
