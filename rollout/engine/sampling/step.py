"""StepSampler: the engine's side of upstream's model-runner step (upstream/runner.py calls it; nothing there imports
the engine). One step's life:

- inputs (`prepare`, while upstream lays out the step's inputs): each sampling row's slot in the `SlotTable` is
  written into the step's int32 argument line; the step's sampler passes are chosen from those rows, constrained rows
  get their grammar masks, and a speculating engine's verifier plans the logits rows of the step's drafts. What was
  chosen comes back as one typed `StepChoice`, which the runner hands to the forward and the read-back of that step;
- forward (`forward_context`): the linears on oneDNN and the norms and rotary fused, where the engine chose them;
- sampling (`sample`): `sample_rows` on the rows' parameters (gathered by slot) and random counters (their positions);
  the rows that adjust logits count what they drew;
- read-back (`accept`): which output columns a row emits (one; a verify row's kept drafts after it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampler import ALL, Drawn, Passes, sample_rows
from .slots import SlotTable


@dataclass(frozen=True)
class StepChoice:
    """What one step's inputs chose, for that step's forward and read-back."""

    passes: Passes  # the sampler passes the step's rows need (every pass on a captured step)
    verify: object | None = None  # a verify step's logits rows (speculation/verifier.py `Plan`); None: one per row

    @property
    def num_columns(self) -> int | None:
        """Output columns to read back: the verify plan's, or None for one per sampling row."""
        return None if self.verify is None else self.verify.num_columns


PLAIN = StepChoice(ALL)


class StepSampler:
    """Per-row sampling for the model runner: the slot table, the verifier (None: speculation off) and the forward's
    kernel contexts (None: torch's own), all handed in at construction."""

    def __init__(self, table: SlotTable, all_passes: bool, verifier=None,
                 linears: contextlib.AbstractContextManager | None = None,
                 fused: contextlib.AbstractContextManager | None = None) -> None:
        self.table = table
        self.all_passes = all_passes  # a captured step replays one path: it must be the full one
        self.verifier = verifier
        self.linears, self.fused = linears, fused

    # ------------------------------------------------------------------ wiring (upstream's manager)
    def bind(self, stream, on_grow: Callable[[], None]) -> None:
        """The engine's compute stream (None on CPU), and what to do when the slot table grows (the runner drops its
        captured graphs, which read the old table)."""
        self.table.stream = stream
        self.table.on_grow = on_grow

    def forget(self, request_ids: list[str]) -> None:
        """Requests soft reset: their slots go back (a re-admitted one is written again from the tokens it holds)."""
        self.table.forget(request_ids)

    # ------------------------------------------------------------------ inputs
    def prepare(self, requests_in_batch, arg_storage: torch.Tensor) -> StepChoice:
        """Write the sampling rows' slots into the step's argument line; the step's choice."""
        states = [future.state for future in requests_in_batch if future.has_new_token]
        slots = self.table.slots(states)
        passes = ALL if self.all_passes else self.table.passes(slots)
        if passes.constrain and not self.all_passes:  # grammar masks of constrained rows, from the tokens the
            # previous step read back (sync batching only: the worker refuses constrained rows under async batching)
            self.table.constrain(states, slots)
        if passes.adjust and self.table.adjusting:  # rows past these must not count a token for a live request
            arg_storage[0, len(slots):].zero_()
        if slots:  # otherwise rows past these keep older (valid) slots: their samples are never read
            arg_storage[0, : len(slots)] = torch.tensor(slots, dtype=torch.int32).to(arg_storage.device)
        verify = None
        if self.verifier is not None:  # a step with drafts computes and samples more positions than rows
            verify = self.verifier.plan(requests_in_batch, slots, arg_storage.device)
        return StepChoice(passes, verify)

    # ------------------------------------------------------------------ forward and sampling
    def forward_context(self) -> contextlib.ExitStack:
        """The forward's kernels: oneDNN linears and fused norms and rotary, where chosen."""
        stack = contextlib.ExitStack()
        for context in (self.linears, self.fused):
            if context is not None:
                stack.enter_context(context)
        return stack

    def sample(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, step: StepChoice) -> Drawn:
        """logits [rows (+ draft positions), V] fp32; slots and positions of each row's sampled position."""
        rows = self.table.rows(slots[: logits.shape[0]], step.passes)
        drawn = sample_rows(logits, rows, positions, step.passes)
        self.table.count(rows, drawn.tokens)  # penalties count what each row sampled (steps with the adjust pass)
        return drawn

    # ------------------------------------------------------------------ read-back
    def accept(self, step: StepChoice, request_id: str, stops, row: int, tokens: list[int],
               values: list[float]) -> list[int]:
        """The output columns of what sampling row `row` emits: itself, and a verify row's kept drafts after it."""
        if step.verify is None:
            return [row]
        return self.verifier.accept(step.verify, request_id, stops, row, tokens, values)
