"""Engine: one persistent transformers continuous-batching manager, made exact and unkillable.

The engine knows token ids and SamplingParams, nothing about tokenizers or trainers. `Engine` is this module's
lifecycle and submission, with three parts mixed in, one module each:
- lifecycle (here): it owns its manager (`upstream.RolloutManager`: built with every hook given at construction,
  `upstream.Hooks`; sized by WorkerConfig, never cached on the model), after `attention.install()`; `sleep()` waits
  for what is in flight, then stops and drops the manager with its KV cache and step buffers (the model's weights
  stay); `wake()`, or the next `submit`, builds a fresh one (an empty prefix cache, so nothing cached before the
  sleep is reused, whatever the weights did meanwhile);
- submission (here): calls are taken asynchronously (`submit`); every accepted sample is tracked until it comes back
  exactly once (requests/: its logprobs, versions and row parameters in the ledger); `in_flight()` and `manager`
  are what tests and metrics read of it;
- delivery (delivery.py): the engine-thread callbacks that record each sampled token and turn each finished request
  into its row, or hand an episode's finished turn to its `EpisodeDriver` (episodes/driver.py), which steps the
  environment off the engine thread and submits the next turn through the engine;
- the supervisor (supervisor.py): a thread that rebuilds the manager when the engine thread dies (logged on the
  "rollout" logger with the error), re-runs what it lost (up to `max_retries` times each), and settles each call
  once it is over;
- the weight fence (fence.py): `exclusive(mode)` stops new submissions, then "wait"s for what is in flight,
  "abort"s it (re-run from scratch after the switch), "recompute"s its KV under the new weights, or "keep"s it; the
  loop is paused and the prefix cache forgotten, so no later request reads KV computed with other weights, and every
  sampled token records the version that produced it; `hold(mode)` / `release()` keep the loop stopped across
  weight updates (a server's /pause, /update_weights, /resume).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from ..base.config import WorkerConfig
from ..moe import find_routers
from .attention import install
from .delivery import Delivery
from .device import cuda, sizing
from .episodes.driver import EpisodeDriver
from .fence import WeightFence
from .kernels import elementwise, onednn, openmp
from .observe.counters import Counters
from .observe.recorder import RoutingRecorder
from .observe.trace import TurnTrace
from .requests.call import Call, Sample
from .requests.inflight import Requests
from .sampling.grammar import Grammars
from .sampling.slots import SlotTable
from .sampling.step import StepSampler
from .speculation.speculator import SpeculationCounts, Speculator
from .supervisor import Supervisor
from .upstream import (SCHEDULER_NAME, Hooks, RequestState, RolloutManager, RowSlotArgs, install_fused,
                       install_linear, kv_pages)

LOG = logging.getLogger("rollout")

SLOTS_PER_BATCH_ROW = 4  # the slot table's first capacity, per row of a step (it grows when every slot is live)


@dataclass(frozen=True)
class InFlight:
    """What an engine holds at one moment (read under its lock): the inspection API tests and metrics use."""

    requests: dict[str, int]  # engine requests in flight -> tokens sampled for each so far
    reruns: int  # samples waiting to be submitted again (a failed or aborted request's)
    calls: int  # calls submitted and not settled yet
    ledger_entries: int  # requests with bookkeeping (row spec, logprobs, versions) still kept
    episodes_stepping: int  # episodes whose environment step is running
    routing_buffers: int  # requests whose MoE routing is being recorded (0 when not recording)
    next_request: int  # the number the next engine request's id gets ("r<n>")

    @property
    def is_empty(self) -> bool:
        """Nothing left: no request, re-run, call, bookkeeping, environment step or routing buffer."""
        return not (self.requests or self.reruns or self.calls or self.ledger_entries or self.episodes_stepping
                    or self.routing_buffers)


class Engine(Delivery, Supervisor, WeightFence):
    def __init__(self, model, config: WorkerConfig, version: int = 0, draft_model=None) -> None:
        install()  # the hooks on transformers this engine relies on (upstream/patches.py), once per process
        self.model = model
        self.config = config.for_device(model.device)  # every size resolved (the device's defaults)
        self.version = version
        self.num_restarts = 0
        self.num_aborted = 0  # samples aborted by weight updates and re-run
        self._cond = threading.Condition()
        self._next_request = 0  # the next engine request's id number
        self.num_recomputed = 0  # in-flight requests whose KV a "recompute" switch recomputed
        self._requests = Requests()  # what is in flight: pending samples, re-runs, the ledger, prompt counts
        self._calls: list[Call] = []  # submitted and not settled yet
        self._updating = False
        self._closed = False
        self._on_hold = False  # hold() until release(): the loop stays paused, on every manager built meanwhile
        self._loop_pause = None  # the loop pause hold() entered on the current manager
        self.counters = Counters()  # the rest of what metrics() reports; kept across restarts and sleeps
        self._driver = EpisodeDriver(self._cond, self.counters, config.env_threads, self._submit,
                                     lambda: self.version)
        self._call_index = itertools.count()  # keys the random streams of a call's unseeded samples
        self.trace: TurnTrace | None = None  # set one to time episodes' turns (trace.py); None records nothing
        # the MoE routers whose choices are recorded (WorkerConfig.record_routing; an unknown router fails here)
        self._routers = find_routers(model) if self.config.record_routing else None
        self.grammars: Grammars | None = None  # the worker's grammar compiler, once it submits a constrained row
        self.captures = False  # the manager captures CUDA graphs and batches asynchronously (no constrained rows)
        self._recorder: RoutingRecorder | None = None
        # None: speculation off; draft_model: the "model" source's DraftModel (the worker loads and checks it)
        self._speculator = Speculator.of(self.config, self._draftable, self._drafted, draft_model, self._row_spec)
        # the kernels of the forward's fp32 linears, named as in WorkerConfig.cpu_linear (onednn.py), chosen once
        self.linears = "onednn" if onednn.choose(self.config.cpu_linear, self.model) else "blas"
        self.packs = onednn.PackedWeights()  # this engine's weights packed for oneDNN (none with "blas")
        if self.linears == "onednn":
            install_linear(onednn.FLAG, onednn.linear)
        self._manager = self._build_manager()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True, name="rollout-supervisor")
        self._supervisor.start()

    # ------------------------------------------------------------------ lifecycle
    def _build_manager(self) -> RolloutManager:
        gen_config = GenerationConfig(do_sample=False, max_new_tokens=None, eos_token_id=None)
        blocks = sizing.num_blocks(self.config, self.model)
        # a replayed graph runs no hooks; a verify step needs the previous step's acceptance (sync steps)
        graphs = cuda.captures(self.model, self.config) and self._routers is None and self._speculator is None
        self.captures = graphs
        cb_config = ContinuousBatchingConfig(
            page_size=self.config.page_size, num_blocks=blocks,
            max_batch_tokens=self.config.max_batch_tokens, max_requests_per_batch=self.config.max_requests_per_batch,
            allow_block_sharing=self.config.prefix_caching, use_async_batching=graphs, use_cuda_graph=graphs,
            scheduler_type=SCHEDULER_NAME, return_logprobs=True, auto_switch_to_flash=False,
            max_blocks_per_request=sizing.block_table_width(self.model, self.config, blocks))
        table = SlotTable(self.model.device, SLOTS_PER_BATCH_ROW * self.config.max_requests_per_batch, self._row_spec,
                          self._requests.is_pending, vocab_size=self.model.get_output_embeddings().weight.shape[0],
                          grammars=lambda: self.grammars)
        hooks = Hooks(on_output=self._on_output, on_sampled=self._record, on_prefix_hit=self._on_prefix_hit,
                      on_split=self._on_split, on_schedule=self.counters.kv_step, on_preempt=self._on_preempt,
                      on_step=self._trace_step)
        was_training = self.model.training
        verifier = self._speculator.verifier() if self._speculator is not None else None
        linears = onednn.OneDNNLinears(self.packs) if self.linears == "onednn" else None
        sampling = StepSampler(table, graphs, verifier, linears, self._fused())
        manager = RolloutManager(self.model, gen_config, cb_config, RowSlotArgs(sampling, verifier), hooks)
        self.max_request_tokens = manager.max_request_tokens
        self.model.train(was_training)
        self._record_routing(manager)
        sizing.check_request_fits(self.config, self.model, manager.batch_processor.cache.num_blocks,
                                  self.max_request_tokens)  # before the thread starts: nothing to stop
        manager.start()
        return manager

    def _fused(self) -> elementwise.Fused | None:
        """The forward's norms and rotary on the fused kernels (elementwise.py), where the model has Llama-exact ones
        on a CPU whose kernels give torch's bits; None keeps torch's ops."""
        if self.model.device.type != "cpu" or elementwise.load() is None:
            return None
        # the patched forwards look the kernels up at each call (a spy or a reloaded module is seen)
        found = install_fused(self.model, elementwise.FLAG, lambda *a: elementwise.rms_norm(*a),
                              lambda *a: elementwise.rotary(*a))
        return elementwise.Fused() if found else None

    def _record_routing(self, manager: RolloutManager) -> None:
        """A fresh recorder for this manager (the previous one's hooks removed), when recording routing."""
        self._stop_recording()
        if self._routers is not None:
            processor = manager.batch_processor
            # the prefix index keeps the routing of up to twice the cache's tokens (a few bytes per token)
            self._recorder = RoutingRecorder(self.model, self._routers, self.config.page_size,
                                             2 * processor.cache.num_blocks * self.config.page_size)
            self._recorder.attach(processor.cache, processor.inputs_and_outputs, processor.scheduler.verifier)

    def _stop_recording(self) -> None:
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None

    @property
    def num_prompt_tokens(self) -> int:
        """Every engine request's prompt tokens so far (a re-run or an episode's next turn counts again)."""
        return self._requests.prompt_tokens

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
            if self._frozen():
                raise RuntimeError(f"cannot sleep: the engine is paused with {self._frozen()} requests frozen, "
                                   "which would never finish. Fix: resume first")
            self._updating = True
        try:
            self._drain()
            with self._cond:
                self._unpause_loop()  # a held engine stays held: the manager built at wake pauses at once
                manager, self._manager = self._manager, None
            if manager is not None:
                manager.stop(block=True, timeout=30)  # joins the thread, frees the batch processor and its cache
                self.packs.forget(self.model.parameters())  # packed weights go back too
                self.counters.slept()
                del manager
                self._stop_recording()
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
            self._keep_loop_paused()

    def weights_changed(self) -> None:
        """The model's weights were written in place (an update, a refresh, an adapter merge or unmerge): what the
        engine keeps derived from them (oneDNN's packed copies) is rebuilt at its next use."""
        self.packs.weights_changed()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._driver.stop()
            self._cond.notify_all()
        self._supervisor.join(timeout=30)
        self._driver.shutdown()
        self._unpause_loop()  # a paused loop never sees the stop
        manager, self._manager = self._manager, None
        if manager is not None and manager.has_thread():
            manager.stop(block=True, timeout=30)
        self.packs.forget(self.model.parameters())
        self._stop_recording()

    # ------------------------------------------------------------------ submission and waiting
    def submit(self, samples_by_prompt: list[list[Sample]], call: Call) -> None:
        """Accept a call: every sample is submitted now (after any weight switch in progress); the call settles on
        the supervisor thread once it is over (`call.settled`). The caller's idle OpenMP workers are let go, so the
        engine thread's parallel ops are not throttled (openmp.py)."""
        openmp.release_callers_pool()
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._wake_locked()  # a sleeping engine wakes for work
            if self.linears == "onednn":
                self.packs.check()  # weights changed without a refresh are packed again
            if call.index is None:
                call.index = next(self._call_index)
            self._calls.append(call)
            for group in samples_by_prompt:
                self._submit(group)
            self._cond.notify_all()

    def cancel(self, call: Call) -> None:
        """Cancel what is left of a call (nothing of it keeps running) and settle it."""
        with self._cond:
            if not call.cancelled and not call.is_over():
                call.discarded_tokens = self._requests.sampled_tokens(call, self._requests.of_call(call))
            call.cancelled = True
            self._drop_call(call)
            self._cond.notify_all()

    def _submit(self, group: list[Sample], ready: float | None = None) -> None:
        """Submit samples of one prompt as one engine request whose children are the other samples (called with
        the lock held). `ready`: when an episode's observation came back (traced, with a trace set)."""
        head = group[0]
        request_id = f"r{self._next_request}"
        self._next_request += 1
        context = self._requests.add(request_id, group, self._make_row_spec(head), self.version)
        state = RequestState(request_id=request_id, initial_tokens=list(context), num_children=len(group) - 1,
                             max_new_tokens=head.budget(), eos_token_id=list(head.stop_ids),
                             streaming=head.call.on_tokens is not None)  # upstream delivers every step's progress
        if ready is not None and self.trace is not None:
            self.trace.ready(request_id, ready)
        self._manager.submit(state)

    def _drop_call(self, call: Call) -> None:
        """Cancel whatever of the call is still in the engine and release all it held there: pending re-runs,
        environment steps' outcomes (its episodes' environments are closed) and per-request bookkeeping (lock
        held)."""
        for sample in call.samples:
            self._driver.abandon(sample)
        for request_id in self._requests.release(call):
            self._manager.cancel_request(request_id)
            if self._recorder is not None:
                self._recorder.drop(request_id)

    # ------------------------------------------------------------------ weight-change fence
    def metrics(self) -> tuple[Counters, dict[str, int]]:
        """A copy of the counters; the engine's own counts (prompt and reused tokens, restarts, aborts, recomputed
        requests) and what it holds now: version, requests waiting (submitted, not yet scheduled) and running,
        episodes in an environment step, KV pages (total, used, cached; all 0 while asleep)."""
        with self._cond:
            counters, manager = self.counters.copy(), self._manager
            now = dict(prompt_tokens=self._requests.prompt_tokens,
                       prefix_cache_reused_tokens=self._requests.reused_tokens,
                       engine_restarts=self.num_restarts, aborted_samples=self.num_aborted,
                       recomputed_requests=self.num_recomputed, policy_version=self.version,
                       sleeping=int(self.is_sleeping), episodes_in_env_step=len(self._driver.stepping),
                       requests_waiting=0, requests_running=0, kv_pages_total=0, kv_pages_used=0, kv_pages_cached=0)
            if self._speculator is not None:
                now.update(self._speculator.metrics())
        processor = getattr(manager, "batch_processor", None)
        if processor is not None:  # read without stopping the loop: a page count may be a step old
            scheduler = processor.scheduler
            now["requests_waiting"] = manager.input_queue.qsize() + len(scheduler.waiting_requests)
            now["requests_running"] = len(scheduler.active_requests)
            total, used, cached = kv_pages(processor.cache)
            now.update(kv_pages_total=total, kv_pages_used=min(max(used, 0), total), kv_pages_cached=cached)
        return counters, now

    # ------------------------------------------------------------------ inspection
    def in_flight(self) -> InFlight:
        """What the engine holds now (see `InFlight`)."""
        with self._cond:
            ledger = self._requests.ledger
            return InFlight(requests={r: len(ledger.versions.get(r, ())) for r in self._requests.pending},
                            reruns=len(self._requests.rerun), calls=len(self._calls), ledger_entries=len(ledger),
                            episodes_stepping=len(self._driver.stepping),
                            routing_buffers=0 if self._recorder is None else len(self._recorder.buffers),
                            next_request=self._next_request)

    @property
    def manager(self) -> RolloutManager | None:
        """The upstream manager running now (None while asleep or closed): its batch processor holds the cache,
        scheduler and step buffers. Read-only use: the engine rebuilds it after a death or a sleep."""
        return self._manager

    @property
    def speculation(self) -> SpeculationCounts | None:
        """Speculation's running counts (drafted, accepted, rolled back, verify rows); None with speculation off."""
        return None if self._speculator is None else self._speculator.counts

