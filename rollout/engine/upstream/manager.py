"""RolloutManager: transformers' ContinuousBatchingManager with every engine hook plugged in at construction.

- It accepts `rollout_paged` (upstream accepts only sdpa, paged|eager and flash), carries the rows' slots in place of
  its logits processors (runner.RowSlotArgs), and marks its loop thread so that the model's mask creation is skipped
  there (see `attention.engine_mask`).
- Its batch processor is built at construction (upstream builds it when the loop starts and reuses one built
  before), so that the cache, scheduler, offloading manager, model runner and step buffers can take their hooks
  (`Hooks`) before any step runs.
- `start()` runs the loop on a daemon thread (upstream's is not: a process that never closed its worker would hang
  at exit); `stop()` is upstream's without its two full garbage collections (see `stop`); `submit(state)` queues a
  RequestState the engine built itself (`add_request` cannot carry our request id, children and eos list) and wakes
  the idle loop the way `add_request` does.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus, ContinuousBatchingManager
from transformers.generation.continuous_batching.model_runner import infer_max_single_request_tokens
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestState

from .attention import ENGINE_THREAD, NAME
from .blocktable import RolloutCache
from .preemption import RolloutOffloading
from .processor import RolloutProcessor
from .router import RolloutRouter
from .runner import Record, RolloutIOs, RolloutModelRunner, RowSlotArgs


@dataclass(frozen=True)
class Hooks:
    """What the engine hears from upstream's objects, all on the engine thread:
    - on_output(output): a request finished or failed, or a streamed one progressed (router.py);
    - on_sampled(request_ids, sampling_logprobs, tops): a step's sampled tokens, read back (runner.py);
    - on_prefix_hit(request_id, num_tokens) and on_split(request_id, num_prompt_tokens) (scheduler.py);
    - on_schedule(cache): a step's pages are allocated (the KV peak);
    - on_preempt(request_ids): requests soft reset under KV pressure (preemption.py);
    - on_step(start, end): every step's forward, timed (for a `TurnTrace`)."""

    on_output: Callable[[GenerationOutput], None]
    on_sampled: Record
    on_prefix_hit: Callable[[str, int], None]
    on_split: Callable[[str, int], None]
    on_schedule: Callable[[object], None]
    on_preempt: Callable[[list[str]], None]
    on_step: Callable[[float, float], None]


class RolloutManager(ContinuousBatchingManager):
    def __init__(self, model, generation_config, continuous_batching_config, row_slots: RowSlotArgs,
                 hooks: Hooks) -> None:
        super().__init__(model, generation_config, continuous_batching_config)
        self.logit_processor = row_slots  # every batch processor built from here on carries the rows' slots
        self.trace_steps = hooks.on_step
        self.output_router = RolloutRouter(hooks.on_output)
        processor = self.batch_processor = self._create_batch_processor()  # the loop reuses it
        RolloutCache.adopt(processor.cache)
        scheduler = processor.scheduler
        scheduler.on_prefix_hit, scheduler.on_split = hooks.on_prefix_hit, hooks.on_split
        scheduler.on_schedule = hooks.on_schedule
        scheduler.verifier = row_slots.verifier  # speculative decoding (the engine's Verifier), sync steps only
        RolloutOffloading.adopt(processor.offloading_manager, lambda ids: self._preempted(row_slots, hooks, ids))
        RolloutModelRunner.adopt(processor.model_runner)
        RolloutIOs.adopt(processor.inputs_and_outputs, hooks.on_sampled, row_slots)
        RolloutProcessor.adopt(processor, row_slots.verifier)

    @staticmethod
    def _preempted(row_slots: RowSlotArgs, hooks: Hooks, request_ids: list[str]) -> None:
        """Soft reset requests give their slots back (a re-admitted one is written again from the tokens it holds),
        then the engine hears of them. The slot table lives as long as this manager: nothing else keeps it, so a
        dropped manager (sleep, restart) frees its cache."""
        row_slots.sampling.forget(request_ids)
        hooks.on_preempt(request_ids)

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + completion) the cache can hold."""
        return infer_max_single_request_tokens(self.batch_processor.cache)

    def start(self) -> None:
        """upstream's `start()`, with a daemon thread."""
        self.background_thread_status.clear()
        self._generation_thread = threading.Thread(target=self._run_generation_loop, daemon=True,
                                                   name="rollout-engine")
        self._generation_thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """upstream's `stop()` without its full garbage collections (one here, one in the dropped batch processor's
        `__del__`, see RolloutProcessor), and with the idle loop woken to see the stop at once (it would wait out
        its 0.1 s poll). Each collection walks every object of the process, 0.2-0.3 s once torch and transformers
        are imported, paid at every close, sleep and engine restart. Nothing the engine builds holds the KV cache in
        a reference cycle (tests/test_worker.py pins it with the collector off), so dropping the batch processor
        frees the cache at once. On CUDA one collection stays, then the cached blocks go back to the driver:
        captured graphs are not checked for cycles on this machine. Keeping the manager for a next session (which
        the engine never asks) is upstream's own path."""
        if keep_for_next_session:
            return super().stop(block, timeout, keep_for_next_session, hard_stop)
        if self._generation_thread is None:
            return
        if self.background_thread_status.is_pause_requested(local=True):
            raise RuntimeError("cannot stop the engine loop from inside its pause: it would wait forever. Fix: leave "
                               "the pause first")
        status = BackgroundThreadStatus.HARD_STOP if hard_stop else BackgroundThreadStatus.FLUSH_AND_STOP
        self.background_thread_status.request_stop(status, self.distributed_helper.global_rank)
        self._wake_up_loop.set()
        if block:
            self.join(time.perf_counter(), timeout)
        self.batch_processor = None  # the cache, runner and step buffers go with it
        if self._original_attn_impl is not None:
            self.model.set_attn_implementation(self._original_attn_impl)
            self._original_attn_impl = None
        if self.model.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def has_thread(self) -> bool:
        return self._generation_thread is not None

    def submit(self, state: RequestState) -> None:
        self.input_queue.put(state)
        self._wake_up_loop.set()

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
