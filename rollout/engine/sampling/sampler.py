"""Per-row sampling with both logprobs from one set of logits, in one branch-free device path.

Given fp32 logits (N, V) and each row's parameters as device tensors (`SamplingRows`), pick each row's token and
return two logprobs of it:
- `logprob`: under log_softmax(logits / T) over the full vocabulary (T = 1 for greedy rows): what a trainer's plain
  forward recomputes;
- `sampling_logprob`: under the distribution actually sampled from (the row's logit adjustments, penalties.py, then
  temperature, then its grammar's mask, grammar.py, then min-p, then top-k, then top-p on the renormalised top-k
  distribution; greedy rows are a point mass, so 0.0).
When some row asks for `top_logprobs` (OpenAI's alternatives), every row also gets the `Passes.top` most likely tokens
and their logprobs, read off the same full-vocabulary log_softmax (so the sampled token's entry, when listed, is
bit-identical to its `logprob`); the host keeps each row's own k of them.
Rows differ by data, never by control flow: every row is scaled, drawn from and argmax-ed, and `torch.where` keeps
what its parameters ask for. Which full-vocabulary passes a step pays for is the caller's static choice (`Passes`,
from the step's parameters on the host: a step with no truncating row skips the sort, one at temperature 1 the
division, one without greedy rows the argmax, one where no row asks for penalties, bias, min_new_tokens, min_p or a
grammar (`SamplingParams.structured`) their pass); the passes change the cost, never a row's token (every draw is an
inverse CDF in vocabulary order, and a row that asks for no adjustment keeps its logits bit for bit). A captured step
runs them all. Randomness is counter-based (streams.py): a row's uniform is a hash of its key and the position it
samples at. No host synchronisation, no generator state, nothing shaped by the data: the path can be captured in a
CUDA graph (the grammar's masks are filled on the host before the step: grammar.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...base.params import MAX_TOP_LOGPROBS, SamplingParams
from .grammar import Constraint, constrain
from .penalties import ALL_PARTS, Adjust, adjust_logits, parts
from .streams import uniforms


@dataclass(frozen=True)
class RowSpec:
    """What one request is sampled with, on the host: its params, the key of its random stream (streams.py) and the
    ids that stop it (what min_new_tokens holds back)."""

    params: SamplingParams
    key: int = 0
    stop_ids: tuple[int, ...] = ()

    @property
    def passes(self) -> "Passes":
        """The optional passes this row needs."""
        p = self.params
        sampled = not p.is_greedy
        return Passes(scale=sampled and p.temperature != 1, argmax=p.is_greedy,
                      truncate=sampled and (p.top_k > 0 or p.top_p < 1.0), top=p.top_logprobs,
                      adjust=parts(p), min_p=sampled and p.min_p > 0, constrain=p.is_constrained)


@dataclass(frozen=True)
class SamplingRows:
    """The parameters of a step's rows as device tensors, one entry per row ([N] each)."""

    temperature: torch.Tensor  # float32; 1.0 on greedy rows (their logprobs are of the raw softmax)
    top_k: torch.Tensor  # int64; 0 disables
    top_p: torch.Tensor  # float32; 1.0 disables
    greedy: torch.Tensor  # bool
    key: torch.Tensor  # int64
    min_p: torch.Tensor | None = None  # float32; 0.0 disables (0.0 on greedy rows); None: the step's pass is skipped
    adjust: Adjust | None = None  # penalties, bias and min_new_tokens (penalties.py); None: the pass is skipped
    constraint: Constraint | None = None  # grammar masks of constrained rows (grammar.py); None: the pass is skipped

    @classmethod
    def of(cls, specs: list[RowSpec], device: torch.device | str = "cpu", adjust: Adjust | None = None
           ) -> "SamplingRows":
        greedy = [s.params.is_greedy for s in specs]
        floats = lambda values: torch.tensor(values, dtype=torch.float32, device=device)  # noqa: E731
        return cls(temperature=floats([1.0 if g else float(s.params.temperature) for s, g in zip(specs, greedy)]),
                   top_k=torch.tensor([s.params.top_k for s in specs], dtype=torch.int64, device=device),
                   top_p=floats([float(s.params.top_p) for s in specs]),
                   greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
                   key=torch.tensor([s.key for s in specs], dtype=torch.int64, device=device),
                   min_p=floats([0.0 if g else float(s.params.min_p) for s, g in zip(specs, greedy)]), adjust=adjust)


@dataclass(frozen=True)
class Passes:
    """The optional full-vocabulary passes of one step: each is needed only when some row of the step asks for it."""

    scale: bool = True  # a row with a temperature other than 1
    truncate: bool = True  # a row with top-k or top-p
    argmax: bool = True  # a greedy row
    top: int = MAX_TOP_LOGPROBS  # the most top logprobs a row asks for (0: no top-k pass)
    adjust: int = ALL_PARTS  # the parts of the adjust pass rows ask for (penalties.py: bias, stops, ...); 0: none
    min_p: bool = True  # a sampled row with min_p
    constrain: bool = True  # a constrained row (SamplingParams.structured): its grammar's mask

    def __or__(self, other: "Passes") -> "Passes":
        return Passes(self.scale or other.scale, self.truncate or other.truncate, self.argmax or other.argmax,
                      max(self.top, other.top), self.adjust | other.adjust, self.min_p or other.min_p,
                      self.constrain or other.constrain)


ALL = Passes()
NONE = Passes(scale=False, truncate=False, argmax=False, top=0, adjust=0, min_p=False, constrain=False)


class Drawn(NamedTuple):
    """What `sample_rows` returns, per row: the token, its two logprobs, and the `passes.top` most likely tokens with
    their full-vocabulary logprobs, most likely first ((N, top) each; (N, 0) when the pass is skipped)."""

    tokens: torch.Tensor  # (N,) int64
    logprobs: torch.Tensor  # (N,) float32
    sampling_logprobs: torch.Tensor  # (N,) float32
    top_ids: torch.Tensor  # (N, top) int64
    top_logprobs: torch.Tensor  # (N, top) float32


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


def sample_rows(logits: torch.Tensor, rows: SamplingRows, positions: torch.Tensor, passes: Passes = ALL) -> Drawn:
    """Sample one token per row. logits: (N, V) fp32, not modified; positions: (N,) int64, the position each row
    samples at (its random counter). Returns the tokens, their two logprobs and the top lists (`Drawn`).

    `passes` may leave out a pass no row needs (see Passes); leaving out one a row needs samples that row wrongly."""
    scaled = logits / rows.temperature[:, None] if passes.scale else logits
    full_logprobs = torch.log_softmax(scaled, dim=-1)  # (N, V)
    top = _top(full_logprobs, passes.top)
    reshaped = _reshaped(rows, passes)  # (N,) bool: rows whose adjustments or min-p change what they sample; or None
    target = scaled if reshaped is None else _target(logits, rows, positions, passes)  # what is drawn from
    greedy_tokens = target.argmax(dim=-1) if passes.argmax else None
    u = uniforms(rows.key, positions)
    # (N, V) buffers of ours are reused once read for the last time: on CPU each fresh one is page-faulted in again
    spare = scaled if passes.scale and reshaped is None else None
    if passes.truncate:  # the truncated distribution, back in vocabulary order: a row that truncates nothing draws the
        # very token it draws without this pass (the same probabilities in the same order, the same uniform)
        sorted_logits, order = torch.sort(target, dim=-1, descending=True)
        removed_sorted = truncation_mask(sorted_logits, rows.top_k, rows.top_p)
        removed = torch.empty_like(removed_sorted).scatter_(1, order, removed_sorted)
        kept = torch.log_softmax(target.masked_fill(removed, float("-inf")), dim=-1)
        drawn = _draw(torch.exp(kept, out=sorted_logits), u)
        drawn_logprob = kept.gather(1, drawn[:, None]).squeeze(1)
    elif reshaped is not None:  # a row that asks for nothing has target == scaled: kept == full_logprobs, bit for bit
        kept = torch.log_softmax(target, dim=-1)
        drawn = _draw(torch.exp(kept, out=target), u)  # target is our own buffer (_target), read for the last time
        drawn_logprob = kept.gather(1, drawn[:, None]).squeeze(1)
    else:
        drawn, drawn_logprob = _draw(torch.exp(full_logprobs, out=spare), u), None
    tokens = drawn if greedy_tokens is None else torch.where(rows.greedy, greedy_tokens, drawn)
    logprobs = full_logprobs.gather(1, tokens[:, None]).squeeze(1)
    sampling = logprobs
    if drawn_logprob is not None:  # a row that truncates nothing reports the full logprob itself (bit-identical)
        plain = (rows.top_k == 0) & (rows.top_p >= 1.0)
        sampling = torch.where(plain if reshaped is None else plain & ~reshaped, logprobs, drawn_logprob)
    sampling = sampling.masked_fill(rows.greedy, 0.0)  # greedy rows: a point mass
    return Drawn(tokens, logprobs, sampling, top[1], top[0])


def _reshaped(rows: SamplingRows, passes: Passes) -> torch.Tensor | None:
    """Which rows the adjust, grammar and min-p passes change, or None when the step runs none of them."""
    changed = []
    if passes.adjust and rows.adjust is not None:
        changed.append(rows.adjust.active)
    if passes.constrain and rows.constraint is not None:
        changed.append(rows.constraint.active)
    if passes.min_p and rows.min_p is not None:
        changed.append(rows.min_p > 0)
    reshaped = changed[0] if changed else None
    for more in changed[1:]:
        reshaped = reshaped | more
    return reshaped


def _target(logits: torch.Tensor, rows: SamplingRows, positions: torch.Tensor, passes: Passes) -> torch.Tensor:
    """The scaled logits rows sample from, in a new tensor: adjusted (penalties.py), divided by the temperature,
    masked by the row's grammar (grammar.py: disallowed tokens at -inf), then min-p (tokens less likely than min_p x
    the most likely allowed one at -inf). Rows that ask for none of these get `logits / T` bit for bit."""
    if passes.adjust and rows.adjust is not None:
        target = adjust_logits(logits, rows.adjust, positions, passes.adjust)
        if passes.scale:
            target.div_(rows.temperature[:, None])
    else:
        target = logits / rows.temperature[:, None] if passes.scale else logits.clone()
    if passes.constrain and rows.constraint is not None:  # an unconstrained row's mask is all ones: unchanged
        constrain(target, rows.constraint)
    if passes.min_p and rows.min_p is not None:  # p < min_p x p_max, as log-probability differences (min_p 0: -inf)
        floor = target.amax(dim=-1, keepdim=True) + torch.log(rows.min_p)[:, None]
        target.masked_fill_(target < floor, float("-inf"))
    return target


def _top(full_logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row and their logprobs, most likely first (equal logprobs in no set order)."""
    if k == 0:
        num_rows = full_logprobs.shape[0]
        return (torch.empty((num_rows, 0), dtype=full_logprobs.dtype, device=full_logprobs.device),
                torch.empty((num_rows, 0), dtype=torch.int64, device=full_logprobs.device))
    values, indices = torch.topk(full_logprobs, min(k, full_logprobs.shape[-1]), dim=-1)
    return values, indices


CHUNK = 128  # tokens per block of the two-level inverse CDF


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One exact draw per row by inverse CDF: target = u * total, and the first token whose cumulative probability
    exceeds the target (a zero-probability token never does). uniforms: float64 (N,) in [0, 1).

    The CDF is two-level: float32 sums of blocks of CHUNK tokens, accumulated in float64, locate the target's block,
    then that one block per row is accumulated in float64. No (N, V) float64 tensor is built (that conversion alone
    cost more than the rest of sampling); a token's draw probability is its own, up to the float32 rounding of its
    block's sum (~1e-7 relative), and a zero-probability token is never drawn."""
    device = probs.device
    num_rows, vocab = probs.shape
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
