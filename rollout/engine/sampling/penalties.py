"""Per-row logit adjustments: `logit_bias`, `min_new_tokens`, and the repetition, frequency and presence penalties.

What a row that asks for them samples from (vLLM's order; a row that asks for none is never changed):
1. `logit_bias`: its bias added to each listed token's logit;
2. `min_new_tokens`: its stop ids at -inf until it has generated that many tokens;
3. `repetition_penalty` r (HF / vLLM): every token of its prompt or of its completion so far has its logit divided by
   r if positive, multiplied by r otherwise;
4. `frequency_penalty` f and `presence_penalty` p (OpenAI): logit - f x count - p x (count > 0), count = how often
   the token occurs in the row's completion so far.
Then temperature, `min_p`, top-k and top-p (sampler.py). `logprobs` stay those of the raw logits: adjustments change
what is sampled and `sampling_logprobs`, never `logprobs`.

`AdjustTable` holds, on the device, one dense row of vocabulary size per request that asks: its bias (float32), its
penalty so far, -(f x count + p x (count > 0)) (float32), which tokens its completion holds (bool), which its prompt
or completion holds (bool, what the repetition penalty reads) and its stop ids (bool): 11 bytes x vocab per such
request, allocated only once some request asks and grown by doubling. Row 0 is all zeros, for the rows of a step that
ask for nothing. A row is written from the request's own tokens when it gets a slot (`write`), then updated on the
device after every step that samples for it (`count`): no per-step host work, nothing read back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...base.params import SamplingParams

# the tables of an AdjustTable: name -> dtype
TABLES = {"bias": torch.float32, "penalty": torch.float32, "generated": torch.bool, "seen": torch.bool,
          "stops": torch.bool}
# the parts of the pass (bits of sampler.Passes.adjust): a step runs only those some row of it asks for
BIAS, STOPS, REPEAT, PENALIZE = 1, 2, 4, 8
ALL_PARTS = BIAS | STOPS | REPEAT | PENALIZE


def parts(params: SamplingParams) -> int:
    """The parts of the adjust pass a request needs (0: none)."""
    return ((BIAS if params.logit_bias else 0) | (STOPS if params.min_new_tokens else 0)
            | (REPEAT if params.repetition_penalty != 1.0 else 0)
            | (PENALIZE if params.frequency_penalty or params.presence_penalty else 0))


@dataclass(frozen=True)
class Adjust:
    """A step's adjustments: per row [N] device tensors, and the table their rows index."""

    active: torch.Tensor  # bool [N]: the row asks for some adjustment
    frequency: torch.Tensor  # float32 [N]
    presence: torch.Tensor  # float32 [N]
    repetition: torch.Tensor  # float32 [N]; 1.0: none
    min_position: torch.Tensor  # int64 [N]: stops are masked while the row samples at a position below it
    rows: torch.Tensor  # int64 [N]: the row of the AdjustTable (0: none)
    table: "AdjustTable"


def adjust_logits(logits: torch.Tensor, adjust: Adjust, positions: torch.Tensor, needed: int = ALL_PARTS
                  ) -> torch.Tensor:
    """The logits (N, V) a row's adjustments turn its raw logits into, in a new tensor; `needed`: the parts some row
    asks for (the others are skipped). A row that asks for none reads table row 0 (all zeros) and neutral parameters,
    so every step below leaves its logits as they are, bit for bit. `positions` (N,): the position each row samples
    at. At most two fresh (N, V) float buffers, the rest in place: on CPU each fresh one costs a page-faulting pass
    over the vocabulary."""
    table, rows = adjust.table, adjust.rows
    x = torch.index_select(table.bias, 0, rows).add_(logits) if needed & BIAS else logits.clone()
    if needed & STOPS:
        early = (positions < adjust.min_position)[:, None]
        x.masked_fill_(table.stops.index_select(0, rows).logical_and_(early), float("-inf"))
    spare = None
    if needed & REPEAT:  # logit / r if positive, x r (as / (1 / r), within an ulp) otherwise; 1 where unseen
        r = adjust.repetition[:, None]
        spare = torch.gt(x, 0, out=torch.empty_like(x)).mul_(r - 1.0 / r).add_(1.0 / r)  # r or 1 / r
        x.div_(spare.masked_fill_(table.seen.index_select(0, rows).logical_not_(), 1.0))
    if needed & PENALIZE:
        x.add_(torch.index_select(table.penalty, 0, rows, out=spare) if spare is not None else
               table.penalty.index_select(0, rows))
    return x


class AdjustTable:
    """Dense per-request adjustment rows on the device (see the module docstring)."""

    bias: torch.Tensor
    penalty: torch.Tensor
    generated: torch.Tensor
    seen: torch.Tensor
    stops: torch.Tensor

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device, self.vocab_size = device, vocab_size
        self.stream = None  # the engine's compute stream, when it has one: writes are ordered after earlier steps
        self.capacity = 0  # the tables are allocated by the first request that asks
        self._free: list[int] = []
        self._retired: list[torch.Tensor] = []

    def write(self, params: SamplingParams, stop_ids: tuple[int, ...], prompt: list[int],
              completion: list[int]) -> tuple[int, bool]:
        """A row for one request, written from its tokens. Returns (row, whether the tables were reallocated)."""
        grown = self.full
        if grown:
            self._grow()
        row = self._free.pop()
        with self._on_stream():
            self._fill(row, params, stop_ids, prompt, completion)
        return row, grown

    @property
    def full(self) -> bool:
        """No free row: the next `write` grows the tables."""
        return not self._free

    def free(self, row: int) -> None:
        if row:
            self._free.append(row)

    def count(self, adjust: Adjust, tokens: torch.Tensor) -> None:
        """Each active row's sampled token joins its completion (device work only, N elements; rows that ask for
        nothing change nothing: row 0 stays zeros)."""
        rows, active = adjust.rows, adjust.active
        first = self.generated[rows, tokens].logical_not_()
        step = (adjust.frequency + adjust.presence * first) * active
        self.penalty.index_put_((rows, tokens), -step, accumulate=True)
        self.generated.index_put_((rows, tokens), self.generated[rows, tokens] | active)
        self.seen.index_put_((rows, tokens), self.seen[rows, tokens] | active)

    def _fill(self, row: int, params: SamplingParams, stop_ids, prompt: list[int], completion: list[int]) -> None:
        for name in TABLES:
            getattr(self, name)[row].zero_()
        if completion:
            ids = torch.tensor(completion, dtype=torch.int64).to(self.device)
            counts = torch.zeros(self.vocab_size, device=self.device).index_add_(0, ids, torch.ones_like(
                ids, dtype=torch.float32))
            present = counts > 0
            self.penalty[row] = -(params.frequency_penalty * counts + params.presence_penalty * present)
            self.generated[row], self.seen[row] = present, present
        if prompt:
            self.seen[row, torch.tensor(prompt, dtype=torch.int64).to(self.device)] = True
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            values = torch.tensor(values, dtype=torch.float32)  # JSON's integer biases too
            self.bias[row, torch.tensor(ids).to(self.device)] = values.to(self.device)
        if params.min_new_tokens and stop_ids:
            self.stops[row, torch.tensor(stop_ids, dtype=torch.int64).to(self.device)] = True

    def _grow(self) -> None:
        old, new = self.capacity, max(2 * self.capacity, 8)
        with self._on_stream():
            for name, dtype in TABLES.items():
                grown = torch.zeros((new, self.vocab_size), dtype=dtype, device=self.device)
                if old:
                    table = getattr(self, name)
                    grown[:old].copy_(table)
                    if self.stream is not None:  # a step still running on another stream may read it
                        self._retired.append(table)
                setattr(self, name, grown)
        self.capacity = new
        self._free += list(range(new - 1, max(old, 1) - 1, -1))

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
