"""Engine: one persistent transformers continuous-batching manager, made exact and unkillable.

The engine knows token ids and SamplingParams, nothing about tokenizers or trainers. It
- owns its manager (`upstream.RolloutManager`: built with every hook given at construction, `upstream.Hooks`;
  sized by WorkerConfig, never cached on the model), after `upstream.install()`;
- takes calls asynchronously (`submit`): every accepted sample is tracked until it comes back exactly once (in
  `requests.py`; its logprobs, versions and row parameters in `ledger.py`); a supervisor thread rebuilds the
  manager when the engine thread dies (logged on the "rollout" logger with the error) and re-runs what it lost (up
  to `max_retries` times each), and settles each call once it is over;
- hands an episode's finished turns to its `EpisodeDriver` (driver.py), which steps the environment off the engine
  thread and submits the next turn through the engine;
- fences weight changes: `exclusive(mode)` stops new submissions, then "wait"s for what is in flight, "abort"s it
  (re-run from scratch after the switch), "recompute"s its KV under the new weights, or "keep"s it; the loop is
  paused and the prefix cache forgotten (upstream/switch.py), so no later request reads KV computed with other
  weights, and every sampled token records the version that produced it.
- holds: `hold(mode)` stops the loop until `release()` (what is in flight handled by `mode` first, new submissions
  queue); weight updates may land meanwhile (a server's /pause, /update_weights, /resume);
- sleeps: `sleep()` waits for what is in flight, then stops and drops the manager with its KV cache and step buffers
  (the model's weights stay); `wake()`, or the next `submit`, builds a fresh one (an empty prefix cache, so nothing
  cached before the sleep is reused, whatever the weights did meanwhile).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import traceback

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from ..base.batch import Row
from ..base.config import WorkerConfig, check_in_flight
from ..base.errors import invalid, logged
from ..base.params import SamplingParams
from ..moe import Routing, find_routers
from .device import cuda, sizing
from .kernels import elementwise, onednn, openmp
from .requests.call import Call, Sample
from .observe.counters import Counters
from .episodes.driver import EpisodeDriver
from .sampling.grammar import Grammars
from .requests.ledger import Entry, split_tops
from .observe.recorder import RoutingHole, RoutingRecorder
from .requests.inflight import Requests
from .sampling.sampler import RowSpec
from .sampling.slots import SlotTable
from .speculation.speculator import Speculator
from .sampling.streams import stream_key
from .observe.trace import TurnTrace
from .attention import install
from .sampling.step import StepSampler
from .upstream import (SCHEDULER_NAME, GenerationOutput, Hooks, RequestState, RequestStatus, RolloutManager,
                       RowSlotArgs, TopReader, install_fused, install_linear, kv_pages, switch)

LOG = logging.getLogger("rollout")

# The first word of a random stream's key (streams.py): seeded and unseeded samples never share a stream. A stream's
# counter is the position sampled at, so the turns of an episode (new requests, later positions) never replay it.
SEEDED, UNSEEDED = 1, 2
PAUSE_TRIES = 3  # engines in a row that may die while a pause is asked for before the pause fails
SLOTS_PER_BATCH_ROW = 4  # the slot table's first capacity, per row of a step (it grows when every slot is live)


class Engine:
    def __init__(self, model, config: WorkerConfig, version: int = 0, draft_model=None) -> None:
        install()  # the hooks on transformers this engine relies on (upstream/patches.py), once per process
        self.model = model
        self.config = config.for_device(model.device)  # every size resolved (the device's defaults)
        self.version = version
        self.num_restarts = 0
        self.num_aborted = 0  # samples aborted by weight updates and re-run
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self.num_recomputed = 0  # in-flight requests whose KV a "recompute" switch recomputed
        self._requests = Requests()  # what is in flight: pending samples, re-runs, the ledger, prompt counts
        self._calls: list[Call] = []  # submitted and not settled yet
        self._updating = False
        self._closed = False
        self._held = False  # hold() until release(): the loop stays paused, on every manager built meanwhile
        self._hold = None  # the loop pause hold() entered on the current manager
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
                          self._requests.is_pending,
                          vocab_size=self.model.get_output_embeddings().weight.shape[0])
        table.grammar.grammars = lambda: self.grammars
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
                self._release_loop()  # a held engine stays held: the manager built at wake pauses at once
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
            self._pause_loop()

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
        self._release_loop()  # a paused loop never sees the stop
        manager, self._manager = self._manager, None
        if manager is not None and manager.has_thread():
            manager.stop(block=True, timeout=30)
        self.packs.forget(self.model.parameters())
        self._stop_recording()

    def _restart(self) -> None:
        """Replace a dead manager with a fresh one (fresh cache); what it held is queued for re-running. Logged on
        the "rollout" logger with the error that killed the engine thread."""
        old = self._manager
        error = old.background_thread_status.fatal_error
        LOG.warning("rollout: the engine thread died (%s); rebuilding the engine and re-running its %d requests "
                    "(restart %d)", "no error recorded" if error is None else f"{type(error).__name__}: {error}",
                    len(self._requests.pending), self.num_restarts + 1)
        self._release_loop()  # the dead manager's pause, if held (re-taken on the new one)
        with logged("stopping the dead engine's manager"):
            old.stop(block=True, timeout=30)
        if error is not None:  # its frames hold the dead loop's batch processor: its cache is freed now, not whenever
            traceback.clear_frames(error.__traceback__)  # the cycle collector next runs (a log record may keep it)
        self.num_restarts += 1
        self._manager = self._build_manager()
        self._pause_loop()
        self._requests.lost()

    # ------------------------------------------------------------------ engine-thread callbacks
    def _row_spec(self, request_id: str) -> RowSpec:
        spec = self._requests.ledger.specs.get(request_id)
        if spec is None:  # a forked child: inherits its parent's params, with its own stream key
            sample = self._requests.pending.get(request_id)
            if sample is None:  # abandoned (aborted, timed out) while the engine forks it: output is dropped
                return RowSpec(SamplingParams(temperature=0.0))
            spec = self._make_row_spec(sample)
            self._requests.ledger.specs[request_id] = spec
        return spec

    def _draftable(self, request_id: str) -> bool:
        """May the speculator draft for this request (speculator.py): tracked, its sampling reads no counts of its
        own earlier tokens (penalties, bias, min_new_tokens are counted once per step) and no grammar."""
        if not self._requests.is_pending(request_id):
            return False
        params = self._row_spec(request_id).params
        return not params.adjusts_logits and not params.is_constrained  # a grammar advances once per step

    def _drafted(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verify row's counts, on its sample (engine thread; a forked child's on its own sample); the routing
        recorder keeps the positions of the drafts it accepted."""
        if self._recorder is not None:
            self._recorder.verified(request_id, accepted)
        sample = self._requests.pending.get(request_id)
        if sample is not None:
            sample.draft_tokens += drafted
            sample.accepted_tokens += accepted

    def _make_row_spec(self, sample: Sample) -> RowSpec:
        """A seeded sample's stream is keyed on (seed, sample index), an unseeded one's on (worker seed, call order,
        prompt index, sample index): the tokens depend on nothing else (batch, timing, preemption, restarts)."""
        seed = sample.params.seed
        if seed is not None:
            return RowSpec(sample.params, stream_key(SEEDED, seed, sample.sample_index), sample.stop_ids)
        return RowSpec(sample.params, stream_key(UNSEEDED, self.config.seed, sample.call.index, sample.prompt_index,
                                                 sample.sample_index), sample.stop_ids)

    def _record(self, request_ids: list[str], values: list[float], top: TopReader) -> None:
        # the version changes only inside a pause of the loop, so it is the one whose weights ran this step
        self._requests.ledger.record(request_ids, values, self.version, top)
        self.counters.sampled(len(request_ids))
        trace = self.trace
        if trace is not None:
            trace.sampled(request_ids, time.perf_counter())

    def _trace_step(self, start: float, end: float) -> None:
        trace = self.trace
        if trace is not None:
            trace.step(start, end)

    def _on_output(self, output: GenerationOutput) -> None:
        if output.error is None and output.status != RequestStatus.FINISHED and self._on_progress(output):
            return
        if self._speculator is not None:  # a finished turn feeds the drafts of later samples of its prompt
            finished = output.status == RequestStatus.FINISHED and output.error is None
            self._speculator.done(output.request_id, output.prompt_ids, output.generated_tokens if finished else None)
        with self._cond:
            sample, entry = self._requests.take(output.request_id)
            if sample is None:  # cancelled by an abort fence, or already re-run
                if self._recorder is not None:
                    self._recorder.drop(output.request_id)
                return
            routing, error = self._take_routing(sample, output)
            if output.status == RequestStatus.FINISHED and output.error is None and error is None:
                if sample.episode is None:
                    sample.call.finish(sample, self._make_row(sample, output, entry, routing))
                else:
                    self._turn_done(sample, output, entry, routing)
            else:
                sample.error = output.error or error or f"request ended with status {output.status!r}"
                self._requests.rerun.append(sample)
            self._cond.notify_all()

    def _on_progress(self, output: GenerationOutput) -> bool:
        """A streamed request's tokens so far (engine thread, after each of its steps): handed to its call's
        `on_tokens`. False when the output is not a streamed one's progress (it is then handled as an output)."""
        with self._cond:
            sample = self._requests.pending.get(output.request_id)
            if sample is None or sample.call.on_tokens is None:
                return sample is None  # a cancelled request's last progress is dropped
            ledger = self._requests.ledger
            versions = list(ledger.versions.get(output.request_id, ()))
            tops = list(ledger.tops.get(output.request_id, ())) if sample.params.top_logprobs else None
        tokens, logprobs = output.generated_tokens, output.logprobs
        count = min(len(tokens), len(logprobs), len(versions), len(versions) if tops is None else len(tops))
        sample.call.on_tokens(sample, tokens[:count], logprobs[:count], versions[:count],
                              None if tops is None else tops[:count])
        return True

    def _take_routing(self, sample: Sample, output: GenerationOutput) -> tuple[Routing | None, str | None]:
        """The request's recorded routing for every position it fed (prompt and completion but the last token), or
        why it has a hole (the request then re-runs)."""
        if self._recorder is None:
            return None, None
        if output.status != RequestStatus.FINISHED or output.error is not None:
            self._recorder.drop(output.request_id)
            return None, None
        num_positions = len(sample.context()) + len(output.generated_tokens) - 1
        try:
            experts = self._recorder.take(output.request_id, num_positions)
        except RoutingHole as hole:
            return None, str(hole)
        first = self._routers[0]
        return Routing(tuple(r.name for r in self._routers), first.num_experts, first.top_k, (experts,)), None

    def _make_row(self, sample: Sample, output: GenerationOutput, entry: Entry, routing: Routing | None = None
                  ) -> Row:
        tokens = list(output.generated_tokens)
        _check_logprobs(tokens, output.logprobs, entry)
        finish = "stop" if tokens and tokens[-1] in sample.stop_ids else "length"
        versions = entry.versions[: len(tokens)]
        self.counters.row(finish, versions, self.version)
        top_ids, top_logprobs = split_tops(entry.tops, len(tokens))
        return Row(sample.prompt_index, sample.sample_index, sample.prompt_ids, tokens, list(output.logprobs),
                   entry.sampling[: len(tokens)], finish, min(versions), **sample.counts(),
                   token_versions=versions, routing=routing,
                   top_ids=top_ids, top_logprobs=top_logprobs)

    def _turn_done(self, sample: Sample, output: GenerationOutput, entry: Entry, routing: Routing | None) -> None:
        """A model turn of an episode finished (lock held): the driver records it and steps its environment."""
        tokens = list(output.generated_tokens)
        _check_logprobs(tokens, output.logprobs, entry)
        count = len(tokens)
        self._driver.turn_done(sample, tokens, list(output.logprobs), entry.sampling[:count], entry.versions[:count],
                               None if entry.tops is None else entry.tops[:count], routing)

    def _on_prefix_hit(self, request_id: str, num_tokens: int) -> None:
        with self._cond:
            self._requests.prefix_hit(request_id, num_tokens)

    def _on_preempt(self, request_ids: list[str]) -> None:
        """Requests soft reset under KV pressure (engine thread): counted, and their routing re-recorded at their
        re-prefill."""
        self.counters.preempted(len(request_ids))
        if self._recorder is not None:
            self._recorder.soft_reset(request_ids)

    def _on_split(self, request_id: str, num_tokens: int) -> None:
        with self._cond:
            self._requests.split(request_id, num_tokens)

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
            self._release(call)
            self._cond.notify_all()

    def _supervise(self) -> None:
        """Heal engine deaths and failed requests, and settle calls that are over, whether or not anyone waits."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._requests.rerun) or any(c.is_over() for c in
                                                                                       self._calls), timeout=0.05)
                if self._closed:
                    return
            self._heal()
            self._settle()

    def _settle(self) -> None:
        with self._cond:
            over = [c for c in self._calls if c.is_over()]
            self._calls = [c for c in self._calls if not c.is_over()]
            for call in over:
                self._release(call)  # a failed call's other samples stop too
        for call in over:
            try:
                if call.on_over is not None:
                    call.on_over(call)
            finally:
                call.settle()

    def _submit(self, group: list[Sample], ready: float | None = None) -> None:
        """Submit samples of one prompt as one engine request whose children are the other samples (called with
        the lock held). `ready`: when an episode's observation came back (traced, with a trace set)."""
        head = group[0]
        request_id = f"r{next(self._ids)}"
        context = self._requests.add(request_id, group, self._make_row_spec(head), self.version)
        state = RequestState(request_id=request_id, initial_tokens=list(context), num_children=len(group) - 1,
                             max_new_tokens=head.budget(), eos_token_id=list(head.stop_ids),
                             streaming=head.call.on_tokens is not None)  # upstream delivers every step's progress
        if ready is not None and self.trace is not None:
            self.trace.ready(request_id, ready)
        self._manager.submit(state)

    def _heal(self) -> None:
        """If the engine died or requests failed, rebuild it and re-run the lost samples, each on its own."""
        with self._cond:
            if self._manager is None:  # asleep or closed: nothing in flight
                return
            dead = not self.is_alive()
            if not dead and not self._requests.rerun:
                return
            if dead:
                self._restart()
            for sample in self._requests.take_rerun():
                if sample.row is not None:
                    continue
                if sample.attempts > self.config.max_retries:
                    sample.call.failure = (f"prompt {sample.prompt_index} sample {sample.sample_index} failed "
                                           f"{sample.attempts} times; last error: {sample.error}")
                    continue
                self._submit([sample])
            self._cond.notify_all()

    def _release(self, call: Call) -> None:
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
    @contextlib.contextmanager
    def exclusive(self, mode: str = "wait", invalidate: bool = True):
        """Hold the model alone while the caller changes weights in place: no new submission, the loop paused, and
        what is in flight handled by `mode`:
        - "wait": it finishes first, on the old weights (whole episodes, environment steps included);
        - "abort": it is cancelled, then re-run from scratch (episodes with a fresh environment) after the block;
        - "recompute": it stays; after the block its KV is recomputed by the new weights before it samples again;
        - "keep": it stays and continues on its old-weight KV (tokens after the switch are approximate).
        After the block every prefix-cache hash is forgotten (unless `invalidate` is False, for read-only use)."""
        check_in_flight(mode)
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            if mode == "wait" and self._frozen():
                raise invalid("in_flight", mode, f"the engine is paused with {self._frozen()} requests frozen, "
                              "which would never finish", "pass 'recompute', 'keep' or 'abort', or resume first")
            self._updating = True
        fenced, recomputed = time.perf_counter(), 0
        aborted: list[Sample] = []
        try:
            if mode == "wait":
                self._drain()
            elif mode == "abort":
                aborted = self._abort_in_flight()
            # asleep: no loop to pause and no cached KV to forget (waking builds an empty cache)
            with self._loop_paused():
                paused = time.perf_counter()
                yield
                if self._manager is not None and mode == "recompute":
                    requests, recomputed = switch.recompute_in_flight(self._manager)
                    self.num_recomputed += requests
                if self._manager is not None and invalidate:
                    switch.forget_prefix_cache(self._manager)
                    if self._recorder is not None:
                        with self._cond:
                            self._recorder.forget(set(self._requests.pending))
                            if mode == "recompute":  # every request in flight is prefilled again
                                self._recorder.soft_reset(list(self._recorder.buffers))
            if invalidate:  # a weight change (read-only uses, e.g. scoring, are not counted)
                now = time.perf_counter()
                with self._cond:
                    self.counters.weight_update(mode, now - fenced, now - paused, recomputed)
        finally:
            with self._cond:
                self._updating = False
                self._requests.rerun.extend(aborted)
                for sample in aborted:
                    sample.attempts -= 1  # an abort is not a failure
                self._cond.notify_all()

    @contextlib.contextmanager
    def paused(self):
        """No forward runs inside (a no-op while asleep)."""
        with self._loop_paused():
            yield

    @contextlib.contextmanager
    def _loop_paused(self):
        """The engine's loop paused for the block (nothing to pause while asleep). A dead engine is rebuilt first;
        an engine thread that dies while the pause is asked for (a step raised: upstream then refuses the pause) is
        rebuilt and asked again, so a weight update never fails because an engine step did (what the dead thread
        held re-runs, as after any engine death). Raises only if PAUSE_TRIES engines in a row die that way."""
        with contextlib.ExitStack() as stack:
            for attempt in range(1, PAUSE_TRIES + 1):
                with self._cond:
                    manager = None if self._closed else self._manager
                    if manager is not None and not self.is_alive():
                        self._restart()
                        manager = self._manager
                if manager is None:
                    break
                try:
                    stack.enter_context(manager.pause())
                    break
                except RuntimeError:  # not paused: the loop died meanwhile, or that engine was replaced or put asleep
                    with self._cond:
                        if attempt == PAUSE_TRIES or (self._manager is manager and self.is_alive()):
                            raise
            yield

    # ------------------------------------------------------------------ hold / release (pause / resume)
    @property
    def is_held(self) -> bool:
        return self._held

    def hold(self, mode: str = "keep") -> None:
        """Stop generating until `release()`. What is in flight is handled by `mode` first: "wait" finishes it,
        "abort" cancels it (re-run from scratch after the release), "keep" freezes it where it is (continued after the
        release). Submissions made meanwhile are accepted and queue. Weight updates may land while held, with their
        own in_flight mode ("wait" is refused while frozen work exists: it would never finish). A no-op if held."""
        check_in_flight(mode)
        if mode == "recompute":
            raise invalid("in_flight", mode, "a pause takes 'wait', 'abort' or 'keep'",
                          "pass in_flight='recompute' to the weight update made while paused")
        if self._held:
            return
        with self.exclusive(mode, invalidate=False):
            with self._cond:
                self._held = True
                self._pause_loop()

    def release(self) -> None:
        """Resume generating after `hold()` (a no-op when not held)."""
        with self._cond:
            self._held = False
            self._release_loop()
            self._cond.notify_all()

    def _pause_loop(self) -> None:
        """While held, keep the current manager's loop paused (lock held)."""
        if self._held and self._hold is None and self._manager is not None:
            self._hold = LoopHold(self._manager)

    def _release_loop(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()

    def _frozen(self) -> int:
        """Requests a hold keeps from finishing: waiting for them would never end (lock held)."""
        if not self._held:
            return 0
        return len(self._requests.pending) + len(self._requests.rerun) + len(self._driver.stepping)

    def _drain(self) -> None:
        with self._cond:
            while not self._cond.wait_for(lambda: self._requests.idle() and not self._driver.stepping,
                                          timeout=0.05):
                pass

    def _abort_in_flight(self) -> list[Sample]:
        with self._cond:
            request_ids, aborted = self._requests.take_all()
            aborted += self._driver.abort()
            for request_id in request_ids:
                self._manager.cancel_request(request_id)
            aborted = [s for s in aborted if s.row is None]
            for sample in aborted:
                sample.error = "aborted by a weight update"
                if sample.episode is not None:  # re-run from scratch, with a fresh environment
                    self._driver.reset(sample.episode)
            self.num_aborted += len(aborted)
            return aborted

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

    def forget_prefix_cache(self) -> None:
        """No request submitted from now on can match KV computed before (see switch.py); inside `paused()`."""
        if self._manager is None:  # asleep: waking builds an empty cache
            return
        switch.forget_prefix_cache(self._manager)
        if self._recorder is not None:
            self._recorder.forget()


class LoopHold:
    """A manager's loop kept paused from a thread of its own, until `release()`: upstream counts pauses per thread
    (a thread inside one may not stop the manager), so the thread that takes a pause must be the one that leaves it,
    whichever threads call hold and release."""

    def __init__(self, manager) -> None:
        self._entered, self._done = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(manager,), daemon=True, name="rollout-hold")
        self._thread.start()
        self._entered.wait()
        if self._error is not None:
            raise self._error

    def _run(self, manager) -> None:
        try:
            with manager.pause():
                self._entered.set()
                self._done.wait()
        except BaseException as error:  # noqa: BLE001  (raised by the constructor)
            self._error = error
            self._entered.set()

    def release(self) -> None:
        self._done.set()
        self._thread.join()


def _check_logprobs(tokens: list[int], logprobs: list[float], entry: Entry) -> None:
    tops = len(tokens) if entry.tops is None else len(entry.tops)
    if len(logprobs) != len(tokens) or min(len(entry.sampling), len(entry.versions), tops) < len(tokens):
        raise RuntimeError(f"rollout: {len(tokens)} tokens but {len(logprobs)}/{len(entry.sampling)} logprobs, "
                           f"{len(entry.versions)} versions, {tops} top lists")

