"""RolloutManager: transformers' ContinuousBatchingManager, accepting `rollout_paged` (upstream accepts only sdpa,
paged|eager and flash), carrying the rows' slots in place of its logits processors (runner.RowSlotArgs), and marking
its loop thread so that the model's mask creation is skipped there (see `attention.engine_mask`). `trace_steps`, when
set, gets every step's start and end (`trace.TurnTrace`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

from .attention import ENGINE_THREAD, NAME
from .runner import RowSlotArgs


class RolloutManager(ContinuousBatchingManager):
    def __init__(self, model, generation_config, continuous_batching_config, row_slots: RowSlotArgs) -> None:
        super().__init__(model, generation_config, continuous_batching_config)
        self.logit_processor = row_slots  # every batch processor built from here on carries the rows' slots
        self.trace_steps: Callable[[float, float], None] | None = None

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        if model.config._attn_implementation == NAME:
            return
        super().switch_to_cb_friendly_attn(model, auto_switch_to_flash)

    def _run_generation_loop(self, *args, **kwargs):
        ENGINE_THREAD.active = True
        try:
            return super()._run_generation_loop(*args, **kwargs)
        finally:
            ENGINE_THREAD.active = False

    def _generation_step(self) -> None:
        trace = self.trace_steps
        if trace is None:
            return super()._generation_step()
        start = time.perf_counter()
        super()._generation_step()
        trace(start, time.perf_counter())
