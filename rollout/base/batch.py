"""RolloutBatch: the result of one `generate` call, one row per sample (per segment of an episode), prompt-major.

Rows are ordered prompt by prompt (all samples of prompt 0, then prompt 1, ...); the rows of one episode (its
segments, when its environment restarted it from a new context) are consecutive, in order. Tensors are right-padded
to the longest completion; `completion_mask` marks real tokens. Padding positions hold `pad_token_id` in
`completion_ids` and 0.0 in both logprob tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .errors import invalid
from .routing import Routing


@dataclass(frozen=True)
class Row:
    """One finished sample, before batching."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    finish_reason: str
    policy_version: int
    action_mask: list[bool] | None = None  # None: every completion token is the model's (no environment)
    reward: float = 0.0
    num_turns: int = 1
    error: str = ""
    token_versions: list[int] | None = None  # per completion token (-1 on observations); None: all policy_version
    prompt_tokens: int = 0  # tokens the row's engine requests were prompted with (n samples: on sample 0's row)
    reused_tokens: int = 0  # of those, served by the prefix cache
    draft_tokens: int = 0  # speculation: draft tokens its engine requests verified
    accepted_tokens: int = 0  # of those, kept
    segment_index: int = 0  # which segment of its episode (0 without an environment)
    turn_rewards: list[float] | None = None  # per completion token: a turn's reward on its last token; None: zeros
    routing: Routing | None = None  # the row's experts (one row), when the worker records routing
    top_ids: list[list[int]] | None = None  # per completion token, SamplingParams.top_logprobs most likely ids
    top_logprobs: list[list[float]] | None = None  # their logprobs (an observation token's lists are empty)


@dataclass(frozen=True)
class RolloutBatch:
    """prompt_ids: list of R prompt token lists (one per row).
    prompt_index: (R,) int64, which input prompt each row answers.
    completion_ids: (R, T) int64, right-padded.
    completion_mask: (R, T) bool.
    completion_lengths: (R,) int64.
    logprobs: (R, T) float32, log p(token) under log_softmax(logits / T) over the full vocabulary (T = 1 for
        greedy rows): what a trainer's plain forward recomputes.
    sampling_logprobs: (R, T) float32, log p(token) under the distribution actually sampled from (after top-k /
        top-p truncation; 0.0 for greedy rows, a point mass).
    finish_reason: R strings. Without an environment: "stop" (a stop token ended the row; it is the last completion
        token) or "length". With one (multi-turn episodes): "done" (the environment said so), "max_turns", "length"
        (the episode's token budget) or "error" (the environment raised, timed out or answered ids outside the
        vocabulary; the message is in `errors`).
    policy_version: (R,) int64, the weights version that produced each row (the oldest, if several did).
    token_versions: (R, T) int64, the version whose weights produced each token: with weight updates that land
        mid-generation (`in_flight="recompute"` or "keep") a row spans several; -1 on observation tokens and padding.
    action_mask: (R, T) bool, True on model-generated tokens (equal to `completion_mask` without an environment;
        False on observation tokens and padding).
    rewards: (R,) float32, the sum of each episode's turn rewards (0 without an environment).
    num_turns: (R,) int64, model turns of each row (1 without an environment).
    errors: R strings, why an episode ended with "error" ("" otherwise).
    episode_index: (R,) int64, which episode (sample) each row belongs to, counted in row order: 0, 1, ... one per
        (prompt_index, sample_index); the rows of one episode are consecutive. Equal to the row index unless an
        episode has several segments.
    segment_index: (R,) int64, which segment of its episode each row is (0 unless an environment restarted the
        episode from new `context_ids`). `prompt_ids` is the segment's own prompt; `rewards`, `finish_reason`,
        `num_turns` and `errors` are the episode's, repeated on each of its rows.
    turn_rewards: (R, T) float32, each turn's reward on that turn's last model token, 0.0 elsewhere; summed over an
        episode's rows they give its `rewards`.
    routing: None, or (with WorkerConfig(record_routing=True) on a mixture of experts) the experts the engine's own
        forward chose at every position of each row, prompt and completion (`rollout.moe.Routing`: per row a
        (positions, layers, top_k) uint8 tensor and the routers' names), for `rollout.replay_routing`.
    top_ids: None, or (when some row's SamplingParams ask `top_logprobs`) (R, T, K) int64, at each completion token
        the K most likely tokens, most likely first, K the largest `top_logprobs` asked; -1 where a row has fewer
        (it asked fewer, an observation token, padding).
    top_logprobs: None, or (R, T, K) float32, their logprobs under the same log_softmax(logits / T) as `logprobs`
        (the sampled token's entry, when listed, equals its `logprobs` value); -inf where `top_ids` is -1.
    stats: counts of the call: `prompt_tokens` (what its engine requests were prompted with, every turn of an
        episode counted), `reused_tokens` (of those, served by the prefix cache), `prefill_tokens` (the rest);
        with speculation, `draft_tokens` (drafts its requests verified) and `accepted_tokens` (of those, kept).
    """

    prompt_ids: list[list[int]]
    prompt_index: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    completion_lengths: torch.Tensor
    logprobs: torch.Tensor
    sampling_logprobs: torch.Tensor
    finish_reason: list[str]
    policy_version: torch.Tensor
    sample_index: torch.Tensor
    action_mask: torch.Tensor
    token_versions: torch.Tensor
    rewards: torch.Tensor
    num_turns: torch.Tensor
    errors: list[str]
    episode_index: torch.Tensor
    segment_index: torch.Tensor
    turn_rewards: torch.Tensor
    routing: Routing | None = field(default=None, compare=False)
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    stats: dict[str, int] = field(default_factory=dict, compare=False)
    tokenizer: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_rows(cls, rows: Sequence[Row], pad_token_id: int = 0, tokenizer: Any = None) -> "RolloutBatch":
        width = max((len(r.completion_ids) for r in rows), default=0)
        num = len(rows)
        ids = torch.full((num, width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((num, width), dtype=torch.bool)
        logprobs = torch.zeros((num, width), dtype=torch.float32)
        sampling = torch.zeros((num, width), dtype=torch.float32)
        action = torch.zeros((num, width), dtype=torch.bool)
        versions = torch.full((num, width), -1, dtype=torch.long)
        turn_rewards = torch.zeros((num, width), dtype=torch.float32)
        for i, row in enumerate(rows):
            length = len(row.completion_ids)
            ids[i, :length] = torch.tensor(row.completion_ids, dtype=torch.long)
            mask[i, :length] = True
            action[i, :length] = True if row.action_mask is None else torch.tensor(row.action_mask, dtype=torch.bool)
            versions[i, :length] = row.policy_version if row.token_versions is None else \
                torch.tensor(row.token_versions, dtype=torch.long)
            logprobs[i, :length] = torch.tensor(row.logprobs, dtype=torch.float32)
            sampling[i, :length] = torch.tensor(row.sampling_logprobs, dtype=torch.float32)
            if row.turn_rewards is not None:
                turn_rewards[i, :length] = torch.tensor(row.turn_rewards, dtype=torch.float32)
        return cls(
            prompt_ids=[list(r.prompt_ids) for r in rows],
            prompt_index=torch.tensor([r.prompt_index for r in rows], dtype=torch.long),
            completion_ids=ids,
            completion_mask=mask,
            completion_lengths=mask.sum(dim=1),
            logprobs=logprobs,
            sampling_logprobs=sampling,
            finish_reason=[r.finish_reason for r in rows],
            policy_version=torch.tensor([r.policy_version for r in rows], dtype=torch.long),
            sample_index=torch.tensor([r.sample_index for r in rows], dtype=torch.long),
            action_mask=action,
            token_versions=versions,
            rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32),
            num_turns=torch.tensor([r.num_turns for r in rows], dtype=torch.long),
            errors=[r.error for r in rows],
            episode_index=_episode_index(rows),
            segment_index=torch.tensor([r.segment_index for r in rows], dtype=torch.long),
            turn_rewards=turn_rewards,
            routing=_routing(rows),
            **_tops(rows, width),
            stats=_stats(rows),
            tokenizer=tokenizer,
        )

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Completion tokens in the batch (padding excluded)."""
        return int(self.completion_lengths.sum())

    def rows(self) -> list[Row]:
        """The batch back as rows (e.g. to merge batches from several workers)."""
        out = []
        for i in range(len(self)):
            length = int(self.completion_lengths[i])
            out.append(Row(
                prompt_index=int(self.prompt_index[i]), sample_index=int(self.sample_index[i]),
                prompt_ids=self.prompt_ids[i], completion_ids=self.completion_ids[i, :length].tolist(),
                logprobs=self.logprobs[i, :length].tolist(),
                sampling_logprobs=self.sampling_logprobs[i, :length].tolist(),
                finish_reason=self.finish_reason[i], policy_version=int(self.policy_version[i]),
                action_mask=self.action_mask[i, :length].tolist(), reward=float(self.rewards[i]),
                token_versions=self.token_versions[i, :length].tolist(),
                num_turns=int(self.num_turns[i]), error=self.errors[i], segment_index=int(self.segment_index[i]),
                turn_rewards=self.turn_rewards[i, :length].tolist(),
                routing=None if self.routing is None else self.routing.select([i]), **self._row_tops(i, length),
                **self._row_stats(i)))
        return out

    def _row_tops(self, i: int, length: int) -> dict[str, list]:
        """Row i's top lists as per-token lists, each cut at its first -1 (what the row had)."""
        if self.top_ids is None:
            return {}
        ids, values = self.top_ids[i, :length].tolist(), self.top_logprobs[i, :length].tolist()
        counts = [token.index(-1) if -1 in token else len(token) for token in ids]
        return {"top_ids": [token[:k] for token, k in zip(ids, counts)],
                "top_logprobs": [token[:k] for token, k in zip(values, counts)]}

    def _row_stats(self, i: int) -> dict[str, int]:
        """The call's token counts travel on its first row, so merged batches add up."""
        if i > 0:
            return {}
        return {name: self.stats.get(name, 0) for name in ROW_COUNTS}

    def completion_token_lists(self) -> list[list[int]]:
        return [self.completion_ids[i, : int(n)].tolist() for i, n in enumerate(self.completion_lengths)]

    def completion_texts(self, tokenizer: Any = None, skip_special_tokens: bool = True) -> list[str]:
        """Decode each row's completion; needs a tokenizer (given here or known to the worker)."""
        tok = self._tokenizer(tokenizer)
        return tok.batch_decode(self.completion_token_lists(), skip_special_tokens=skip_special_tokens)

    def prompt_texts(self, tokenizer: Any = None, skip_special_tokens: bool = False) -> list[str]:
        tok = self._tokenizer(tokenizer)
        return tok.batch_decode(self.prompt_ids, skip_special_tokens=skip_special_tokens)

    def _tokenizer(self, tokenizer: Any) -> Any:
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if tok is None:
            raise invalid("tokenizer", None, "decoding needs a tokenizer",
                          "pass tokenizer=... here or to RolloutWorker")
        return tok


def rewards_tensor(values: Any, num_rows: int, rows: str = "") -> torch.Tensor:
    """A reward function's output as an (R,) float32 CPU tensor, checked for length and finiteness. `rows` names
    what the rewards are for in the error (default: "<num_rows> rows")."""
    rewards = torch.as_tensor(values if isinstance(values, torch.Tensor) else list(values),
                              dtype=torch.float32).detach().cpu().flatten()
    if rewards.numel() != num_rows:
        raise ValueError(f"reward_fn returned {rewards.numel()} rewards for {rows or f'{num_rows} rows'}. Fix: return "
                         "one float per row of the RolloutBatch, in row order (prompt-major).")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("reward_fn returned NaN or Inf. Fix: return finite rewards.")
    return rewards


def _episode_index(rows: Sequence[Row]) -> torch.Tensor:
    """A new episode starts at every row whose (prompt_index, sample_index) differs from the row before."""
    index, previous = [], None
    for r in rows:
        key = (r.prompt_index, r.sample_index)
        index.append(index[-1] + (key != previous) if index else 0)
        previous = key
    return torch.tensor(index, dtype=torch.long)


def _routing(rows: Sequence[Row]) -> Routing | None:
    """Every row's routing, or None when no row has any. ValueError if only some rows have it."""
    have = [r.routing is not None for r in rows]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{have.count(False)} of {len(rows)} rows have no routing: rows recorded with and without "
                         "record_routing cannot be batched together. Fix: record routing on every worker.")
    return Routing.concat([r.routing for r in rows])


def _tops(rows: Sequence[Row], width: int) -> dict[str, torch.Tensor | None]:
    """top_ids / top_logprobs as (R, T, K) tensors, K the longest list; None when no row has any."""
    if all(r.top_ids is None for r in rows):
        return {"top_ids": None, "top_logprobs": None}
    k = max((len(ids) for r in rows for ids in r.top_ids or ()), default=0)
    ids, values = [], []
    for row in rows:
        row_ids, row_values = list(row.top_ids or ()), list(row.top_logprobs or ())
        row_ids += [[]] * (width - len(row_ids))
        row_values += [[]] * (width - len(row_values))
        ids.append([t + [-1] * (k - len(t)) for t in row_ids])
        values.append([v + [float("-inf")] * (k - len(v)) for v in row_values])
    return {"top_ids": torch.tensor(ids, dtype=torch.long).view(len(rows), width, k),
            "top_logprobs": torch.tensor(values, dtype=torch.float32).view(len(rows), width, k)}


ROW_COUNTS = ("prompt_tokens", "reused_tokens", "draft_tokens", "accepted_tokens")  # a call's, summed over its rows


def _stats(rows: Sequence[Row]) -> dict[str, int]:
    stats = {name: sum(getattr(r, name) for r in rows) for name in ROW_COUNTS}
    stats["prefill_tokens"] = stats["prompt_tokens"] - stats["reused_tokens"]
    return stats
