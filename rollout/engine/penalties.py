"""Per-row logit adjustments: `logit_bias`, `min_new_tokens`, and the repetition, frequency and presence penalties.

What a row that asks for them samples from (vLLM's order; a row that asks for none is never touched):
1. `logit_bias`: its bias added to each listed token's logit;
2. `min_new_tokens`: its stop ids at -inf until it has generated that many tokens;
3. `repetition_penalty` r (HF / vLLM): every token of its prompt or of its completion so far has its logit divided by
   r if positive, multiplied by r otherwise;
4. `frequency_penalty` f and `presence_penalty` p (OpenAI): logit - f x count - p x (count > 0), count = how often
   the token occurs in the row's completion so far.
Then temperature, `min_p`, top-k and top-p (sampler.py). `logprobs` stay those of the raw logits: adjustments change
what is sampled and `sampling_logprobs`, never `logprobs`.

`AdjustTable` holds, on the device, one dense row of vocabulary size per request that asks: its completion's token
counts (float32), which tokens its prompt holds (bool), its bias (float32) and its stop ids (bool): 10 bytes x vocab
per such request, allocated only once some request asks and grown by doubling. Row 0 is all zeros, for the rows of a
step that ask for nothing. A row is written from the request's own tokens when it gets a slot (`write`), then
counted on the device after every step that samples for it (`count`): no per-step host work, nothing read back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..base.params import SamplingParams


@dataclass(frozen=True)
class Adjust:
    """A step's adjustments, device tensors: per row [N] and per row and token [N, V]."""

    active: torch.Tensor  # bool [N]: the row asks for some adjustment
    frequency: torch.Tensor  # float32 [N]
    presence: torch.Tensor  # float32 [N]
    repetition: torch.Tensor  # float32 [N]; 1.0: none
    min_position: torch.Tensor  # int64 [N]: stops are masked while the row samples at a position below it
    rows: torch.Tensor  # int64 [N]: the row of the AdjustTable (0: none)
    counts: torch.Tensor  # float32 [N, V]: occurrences of each token in the row's completion so far
    prompt: torch.Tensor  # bool [N, V]: the token is in the row's prompt
    bias: torch.Tensor  # float32 [N, V]
    stops: torch.Tensor  # bool [N, V]: the row's stop ids


def adjust_logits(logits: torch.Tensor, adjust: Adjust, positions: torch.Tensor) -> torch.Tensor:
    """The logits (N, V) a row's adjustments turn its raw logits into; rows that ask for none keep theirs bit for bit.
    `positions` (N,): the position each row samples at."""
    x = logits + adjust.bias
    early = (positions < adjust.min_position)[:, None]
    x = x.masked_fill(adjust.stops & early, float("-inf"))
    seen = adjust.counts > 0
    r = torch.where(adjust.prompt | seen, adjust.repetition[:, None], 1.0)
    x = torch.where(x > 0, x / r, x * r)
    x = x - adjust.frequency[:, None] * adjust.counts - adjust.presence[:, None] * seen
    return torch.where(adjust.active[:, None], x, logits)


def history(state) -> tuple[list[int], list[int]]:
    """(prompt, completion so far) of an upstream RequestState; a soft reset folds the completion into its
    `initial_tokens` and remembers the prompt's length in `_true_initial_tokens` (tests/test_upstream_contract.py)."""
    true = state._true_initial_tokens
    if true:
        return state.initial_tokens[:true], state.initial_tokens[true:] + state.generated_tokens
    return state.initial_tokens, state.generated_tokens


class AdjustTable:
    """Dense per-request adjustment rows on the device (see the module docstring)."""

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device, self.vocab_size = device, vocab_size
        self.stream = None  # the engine's compute stream, when it has one: writes are ordered after earlier steps
        self.counts = self.prompt = self.bias = self.stops = None  # allocated by the first request that asks
        self._free: list[int] = []
        self._retired: list[torch.Tensor] = []

    @property
    def capacity(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    def write(self, params: SamplingParams, stop_ids: tuple[int, ...], prompt: list[int],
              completion: list[int]) -> tuple[int, bool]:
        """A row for one request, written from its tokens. Returns (row, whether the tables were reallocated)."""
        grown = not self._free
        if grown:
            self._grow()
        row = self._free.pop()
        with self._on_stream():
            self._fill(row, params, stop_ids, prompt, completion)
        return row, grown

    def free(self, row: int) -> None:
        if row:
            self._free.append(row)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(counts, prompt, bias, stops) of each row, [N, V] each."""
        return tuple(t.index_select(0, rows) for t in (self.counts, self.prompt, self.bias, self.stops))

    def count(self, rows: torch.Tensor, tokens: torch.Tensor, active: torch.Tensor) -> None:
        """Count each active row's sampled token (device work only; rows that ask for nothing add 0 to row 0)."""
        self.counts.index_put_((rows, tokens), active.to(self.counts.dtype), accumulate=True)

    def _fill(self, row: int, params: SamplingParams, stop_ids, prompt: list[int], completion: list[int]) -> None:
        for table in (self.counts, self.prompt, self.bias, self.stops):
            table[row].zero_()
        if completion:
            ids = torch.tensor(completion, dtype=torch.int64).to(self.device)
            self.counts[row].index_put_((ids,), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        if params.repetition_penalty != 1.0:
            self.prompt[row, torch.tensor(prompt, dtype=torch.int64).to(self.device)] = True
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias[row, torch.tensor(ids).to(self.device)] = torch.tensor(values).to(self.device)
        if params.min_new_tokens and stop_ids:
            self.stops[row, torch.tensor(stop_ids, dtype=torch.int64).to(self.device)] = True

    def _grow(self) -> None:
        old = self.capacity
        new = max(2 * old, 8)
        with self._on_stream():
            tables = []
            for table, dtype in ((self.counts, torch.float32), (self.prompt, torch.bool), (self.bias, torch.float32),
                                 (self.stops, torch.bool)):
                grown = torch.zeros((new, self.vocab_size), dtype=dtype, device=self.device)
                if table is not None:
                    grown[:old].copy_(table)
                    if self.stream is not None:  # a step still running on another stream may read it
                        self._retired.append(table)
                tables.append(grown)
        self.counts, self.prompt, self.bias, self.stops = tables
        self._free += list(range(new - 1, max(old, 1) - 1, -1))

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
