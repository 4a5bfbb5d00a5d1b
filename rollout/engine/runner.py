"""RolloutModelRunner: replaces the engine's logits processing and sampling with `sampler.sample_rows`, so every row
gets its own temperature / top-k / top-p (greedy rows next to sampled ones, temperature 0 and top_k above the
vocabulary included, none of which the engine survives on its own) and both logprobs come from the one pass.

Pinned by tests/test_upstream_contract.py (the `_forward_process_and_sample` signature, the `output_ids` layout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.generation.continuous_batching.model_runner import ModelRunner

from .sampler import RowSpec, sample_rows


class RolloutModelRunner(ModelRunner):
    """Forward, then our own per-row sampling. Writes tokens and full-vocabulary logprobs where the engine reads
    them, and hands each row's sampling logprob to `record(request_id, value)`."""

    row_spec: Callable[[str], RowSpec]
    record: Callable[[list[str], list[float]], None]
    generator: torch.Generator | None

    @classmethod
    def adopt(cls, runner: ModelRunner, row_spec, record, generator) -> "RolloutModelRunner":
        runner.__class__ = cls
        runner.row_spec, runner.record, runner.generator = row_spec, record, generator
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
        tokens, logprobs, sampling = sample_rows(logits, [self.row_spec(i) for i in ids], self.generator)
        count = tokens.size(0)
        output_ids[0, :count].copy_(tokens)
        output_ids[1, :count].copy_(logprobs.float().view(dtype=torch.int32))
        self.record(ids, sampling.tolist())
