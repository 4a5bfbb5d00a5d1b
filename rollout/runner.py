"""The three places where this project plugs into transformers' continuous-batching engine (5.23.0).

- `RolloutModelRunner`: replaces the engine's logits processing and sampling with `sampler.sample_rows`, so every
  row gets its own temperature / top-k / top-p (greedy rows next to sampled ones, temperature 0 and top_k above the
  vocabulary included, none of which the engine survives on its own) and both logprobs come from the one pass.
- `RolloutScheduler`: the engine forks the n samples of a prompt after prefilling all but its last token; when
  exactly one token is left (a 1-token prompt, or a prefix-cache hit leaving one token) it schedules a 0-token
  forward and dies. Here such children become separate requests that share the cached prefix blocks instead.
- `RolloutRouter`: delivers every finished or failed request to one callback on the engine thread, instead of the
  shared queue whose `get_result` shuffles concurrent consumers.

The contract tests in tests/test_upstream_contract.py pin the upstream behaviour these rely on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler

from .sampler import RowSampler, sample_rows

SCHEDULER_NAME = "rollout_fifo"
CHILD_SEPARATOR = "__child#"


class RolloutModelRunner(ModelRunner):
    """Forward, then our own per-row sampling. Writes tokens and full-vocabulary logprobs where the engine reads
    them, and hands each row's sampling logprob to `record(request_id, value)`."""

    row_sampler: Callable[[str], RowSampler]
    record: Callable[[list[str], list[float]], None]
    generator: torch.Generator | None

    @classmethod
    def adopt(cls, runner: ModelRunner, row_sampler, record, generator) -> "RolloutModelRunner":
        runner.__class__ = cls
        runner.row_sampler, runner.record, runner.generator = row_sampler, record, generator
        return runner  # type: ignore[return-value]

    def _forward_process_and_sample(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids) -> None:
        self.inputs_and_outputs.carry_over_tokens(batch_data["input_ids"], carry_over_ids, prev_output_ids)
        logits = model(**batch_data).logits  # [1, num_tokens or num_logits, V]
        if "logits_to_keep" not in batch_data:
            logits = logits[:, batch_data["logits_indices"], :]
        # logits_indices has one slot per sequence; the first len(ids) hold the rows that predict a new token
        ids = [fs.state.request_id for fs in self.inputs_and_outputs.requests_in_batch if fs.has_new_token]
        if len(ids) > logits.shape[1]:
            raise RuntimeError(f"rollout: {logits.shape[1]} logits rows for {len(ids)} requests (upstream changed?)")
        if not ids:
            return
        logits = logits[0, : len(ids)].float()  # [num_new_tokens, V]
        tokens, logprobs, sampling = sample_rows(logits, [self.row_sampler(i) for i in ids], self.generator)
        count = tokens.size(0)
        output_ids[0, :count].copy_(tokens)
        output_ids[1, :count].copy_(logprobs.float().view(dtype=torch.int32))
        self.record(ids, sampling.tolist())


class RolloutScheduler(FIFOScheduler):
    """FIFO scheduling, minus the 1-token fork crash."""

    def _schedule_request(self, state, request_tokens, token_budget, request_ids_to_remove_from_waiting) -> None:
        if state.num_children > 0 and len(request_tokens) <= 1 and state.status != RequestStatus.DECODING:
            self._split_children(state)
        super()._schedule_request(state, request_tokens, token_budget, request_ids_to_remove_from_waiting)

    def _split_children(self, state) -> None:
        for i in range(state.num_children):
            child = state.create_equivalent_initial_request()
            child.request_id = f"{state.request_id}{CHILD_SEPARATOR}{i}"
            child.num_children = 0
            self.add_waiting_request(child)
        state.num_children = 0


SCHEDULER_MAPPING[SCHEDULER_NAME] = RolloutScheduler


class RolloutRouter(OutputRouter):
    """Routes every output to one callback (called on the engine thread)."""

    def __init__(self, callback: Callable[[GenerationOutput], None]) -> None:
        super().__init__()
        self.callback = callback

    def deliver(self, output: GenerationOutput) -> None:
        self.callback(output)

    def deliver_batch(self, outputs: list[GenerationOutput]) -> None:
        for output in outputs:
            self.callback(output)
