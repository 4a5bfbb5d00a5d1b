"""Per-row sampling with both logprobs from one set of logits.

Given fp32 logits (N, V) and one SamplingParams per row, pick each row's token and return two logprobs of it:
- `logprob`: under log_softmax(logits / T) over the full vocabulary (T = 1 for greedy rows): what a trainer's plain
  forward recomputes;
- `sampling_logprob`: under the distribution actually sampled from (temperature, then top-k, then top-p on the
  renormalised top-k distribution; greedy rows are a point mass, so 0.0).
The engine knows nothing about this module's maths beyond calling `sample_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..params import SamplingParams


@dataclass
class RowSpec:
    """What one row needs to be sampled: its params and, for seeded requests, its own generator."""

    params: SamplingParams
    generator: torch.Generator | None = None


def truncation_mask(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which sorted (descending) positions are removed by top-k then top-p. Shapes: (N, V), (N,), (N,) -> (N, V).

    top_k == 0 disables top-k; top_p == 1 disables top-p. The most likely token is always kept.
    """
    num_rows, vocab = sorted_logits.shape
    positions = torch.arange(vocab, device=sorted_logits.device).expand(num_rows, vocab)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    removed = positions >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(removed, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the strictly more likely tokens
    removed |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    removed[:, 0] = False
    return removed


def sample_rows(logits: torch.Tensor, rows: list[RowSpec], generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits: (N, V) fp32. Returns (tokens (N,) int64, logprobs (N,), sampling (N,)).

    Full-vocabulary passes are what a step pays for here, so the common cases skip the ones they do not need: no
    division when every temperature is 1, one log-softmax shared by both logprobs when nothing is truncated, an argmax
    only over greedy rows."""
    device = logits.device
    temps = [1.0 if r.params.is_greedy else float(r.params.temperature) for r in rows]
    scaled = logits if all(t == 1.0 for t in temps) else \
        logits / torch.tensor(temps, device=device, dtype=torch.float32)[:, None]
    full_logprobs = torch.log_softmax(scaled, dim=-1)  # (N, V)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    sampling = torch.zeros(len(rows), dtype=torch.float32, device=device)  # greedy rows: a point mass
    if greedy:
        _assign(tokens, greedy, _subset(scaled, greedy).argmax(dim=-1))
    if sampled:
        tok, lp = _sample_subset(_subset(scaled, sampled), _subset(full_logprobs, sampled),
                                 [rows[i] for i in sampled], generator)
        _assign(tokens, sampled, tok)
        _assign(sampling, sampled, lp)
    logprobs = full_logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs, sampling


def _subset(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    return x if len(index) == x.shape[0] else x[torch.tensor(index, device=x.device)]


def _assign(x: torch.Tensor, index: list[int], values: torch.Tensor) -> None:
    if len(index) == x.shape[0]:
        x.copy_(values)
    else:
        x[torch.tensor(index, device=x.device)] = values


def _sample_subset(scaled: torch.Tensor, full_logprobs: torch.Tensor, rows: list[RowSpec],
                   generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample rows that are not greedy. scaled: (M, V) temperature-scaled logits, full_logprobs their log-softmax.
    Returns tokens and their logprob under the distribution sampled from (the full one when nothing is truncated:
    the very same number as the full logprob)."""
    device = scaled.device
    if not any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
        choice = _draw(full_logprobs.exp(), rows, generator)
        return choice, full_logprobs.gather(1, choice[:, None]).squeeze(1)
    top_k = torch.tensor([r.params.top_k for r in rows], device=device)
    top_p = torch.tensor([float(r.params.top_p) for r in rows], device=device, dtype=torch.float32)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    removed = truncation_mask(sorted_logits, top_k, top_p)
    sampling_logprobs = torch.log_softmax(sorted_logits.masked_fill(removed, float("-inf")), dim=-1)
    choice = _draw(sampling_logprobs.exp(), rows, generator)  # positions in sorted space
    lp = sampling_logprobs.gather(1, choice[:, None]).squeeze(1)
    # a row that truncates nothing reports the full logprob itself (bit-identical), as in the untruncated path
    untruncated = torch.tensor([r.params.top_k == 0 and r.params.top_p >= 1.0 for r in rows], device=device)
    tokens = order.gather(1, choice[:, None]).squeeze(1)
    return tokens, torch.where(untruncated, full_logprobs.gather(1, tokens[:, None]).squeeze(1), lp)


CHUNK = 128  # tokens per block of the two-level inverse CDF


def _draw(probs: torch.Tensor, rows: list[RowSpec], generator: torch.Generator | None) -> torch.Tensor:
    """One exact draw per row by inverse CDF: a uniform u in [0, 1), target = u * total, and the first token whose
    cumulative probability exceeds the target (a zero-probability token never does). Seeded rows draw their uniform
    from their own generator, the rest from the worker's.

    The CDF is two-level: float32 sums of blocks of CHUNK tokens, accumulated in float64, locate the target's block,
    then that one block per row is accumulated in float64. No (N, V) float64 tensor is built (that conversion alone
    cost more than the rest of sampling); a token's draw probability is its own, up to the float32 rounding of its
    block's sum (~1e-7 relative), and a zero-probability token is never drawn."""
    device = probs.device
    num_rows, vocab = probs.shape
    uniforms = torch.empty(num_rows, dtype=torch.float64, device=device)
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    if shared:
        uniforms[torch.tensor(shared, device=device)] = torch.rand(len(shared), generator=generator,
                                                                   dtype=torch.float64, device=device)
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniforms[i] = torch.rand(1, generator=row.generator, dtype=torch.float64, device=device)[0]
    pad = -vocab % CHUNK
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = blocks.view(num_rows, -1, CHUNK)  # (N, B, CHUNK)
    block_cdf = blocks.sum(-1).double().cumsum(-1)  # (N, B): float32 block sums, accumulated in float64
    total = block_cdf[:, -1]
    # u * total may round up to total itself: keep the target strictly below it
    targets = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))[:, None]
    block = torch.searchsorted(block_cdf, targets, right=True)  # first block whose cdf exceeds the target
    block = block.clamp_(max=block_cdf.shape[1] - 1)  # only non-finite logits get past the last block
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(targets))
    chosen = blocks.gather(1, block[:, :, None].expand(-1, -1, CHUNK)).squeeze(1)  # (N, CHUNK)
    inner = torch.searchsorted(chosen.double().cumsum(-1), targets - before, right=True).squeeze(1)
    # the block's own running sum can round just below its block total: fall back to its last possible token
    positions = torch.arange(CHUNK, device=device)
    last = torch.where(chosen > 0, positions, -1).amax(-1)
    inner = torch.where(inner >= CHUNK, last, inner)
    return (block.squeeze(1) * CHUNK + inner).clamp_(0, vocab - 1)
