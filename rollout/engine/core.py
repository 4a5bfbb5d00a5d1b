"""Engine: one persistent transformers continuous-batching manager, made exact and unkillable.

The engine knows token ids and SamplingParams, nothing about tokenizers or trainers. It
- owns its `ContinuousBatchingManager` (built once, started once, sized by WorkerConfig, never cached on the model);
- plugs in the hooks of `runner.py` (per-row sampling with both logprobs, the fork fix, one output callback);
- tracks every accepted sample until it comes back exactly once: when the engine thread dies, the manager is rebuilt
  and unfinished samples re-run (up to `max_retries` times each);
- fences weight changes: `exclusive()` stops new work, waits for (or aborts) what is in flight, pauses the loop and
  forgets every prefix-cache hash, so no later token reads KV computed with other weights;
- sleeps: `sleep()` waits for what is in flight, then stops and drops the manager with its KV cache and step buffers
  (the model's weights stay); `wake()`, or the next `run`, builds a fresh one (an empty prefix cache, so nothing
  cached before the sleep is reused, whatever the weights did meanwhile).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.generation.continuous_batching.model_runner import infer_max_single_request_tokens
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestState, RequestStatus

from ..batch import Row
from ..config import WorkerConfig
from ..params import SamplingParams
from . import memory  # noqa: F401  (patches upstream's memory plan for rollout_paged)
from . import cuda, sizing
from .manager import RolloutManager
from .router import RolloutRouter
from .runner import RolloutIOs, RolloutModelRunner, RowSlotArgs
from .sampler import RowSpec
from .slots import SlotTable
from .streams import stream_key
from .scheduler import CHILD_SEPARATOR, SCHEDULER_NAME


@dataclass
class Sample:
    """One requested sample: where it goes in the result, and its outcome."""

    call: "Call | None"
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: tuple[int, ...]
    attempts: int = 0
    version: int = 0
    row: Row | None = None
    error: str | None = None


@dataclass
class Call:
    """The samples of one generate call."""

    samples: list[Sample] = field(default_factory=list)
    failure: str | None = None
    index: int | None = None  # the call's order on its engine: keys the random streams of its unseeded samples

    def __post_init__(self) -> None:
        for sample in self.samples:
            sample.call = self

    def done(self) -> bool:
        return all(s.row is not None for s in self.samples) or self.failure is not None


# The first word of a random stream's key (streams.py): seeded and unseeded samples never share a stream.
SEEDED, UNSEEDED = 1, 2


SLOTS_PER_BATCH_ROW = 4  # the slot table's first capacity, per row of a step (it grows when every slot is live)


def release_memory() -> None:
    """Free what a dropped manager held, now: its objects refer to each other (the runner, its slot table, the
    manager's arguments), so only the cycle collector frees them; then hand cached device blocks back to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Engine:
    def __init__(self, model, config: WorkerConfig, version: int = 0) -> None:
        self.model = model
        self.config = config.for_device(model.device)  # every size resolved (the device's defaults)
        self.version = version
        self.num_restarts = 0
        self.num_aborted = 0  # samples aborted by weight updates and re-run
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._pending: dict[str, Sample] = {}  # engine request id -> sample
        self._rerun: list[Sample] = []  # samples whose engine request failed; re-run by a waiting caller
        self._sampling_logprobs: dict[str, list[float]] = {}
        self._row_specs: dict[str, RowSpec] = {}
        self._updating = False
        self._closed = False
        self._calls = itertools.count()
        self._manager = self._build_manager()

    # ------------------------------------------------------------------ lifecycle
    def _build_manager(self) -> ContinuousBatchingManager:
        gen_config = GenerationConfig(do_sample=False, max_new_tokens=None, eos_token_id=None)
        blocks = sizing.num_blocks(self.config, self.model)
        graphs = cuda.captures(self.model, self.config)
        cb_config = ContinuousBatchingConfig(
            page_size=self.config.page_size, num_blocks=blocks,
            max_batch_tokens=self.config.max_batch_tokens, max_requests_per_batch=self.config.max_requests_per_batch,
            allow_block_sharing=self.config.prefix_caching, use_async_batching=graphs, use_cuda_graph=graphs,
            scheduler_type=SCHEDULER_NAME, return_logprobs=True, auto_switch_to_flash=False,
            max_blocks_per_request=cuda.decode_fast_path_blocks(self.model, self.config, blocks))
        table = SlotTable(self.model.device, SLOTS_PER_BATCH_ROW * self.config.max_requests_per_batch, self._row_spec,
                          lambda request_id: request_id in self._pending)
        was_training = self.model.training
        manager = RolloutManager(self.model, gen_config, cb_config, RowSlotArgs(table, all_passes=graphs))
        manager.output_router = RolloutRouter(self._on_output)
        manager.batch_processor = manager._create_batch_processor()
        RolloutModelRunner.adopt(manager.batch_processor.model_runner)
        RolloutIOs.adopt(manager.batch_processor.inputs_and_outputs, self._record)
        table.stream = manager.batch_processor.inputs_and_outputs.compute_stream
        self.max_request_tokens = infer_max_single_request_tokens(manager.batch_processor.cache)
        self.model.train(was_training)
        sizing.check_request_fits(self.config, self.model, manager.batch_processor.cache.num_blocks,
                                  self.max_request_tokens)  # before the thread starts: nothing to stop
        self._start(manager)
        return manager

    @staticmethod
    def _start(manager: ContinuousBatchingManager) -> None:
        """`manager.start()`, but with a daemon thread: upstream's is not, so a process that never closed its
        worker would hang at exit (Python joins non-daemon threads before running atexit handlers)."""
        manager.background_thread_status.clear()
        manager._generation_thread = threading.Thread(target=manager._run_generation_loop, daemon=True,
                                                      name="rollout-engine")
        manager._generation_thread.start()

    def is_alive(self) -> bool:
        """The engine thread runs and has not failed (False while asleep: there is no thread)."""
        if self._manager is None:
            return False
        status = self._manager.background_thread_status
        return self._manager.is_running() and status.fatal_error is None

    @property
    def is_sleeping(self) -> bool:
        return self._manager is None and not self._closed

    def sleep(self) -> None:
        """Wait for in-flight work, then stop the manager and drop it: its KV cache, step buffers and CUDA graphs are
        freed (returned to the device with `empty_cache`); the model's weights stay. A no-op when asleep."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._updating = True
        try:
            self._drain(abort_in_flight=False)
            with self._cond:
                manager, self._manager = self._manager, None
            if manager is not None:
                manager.stop(block=True, timeout=30)  # joins the thread, drops the batch processor
                del manager
                release_memory()
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()

    def wake(self) -> None:
        """Build a fresh manager (cache and buffers re-allocated, sized again) if asleep; a no-op otherwise."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._wake_locked()

    def _wake_locked(self) -> None:
        if self._manager is None and not self._closed:
            self._manager = self._build_manager()

    def close(self) -> None:
        self._closed = True
        manager, self._manager = self._manager, None
        if manager is not None and manager._generation_thread is not None:
            manager.stop(block=True, timeout=30)

    def _restart(self) -> None:
        """Replace a dead manager with a fresh one (fresh cache); what it held is queued for re-running."""
        old = self._manager
        with contextlib.suppress(Exception):
            old.stop(block=True, timeout=30)
        self.num_restarts += 1
        self._manager = self._build_manager()
        self._rerun.extend(self._pending.values())
        self._pending.clear()
        self._sampling_logprobs.clear()
        self._row_specs.clear()

    # ------------------------------------------------------------------ engine-thread callbacks
    def _row_spec(self, request_id: str) -> RowSpec:
        sampler = self._row_specs.get(request_id)
        if sampler is None:  # a forked child: inherits its parent's params, its own generator if seeded
            sample = self._pending.get(request_id)
            if sample is None:  # abandoned (aborted, timed out) while the engine forks it: output is dropped
                return RowSpec(SamplingParams(temperature=0.0))
            sampler = self._make_row_spec(sample)
            self._row_specs[request_id] = sampler
        return sampler

    def _make_row_spec(self, sample: Sample) -> RowSpec:
        """A seeded sample's stream is keyed on (seed, sample index), an unseeded one's on (worker seed, call order,
        prompt index, sample index): the tokens depend on nothing else (batch, timing, preemption, restarts)."""
        seed = sample.params.seed
        if seed is not None:
            return RowSpec(sample.params, stream_key(SEEDED, seed, sample.sample_index))
        return RowSpec(sample.params, stream_key(UNSEEDED, self.config.seed, sample.call.index, sample.prompt_index,
                                                 sample.sample_index))

    def _record(self, request_ids: list[str], values: list[float]) -> None:
        for request_id, value in zip(request_ids, values):
            self._sampling_logprobs.setdefault(request_id, []).append(value)

    def _on_output(self, output: GenerationOutput) -> None:
        with self._cond:
            sample = self._pending.pop(output.request_id, None)
            sampling = self._sampling_logprobs.pop(output.request_id, [])
            self._row_specs.pop(output.request_id, None)
            if sample is None:  # cancelled by an abort fence, or already re-run
                return
            if output.status == RequestStatus.FINISHED and output.error is None:
                sample.row = self._make_row(sample, output, sampling)
            else:
                sample.error = output.error or f"request ended with status {output.status!r}"
                self._rerun.append(sample)
            self._cond.notify_all()

    def _make_row(self, sample: Sample, output: GenerationOutput, sampling: list[float]) -> Row:
        tokens = list(output.generated_tokens)
        if len(output.logprobs) != len(tokens) or len(sampling) < len(tokens):
            raise RuntimeError(f"rollout: {len(tokens)} tokens but {len(output.logprobs)}/{len(sampling)} logprobs")
        finish = "stop" if tokens and tokens[-1] in sample.stop_ids else "length"
        return Row(sample.prompt_index, sample.sample_index, sample.prompt_ids, tokens, list(output.logprobs),
                   sampling[: len(tokens)], finish, sample.version)

    # ------------------------------------------------------------------ submission and waiting
    def run(self, samples_by_prompt: list[list[Sample]], call: Call, timeout: float | None = None) -> Call:
        """Submit every sample of a call, wait until each has a row, re-running what an engine death lost."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._wake_locked()  # a sleeping engine wakes for work
            if call.index is None:
                call.index = next(self._calls)
            for group in samples_by_prompt:
                self._submit(group)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not call.done():
                self._heal()
                with self._cond:
                    self._cond.wait_for(call.done, timeout=0.05)
                if deadline is not None and time.monotonic() > deadline and not call.done():
                    done = sum(s.row is not None for s in call.samples)
                    raise TimeoutError(f"generate timed out after {timeout}s with {done}/{len(call.samples)} rows "
                                       "done")
        except BaseException:  # timeout, Ctrl-C, ...: nothing of this call keeps running in the engine
            self.abort_call(call)
            raise
        if call.failure is not None:
            raise RuntimeError(call.failure)
        return call

    def _submit(self, group: list[Sample]) -> None:
        """Submit samples of one prompt as one engine request whose children are the other samples (called with
        the lock held)."""
        head = group[0]
        request_id = f"r{next(self._ids)}"
        for i, sample in enumerate(group):
            sample.version = self.version
            sample.attempts += 1
            self._pending[request_id if i == 0 else f"{request_id}{CHILD_SEPARATOR}{i - 1}"] = sample
        self._row_specs[request_id] = self._make_row_spec(head)
        state = RequestState(request_id=request_id, initial_tokens=list(head.prompt_ids), num_children=len(group) - 1,
                             max_new_tokens=head.params.max_new_tokens, eos_token_id=list(head.stop_ids))
        self._manager.input_queue.put(state)
        self._manager._wake_up_loop.set()

    def _heal(self) -> None:
        """If the engine died or requests failed, rebuild it and re-run the lost samples, each on its own."""
        with self._cond:
            if self._manager is None:  # asleep or closed: nothing in flight
                return
            dead = not self.is_alive()
            if not dead and not self._rerun:
                return
            if dead:
                self._restart()
            rerun, self._rerun = self._rerun, []
            for sample in rerun:
                if sample.row is not None:
                    continue
                if sample.attempts > self.config.max_retries:
                    sample.call.failure = (f"prompt {sample.prompt_index} sample {sample.sample_index} failed "
                                           f"{sample.attempts} times; last error: {sample.error}")
                    continue
                self._submit([sample])
            self._cond.notify_all()

    def abort_call(self, call: Call) -> None:
        """Cancel whatever of the call is still in the engine, and drop its pending re-runs."""
        with self._cond:
            self._rerun = [s for s in self._rerun if s.call is not call]
            for request_id, sample in list(self._pending.items()):
                if sample.call is call:
                    self._pending.pop(request_id)
                    self._manager.cancel_request(request_id)

    # ------------------------------------------------------------------ weight-change fence
    @contextlib.contextmanager
    def exclusive(self, abort_in_flight: bool, invalidate: bool = True):
        """Hold the model alone: no new submission; in-flight work finished (or aborted, then re-run after the
        block); loop paused; every prefix-cache hash forgotten (unless `invalidate` is False, for read-only use).
        Inside, the caller may change weights in place."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._updating = True
        aborted: list[Sample] = []
        try:
            aborted = self._drain(abort_in_flight)
            with self._cond:
                if self._manager is not None and not self.is_alive():
                    self._restart()
            # asleep: no loop to pause and no cached KV to forget (waking builds an empty cache)
            with self._manager.pause() if self._manager is not None else contextlib.nullcontext():
                if invalidate and self._manager is not None:
                    self.forget_prefix_cache()
                yield
        finally:
            with self._cond:
                self._updating = False
                self._rerun.extend(aborted)
                for sample in aborted:
                    sample.attempts -= 1  # an abort is not a failure
                self._cond.notify_all()

    def _drain(self, abort_in_flight: bool) -> list[Sample]:
        if not abort_in_flight:
            while True:
                self._heal()
                with self._cond:
                    if self._cond.wait_for(lambda: not self._pending and not self._rerun, timeout=0.05):
                        return []
        with self._cond:
            aborted = list(self._pending.values()) + self._rerun
            for request_id in self._pending:
                self._manager.cancel_request(request_id)
            self._pending.clear()
            self._rerun = []
            aborted = [s for s in aborted if s.row is None]
            for sample in aborted:
                sample.error = "aborted by a weight update"
            self.num_aborted += len(aborted)
            return aborted

    def forget_prefix_cache(self) -> None:
        """Evict cached blocks and drop every content hash, so no request can match KV from older weights."""
        cache = self._manager.batch_processor.cache
        cache.evict_cached_blocks()
        for allocator in cache.cache_allocators.values():
            allocator.ledger.hash_to_block.clear()
            allocator.ledger.block_to_hash.clear()
