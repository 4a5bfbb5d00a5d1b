"""Packing (prompt, completion) pairs into token-budgeted, padding-free batches for teacher-forced scoring.

Contract: knows nothing about models. A pack is ONE row of concatenated sequences. Sequence i feeds
`prompt + completion[:-1]` (the last completion token is only ever a target), its position ids restart at 0, and
the positions whose next token is a completion token are recorded, so the caller can compute logits for those rows
only. Sequences keep their input order, across packs and within a pack.

Budget: a pack feeds at most `max_batch_tokens` tokens, except a single sequence longer than the budget, which is
packed alone (it must still be scored; its length is already bounded by the model's context).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Pair:
    """One validated scoring request: token ids, the temperature to score at, and its index in the input."""

    index: int
    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    temperature: float

    @property
    def num_fed(self) -> int:
        """Tokens this pair puts through the model: the prompt and all completion tokens but the last."""
        return len(self.prompt) + len(self.completion) - 1


@dataclass(frozen=True)
class Pack:
    """One padding-free batch. T = tokens fed, S = sequences, R = completion tokens scored (rows of logits kept)."""

    input_ids: torch.Tensor  # [T] int64: the sequences' fed tokens, concatenated
    position_ids: torch.Tensor  # [T] int64: restart at 0 for every sequence
    cu_seq_lens: torch.Tensor  # [S + 1] int32: sequence boundaries in input_ids (the flash varlen format)
    keep: torch.Tensor  # [R] int64: positions whose logits predict a completion token
    targets: torch.Tensor  # [R] int64: the completion token each kept position predicts
    temperatures: torch.Tensor  # [R] float32: the temperature of each kept row's pair (0 already mapped to 1)
    num_targets: tuple[int, ...]  # [S] completion length of each sequence: how the R rows split
    indices: tuple[int, ...]  # [S] input index of each sequence
    max_seq_len: int  # longest fed sequence, for the varlen kernels

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def batches(pairs: Iterable[Pair], max_batch_tokens: int) -> Iterator[list[Pair]]:
    """Group pairs greedily in input order; a group closes when the next pair would push it past the budget.

    If reading the next pair fails (a pair that does not validate, a malformed input line), the pairs already read
    are yielded first and the error is raised after them, so a stream loses no finished work.
    """
    group: list[Pair] = []
    num_tokens = 0
    try:
        for pair in pairs:
            if group and num_tokens + pair.num_fed > max_batch_tokens:
                yield group
                group, num_tokens = [], 0
            group.append(pair)
            num_tokens += pair.num_fed
    except Exception:
        if group:
            yield group
        raise
    if group:
        yield group


def build_pack(pairs: list[Pair]) -> Pack:
    """Concatenate a group of pairs into one row with per-sequence positions and the rows of logits to keep."""
    ids, positions, keep, targets, temps, bounds = [], [], [], [], [], [0]
    for pair in pairs:
        start, fed = bounds[-1], pair.num_fed
        ids.extend(pair.prompt + pair.completion[:-1])
        positions.extend(range(fed))
        # the logits at position (len(prompt) - 1 + j) of a sequence predict completion token j
        keep.extend(range(start + len(pair.prompt) - 1, start + fed))
        targets.extend(pair.completion)
        temps.extend([pair.temperature or 1.0] * len(pair.completion))
        bounds.append(start + fed)
    return Pack(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(positions, dtype=torch.long),
        cu_seq_lens=torch.tensor(bounds, dtype=torch.int32),
        keep=torch.tensor(keep, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        temperatures=torch.tensor(temps, dtype=torch.float32),
        num_targets=tuple(len(p.completion) for p in pairs),
        indices=tuple(p.index for p in pairs),
        max_seq_len=max(p.num_fed for p in pairs),
    )


def block_causal_mask(cu_seq_lens: torch.Tensor, dtype: torch.dtype = torch.bool,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """[1, 1, T, T] mask letting each token see only earlier tokens of its own sequence.

    Boolean (True = attend) for sdpa; any float dtype gives the additive form (0 / dtype min) that eager attention
    adds to its scores (eager would add a boolean mask as 0/1 and leak across sequences).
    """
    lengths = cu_seq_lens.diff().long()
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)  # [T]
    num_tokens = int(segment.numel())
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril_()
    allowed = (segment[:, None] == segment[None, :]) & causal  # [T, T]
    if dtype == torch.bool:
        return allowed[None, None]
    additive = torch.zeros(num_tokens, num_tokens, dtype=dtype, device=device)
    return additive.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
