"""Where RolloutGRPOTrainer's old logprobs come from: the rollout's own, or TRL's recompute forward.

TRL 1.16 (`GRPOTrainer._generate_and_score_completions`) runs a no-grad forward of the whole generation batch for its
"old" logprobs when generation and optimizer steps are misaligned (`gradient_accumulation_steps` not a multiple of
`steps_per_generation * num_iterations`) and whenever its vLLM importance-sampling correction is on. A rollout
that shares the trainer's weights (same version, fp32, same device) already holds those logprobs: its `logprobs`
are log_softmax(logits / T) of the generating weights, equal to that forward to <= 1e-5. So the forward is needed
only where the two can differ:

- rows of an older weights version than the trainer's (stale, asynchronous or off-policy use);
- a rollout side whose logprobs are not the trainer's numerics (another dtype, other kernels, another device,
  bf16 autocast in the trainer): found by measuring, since nothing cheaper can tell;
- TRL's own tool loop (its tool-response tokens are not the rollout's).

`OldLogprobsPolicy` decides per generation batch; the measurement is TRL's forward itself, run on the first batch,
every `check_every` steps after a passing check, and on every batch while the last check failed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout import RolloutBatch
from rollout.base import check_int, invalid

SOURCES = ("rollout", "trainer")


@dataclass(frozen=True)
class OldLogprobs:
    """source: "rollout" (default): the rollout's logprobs serve as TRL's old logprobs while they are the trainer's
        (current rows, last measured gap <= tolerance), so TRL runs no recompute forward and no importance-sampling
        correction; "trainer": TRL's recompute forward (and its correction, when `vllm_importance_sampling_correction`
        is on) on every batch.
    check_every: with "rollout", TRL's forward runs on the first batch and then on a batch at least this many
        optimizer steps after the last passing check, to measure the gap (metric `rollout/logprob_gap/{max,mean}`).
    tolerance: the largest max |trainer logprob - rollout logprob| under which the rollout's logprobs are trusted;
        above it TRL's forward and correction run on every batch (with a warning) until a check passes again.
    """

    source: str = "rollout"
    check_every: int = 50
    tolerance: float = 1e-4

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise invalid("source", self.source, f"must be one of {SOURCES}",
                          "use 'rollout' (skip TRL's recompute while it would change nothing) or 'trainer'")
        check_int("check_every", self.check_every, 1, "use e.g. 50 (a check costs one no-grad forward of a batch)")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) \
                or not 0 < self.tolerance < float("inf"):
            raise invalid("tolerance", self.tolerance, "must be a finite number > 0",
                          "use e.g. 1e-4 (fp32 rollouts match the trainer's forward to ~1e-5)")


@dataclass(frozen=True)
class RolloutRecord:
    """One generation batch as the trainer scores it: each row's completion ids and full-vocabulary logprobs, and
    whether every model token came from the version the trainer holds."""

    completion_ids: list[list[int]]
    logprobs: list[torch.Tensor]
    current: bool

    @classmethod
    def of(cls, batch: RolloutBatch, version: int) -> RolloutRecord:
        lengths = batch.completion_lengths.tolist()
        model_tokens = batch.token_versions[batch.action_mask]
        current = bool((batch.policy_version == version).all()) and bool((model_tokens == version).all())
        return cls(batch.completion_token_lists(), [batch.logprobs[i, :n] for i, n in enumerate(lengths)], current)

    def padded(self, width: int, device: torch.device | str) -> torch.Tensor:
        """(R, width) float32 logprobs, right-padded with 0.0 like TRL's completion tensors."""
        out = torch.zeros(len(self.logprobs), width, dtype=torch.float32)
        for i, row in enumerate(self.logprobs):
            out[i, : len(row)] = row[:width]
        return out.to(device)

    def matches(self, completion_ids: torch.Tensor) -> bool:
        """True when TRL's (R, width) right-padded completion ids are this record's rows, token for token."""
        if completion_ids.size(0) != len(self.completion_ids):
            return False
        ids = completion_ids.tolist()
        pairs = zip(self.completion_ids, ids, strict=True)
        return all(len(row) <= len(got) and got[: len(row)] == row for row, got in pairs)


class OldLogprobsPolicy:
    """Per generation batch: serve the rollout's logprobs, or run TRL's forward (and say why). Every process must
    decide alike (TRL gathers inside the corrected branch), so the trainer feeds it gathered values."""

    def __init__(self, config: OldLogprobs) -> None:
        self.config = config
        self.last_check: int | None = None  # step of the last measurement on current rows
        self.last_gap: float | None = None

    def reason(self, step: int, current: bool, tools: bool = False) -> str | None:
        """Why TRL's forward must run for the batch generated at `step` (None: the rollout's logprobs serve)."""
        if self.config.source == "trainer":
            return "asked"
        if tools:
            return "tools"
        if not current:
            return "stale"
        if self.last_gap is None:
            return "first"
        if self.last_gap > self.config.tolerance:
            return "gap"
        if step - self.last_check >= self.config.check_every:
            return "check"
        return None

    def measured(self, step: int, gap: float) -> bool:
        """Record a gap measured on current rows at `step`; True when it newly fails the tolerance."""
        failed = gap > self.config.tolerance and (self.last_gap is None or self.last_gap <= self.config.tolerance)
        self.last_check, self.last_gap = step, gap
        return failed
