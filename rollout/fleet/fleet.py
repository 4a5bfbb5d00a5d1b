"""RolloutFleet: RolloutWorker's API on a pool of Ray actors (the package's only Ray import).

    with RolloutFleet(model_path, num_workers=2, config=WorkerConfig(...)) as fleet:
        batch = fleet.generate(prompts, sampling=SamplingParams(n=8))   # same rows, same order as a worker
        fleet.update_weights(state_dict, version=step)

Contract:
- Requests and updates are validated here, on the caller's side, with the worker's own checks (score's pairs with
  rollout.scoring's; against a meta-device copy of the model: names and shapes, no memory), before any actor is
  touched: a bad request is the worker's InvalidArgument, with the call's own `index`.
- generate spreads prompts by outstanding token load (dispatch.py); the n samples of a prompt stay on one actor;
  rows come back prompt-major with global prompt_index, as one RolloutWorker returns them. With speculation's
  "history" drafts, a prompt goes to the actor that ran it last where the load allows (homes.py).
- An actor that dies is replaced: its unfinished prompts run on the others meanwhile; the replacement is brought to
  the fleet's weights and version (the retained update, or a live peer's state dict) and checked by fingerprint
  before it takes work. A call that passes `timeout` raises TimeoutError naming the actors still holding work, and
  those actors are replaced.
- update_weights sends the tensors once through the fleet's weight transport (transport.py: the object store by
  default, a torch.distributed group after init_weight_group, which actors apply bucket by bucket); every actor
  applies them under its fence and the update's in_flight mode; versions are compared before it returns, and
  fingerprints too (every update, or every `verify_every`-th: each costs every actor a checksum of its weights on its
  device, rollout.model.weights.fingerprint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

import torch

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("RolloutFleet needs Ray. Fix: pip install 'rollout[ray]'.") from exc

from ..base.batch import RolloutBatch
from ..base.config import WorkerConfig, check_in_flight
from ..base.env import EnvFactory, EpisodeSpec
from ..base.errors import check_int, invalid, logged
from ..base.rollouts import model_name, request_limit
from ..metrics.snapshot import FleetMetrics
from ..model.loading import pad_token_id
from ..model.weights import check_version, plan_update, resolve_names
from ..moe import Routing
from ..worker.validation import prepare_call
from .actor import FleetActor, InMemoryModel, model_source, with_adapters
from .dispatch import Dispatcher
from .future import CallCancel, FleetFuture, Groups
from .homes import Homes
from .meter import FleetMeter
from .resources import FleetResources
from .transport import Collective, ObjectStore, TransportFailed, WeightTransport

POLL_S = 0.1  # how often a call waiting for actors checks for cancellation
MAX_CALLS = 16  # submitted calls running at once (more wait); each actor runs that many generates side by side
MAX_START_FAILURES = 3  # consecutive failed starts of one actor before the fleet gives up
LOG = logging.getLogger("rollout")

# Actor k's engine seed is the config's seed + ACTOR_SEED_STRIDE * k, where k = slot + num_workers * (restarts of that
# slot): every actor ever started draws its unseeded rows from its own stream, and fleets whose config seeds differ by
# less than the stride (0, 1, 2, ...) never share one. (7919 is the 1000th prime; any stride above the seeds in use
# would do.)
ACTOR_SEED_STRIDE = 7919
# "weights": an update runs beside a generate in flight (its in_flight mode decides what happens to it)
_Actor = ray.remote(concurrency_groups={"control": 2, "weights": 1})(FleetActor)


class RolloutFleet:
    def __init__(self, model: Any, num_workers: int = 2, config: WorkerConfig | None = None,
                 resources: FleetResources | dict | None = None, tokenizer: Any = None, chunks_per_worker: int = 1,
                 startup_timeout_s: float = 600, ray_init: dict | None = None, verify_every: int = 1) -> None:
        check_int("num_workers", num_workers, 1, "use e.g. one per GPU")
        check_int("verify_every", verify_every, 1,
                  "use 1 to compare the actors' fingerprints after every update, k for every k-th")
        self.verify_every, self._num_updates = verify_every, 0
        self.config = config if config is not None else WorkerConfig()
        check_int("chunks_per_worker", chunks_per_worker, 1,
                  "use 1 (default: biggest engine batches) or more to rebalance uneven actors")
        self.num_workers, self.chunks_per_worker = num_workers, chunks_per_worker
        self.startup_timeout_s = startup_timeout_s
        self.resources = FleetResources.of(resources)
        source, model_config, self.tokenizer = model_source(model, tokenizer)
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # names and shapes only: validates updates without holding weights
            self._shapes = with_adapters(AutoModelForCausalLM.from_config(model_config), source)
        self._state_names = set(self._shapes.state_dict())
        self.vocab_size = int(self._shapes.get_output_embeddings().weight.shape[0])
        self.max_context = getattr(model_config.get_text_config(), "max_position_embeddings", None)
        self.model_name = model_name(model_config.name_or_path)
        self.supports_streaming = False  # rows arrive as their group finishes (as_completed)
        self._lock = threading.RLock()  # fleet state; never held across a wait for actors' results
        self._calls = ThreadPoolExecutor(MAX_CALLS, thread_name_prefix="rollout-fleet")  # submitted calls
        self._call_ids = itertools.count()  # what an actor cancels a call's work by
        self._actors, self._starting, self._down, self._pg = [], {}, set(), None
        self._overdue: deque[tuple[int, Any, str]] = deque()  # (slot, actor, why): replace when a call next starts
        self._meter, self._metrics_server = FleetMeter(), None
        self._homes = Homes(self.config)  # which actor holds each prompt's history (speculation), if any
        self._transport: WeightTransport = ObjectStore()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(**{"include_dashboard": False, **(ray_init or {})})
        try:
            self._start(source, tokenizer)
        except BaseException:
            self.close()
            raise
        self.max_request_tokens = min(info["max_request_tokens"] for info in self._info)
        self.default_stop_ids = tuple(self._info[0]["default_stop_ids"])  # the actors' workers' own (same model)

    # ------------------------------------------------------------------ public surface
    @property
    def actors(self) -> list:
        return list(self._actors)

    @property
    def policy_version(self) -> int:
        return self.version

    def generate(self, prompts: Sequence[Any], sampling=None, chat_template: bool = False,
                 timeout: float | None = None, env: EnvFactory | None = None, max_turns: int = 1,
                 max_episode_tokens: int | None = None, env_timeout: float | None = 300.0, *,
                 episode: EpisodeSpec | None = None) -> RolloutBatch:
        """RolloutWorker.generate across the fleet: validated here, rows prompt-major in input order. `env` travels
        to the actors (it must pickle) and is called there with the call's own prompt indices."""
        future = self.submit(prompts, sampling, chat_template, env, max_turns, max_episode_tokens, env_timeout,
                             timeout=timeout, episode=episode)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def submit(self, prompts: Sequence[Any], sampling=None, chat_template: bool = False,
               env: EnvFactory | None = None, max_turns: int = 1, max_episode_tokens: int | None = None,
               env_timeout: float | None = 300.0, *, episode: EpisodeSpec | None = None,
               timeout: float | None = None) -> FleetFuture:
        """Validate here, then run the call in the background and return at once. Up to MAX_CALLS calls run side by
        side (more wait their turn), each actor's engine batching them together; `update_weights` may run while they
        are in flight (each actor applies it under the chosen in_flight mode). `as_completed()` on the future streams
        each prompt's group as it finishes."""
        spec = EpisodeSpec.of(env, max_turns, max_episode_tokens, env_timeout, episode)
        token_lists, params = prepare_call(prompts, sampling, self.tokenizer, chat_template, self.vocab_size,
                                           self.max_context, self.max_request_tokens)
        limit = request_limit(self.max_context, self.max_request_tokens)
        budgets = [p.max_new_tokens if spec is None else spec.budget(len(ids), limit, i)
                   for i, (ids, p) in enumerate(zip(token_lists, params))]
        cancel, groups = CallCancel(lambda refs, timeout: ray.get(refs, timeout=timeout)), Groups(len(token_lists))
        began = time.monotonic()  # a call queued behind MAX_CALLS others counts that wait
        future = self._calls.submit(self._run_call, token_lists, params, budgets, spec, timeout, cancel, groups, began)
        future.add_done_callback(lambda _: groups.close())
        return FleetFuture(future, cancel, groups, None if timeout is None else began + timeout, timeout)

    def _run_call(self, token_lists, params, budgets, spec: EpisodeSpec | None, timeout: float | None,
                  cancel: CallCancel, groups: Groups, began: float) -> RolloutBatch:
        costs = [len(ids) + p.n * min(b, p.max_new_tokens * (1 if spec is None else spec.max_turns))
                 for ids, p, b in zip(token_lists, params, budgets)]
        call_id = next(self._call_ids)

        def submit(actor, jobs: list[int]):  # a streaming generator: one (chunk index, rows) per finished prompt
            return actor.generate.remote([token_lists[j] for j in jobs], [params[j] for j in jobs], spec, jobs,
                                         call_id)

        tokens_by_slot: dict[int, int] = {}  # what each actor was given (prompt and completion tokens)

        def rows_of(j: int, rows: list) -> list:  # an episode's first segment gets its prompt back; a later one's
            return [dataclasses.replace(row, prompt_index=j,  # travelled with it
                                        prompt_ids=list(token_lists[j]) if row.segment_index == 0 else row.prompt_ids)
                    for row in sorted(rows, key=lambda r: (r.sample_index, r.segment_index))]

        def on_group(slot: int, j: int, rows: list) -> None:
            tokens_by_slot[slot] = tokens_by_slot.get(slot, 0) + len(token_lists[j]) + sum(
                len(r.completion_ids) for r in rows)
            self._homes.ran(token_lists[j], slot)
            groups.put(self._batch(rows_of(j, rows)))

        grouped = self._scatter(costs, submit, timeout, [p.n for p in params], "generate", ("prompts", "rows"), cancel,
                                call_id, on_group, began, self._homes.of(token_lists))
        self._meter.dispatched(tokens_by_slot, self.num_workers)
        return self._batch([row for j in range(len(token_lists)) for row in rows_of(j, grouped[j])])

    def _batch(self, rows: list) -> RolloutBatch:
        newest = max((max(r.token_versions or [r.policy_version]) for r in rows), default=0)
        if newest > self.version:
            raise RuntimeError(f"rollout bug: a row from version {newest}, fleet is at {self.version}")
        return RolloutBatch.from_rows(rows, pad_token_id=pad_token_id(self.tokenizer), tokenizer=self.tokenizer)

    def score(self, prompts: Sequence[Any], completions: Sequence[Any], temperature: Any = 1.0,
              timeout: float | None = None, **kwargs) -> list[torch.Tensor] | tuple[list[torch.Tensor], Routing]:
        """rollout.scoring.score on the actors' models: pairs spread by length, results in input order.
        `return_routing=True` (mixtures of experts): `(logprobs, routing)` as `rollout.score` returns them, each
        pair's experts coming back with its logprobs (`routing.bytes_per_token` per fed token); `top_k=k`:
        `(logprobs, top)` likewise."""
        from ..scoring import check_pairs

        if len(prompts) != len(completions):
            raise invalid("completions", f"{len(completions)} items", f"must be one per prompt ({len(prompts)})",
                          "pass as many completions as prompts")
        # every pair checked here, against the meta-device copy, so a bad one is refused with its own index before
        # any actor is touched (an actor sees only its chunk); actors get the token ids
        pairs = check_pairs(self._shapes, prompts, completions, temperature, self.tokenizer)
        # mixtures of experts: the routers' layout first (a model without routers the recorder understands is refused
        # before any pair is scored); then each pair's experts come back beside its logprobs, a compact
        # (positions, layers, top_k) uint8 tensor
        layout = self._routing_layout() if kwargs.get("return_routing") else None

        def submit(actor, jobs: list[int]):
            return actor.score.remote([list(pairs[j].prompt) for j in jobs], [list(pairs[j].completion) for j in jobs],
                                      [pairs[j].temperature for j in jobs], kwargs)

        costs = [len(p.prompt) + len(p.completion) for p in pairs]
        scores = self._scatter(costs, submit, timeout, [1] * len(costs), "score", ("pairs", "pairs"))
        if kwargs.get("top_k"):  # (logprobs, top) as rollout.score returns them, each pair's from its actor
            return [scores[j][0] for j in range(len(costs))], [scores[j][1] for j in range(len(costs))]
        if layout is None:
            return [scores[j] for j in range(len(costs))]
        experts = tuple(torch.tensor(scores[j][1]) for j in range(len(costs)))  # numpy on the wire (actor.score)
        return [scores[j][0] for j in range(len(costs))], Routing(layout.layers, layout.num_experts, layout.top_k,
                                                                  experts)

    def _routing_layout(self) -> Routing:
        """The layout (layers, experts, top-k; no rows) of the routing the actors' model records; ValueError if it
        has no router the recorder understands."""
        with self._lock:
            self._await_starts()
            slots = sorted(self._ready())
            if not slots:
                raise RuntimeError("RolloutFleet.score: no actor is running")
            ref = self._actors[slots[0]].routing_layout.remote()
        return ray.get(ref)

    def update_weights(self, weights, version: int | None = None, full: bool = False,
                       in_flight: str | None = None) -> int:
        """Validate here (as the worker does), send once, apply atomically on every actor, check they agree.
        A generate in flight goes on: each actor applies the update under `in_flight` (default
        `config.in_flight`: "wait", "abort", "recompute" or "keep"; docs/async.md). Updates are applied in the same
        order on every actor, one at a time. A fleet built from a PEFT model takes adapter-only updates (PEFT's or
        the state dict's names): only the adapter's tensors travel."""
        mode = self.config.in_flight if in_flight is None else in_flight
        check_in_flight(mode)
        check_version(version)
        items = list(resolve_names(self._shapes, weights))  # the state dict's names, so actors and the replay agree
        plan_update(self._shapes, items, full=full)
        with self._lock:
            new_version = self.version + 1 if version is None else version
            self._await_starts()
            start = time.perf_counter()
            pool = _Pool(self)
            try:
                replay = self._transport.send(pool, items, new_version, full, mode)
            except TransportFailed:  # someone may have missed it: everyone gets it again through the object store
                replay = ObjectStore().send(pool, items, new_version, full, mode)
            self.version = new_version
            names = frozenset(name for name, _ in items)
            if replay is None or self._state_names <= names:  # a full update replaces the history; one not
                self._replay = [replay] if replay is not None else None  # retained ends it
                self._replay_names = [names] if replay is not None else None
            elif self._replay is not None:  # an update whose names a later one covers is dropped: repeated adapter
                # updates keep one entry, not one per step
                kept = [i for i, old in enumerate(self._replay_names) if not old <= names]
                self._replay = [self._replay[i] for i in kept] + [replay]
                self._replay_names = [self._replay_names[i] for i in kept] + [names]
            self._fingerprint = None
            self._num_updates += 1
            self._settle(verify=self._num_updates % self.verify_every == 0)
            self._meter.weight_sync(time.perf_counter() - start, sum(t.numel() * t.element_size() for _, t in items))
            return new_version

    def sleep(self) -> None:
        """Every actor frees its KV cache and step buffers (after its in-flight work), as RolloutWorker.sleep; weights
        stay. A later generate wakes each actor it uses; an actor replaced meanwhile starts awake."""
        with self._lock:
            self._await_starts()
            self._on_ready(lambda actor: actor.sleep.remote())

    def wake(self) -> None:
        """Every actor re-allocates what sleep freed (RolloutWorker.wake)."""
        with self._lock:
            self._await_starts()
            self._on_ready(lambda actor: actor.wake.remote())

    def init_weight_group(self, backend: str | None = None, timeout_s: float = 300) -> None:
        """Open a torch.distributed group (this process rank 0, actors 1..N) that later update_weights use."""
        backend = backend or ("nccl" if self.resources.num_gpus > 0 else "gloo")
        with self._lock:
            self._await_starts()
            self._transport.close()  # leave any previous group first; if the new one fails, the object store remains
            self._transport = ObjectStore()
            self._transport = Collective(_Pool(self), backend, timeout_s)

    def weights_fingerprint(self) -> str:
        """The fingerprint every actor reports (they must agree; see rollout.model.weights.fingerprint)."""
        with self._lock:
            self._settle()
            return self._fingerprint

    def metrics(self, timeout: float = 10.0) -> FleetMetrics:
        """The fleet's snapshot: `total` (as RolloutWorker.metrics, summed over actors; counters keep what replaced
        actors had counted), `actors` (slot -> snapshot), and the fleet's own figures (replacements, dispatch
        imbalance, weight-sync seconds and bytes). Each live actor answers beside its work (the control group); one
        that does not answer within `timeout` seconds keeps its last snapshot."""
        with self._lock:
            refs = {slot: (self._actors[slot], self._actors[slot].metrics.options(concurrency_group="control").remote())
                    for slot in sorted(self._ready())}
        answered = ray.wait([ref for _, ref in refs.values()], num_returns=len(refs), timeout=timeout)[0] if refs \
            else []
        for slot, (actor, ref) in refs.items():  # never wait for actors with the fleet's lock held
            if ref not in answered:
                continue
            with contextlib.suppress(ray.exceptions.RayError):  # died meanwhile: its last snapshot stays
                snapshot = ray.get(ref)
                with self._lock:
                    if self._actors[slot] is actor:
                        self._meter.actor_seen(slot, snapshot)
        with self._lock:
            return self._meter.snapshot(len(self._ready()), sum(self._restarts))

    def serve_metrics(self, port: int, host: str = "127.0.0.1"):
        """Serve `metrics()` for Prometheus on http://host:port/metrics until the fleet closes: the totals under the
        worker's names, the fleet's own as `rollout_fleet_*`, each actor's as `rollout_actor_*{actor="<slot>"}`. As
        RolloutWorker.serve_metrics: this machine only unless `host` says otherwise; one endpoint per fleet."""
        from ..metrics.prometheus import serve

        with self._lock:
            self._metrics_server = serve(self._metrics_server, self.metrics, port, host, "fleet")
            return self._metrics_server

    def close(self) -> None:
        """Stop every actor (engines first, briefly), the placement group, and Ray if this fleet started it."""
        if getattr(self, "_metrics_server", None) is not None:
            self._metrics_server.close()
        self._calls.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            ready = [self._actors[slot] for slot in sorted(self._ready())]  # a starting actor is just killed
            actors, self._actors, self._starting = [a for a in self._actors if a], [], {}
            self._transport.close()
            self._transport = ObjectStore()
            if ray.is_initialized():
                if ready:  # never wait long for a hung engine
                    ray.wait([a.close.remote() for a in ready], num_returns=len(ready), timeout=10)
                for actor in actors:
                    with logged("killing a closed fleet's actor"):
                        ray.kill(actor, no_restart=True)
                if self._pg is not None:
                    remove_placement_group(self._pg)
                    self._pg = None
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()

    def __enter__(self) -> "RolloutFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ work across actors
    def _scatter(self, costs: list[int], submit: Callable, timeout: float | None, units: list[int], what: str,
                 names: tuple[str, str], cancel: CallCancel | None = None, call_id: int | None = None,
                 on_result: Callable[[int, int, Any], None] | None = None,
                 began: float | None = None, homes: list[int | None] | None = None) -> dict[int, Any]:
        """Run every job on some actor, by load; survive deaths; job index -> result. The fleet's lock is taken for
        each round of bookkeeping and released while waiting, so an update can land meanwhile. `timeout` counts from
        `began` (when the call was submitted; default now). `submit` returns an
        object ref (the chunk's results at once) or a streaming generator (one (chunk index, result) per job as it
        finishes, each passed to `on_result(slot, job, result)`; an actor that dies midway loses only the jobs it had
        not streamed; a last item (-1, metrics snapshot) updates the fleet's meter). `homes`: each job's preferred
        actor (homes.py), or None."""
        deadline = None if timeout is None else (began or time.monotonic()) + timeout
        plan = Dispatcher(costs, range(self.num_workers), self.chunks_per_worker, homes=homes)
        inflight: dict[Any, tuple[int, Any, Any]] = {}  # object ref -> (slot, chunk, the actor it went to)
        results: dict[int, Any] = {}
        try:
            with self._held(deadline, plan, results, units, timeout, what, names, inflight):
                self._revive()
            while not plan.finished:
                with self._held(deadline, plan, results, units, timeout, what, names, inflight):
                    for slot, chunk in plan.assign(self._ready()):
                        inflight[submit(self._actors[slot], list(chunk.jobs))] = (slot, chunk, self._actors[slot])
                    waiting = list(inflight) + list(self._starting.values())
                    if not waiting:
                        raise RuntimeError(f"RolloutFleet.{what}: no actor is running or starting")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise self._time_out(plan, results, units, timeout, what, names, inflight)
                if cancel is not None and cancel.is_set():
                    raise CancelledError(f"RolloutFleet.{what} was cancelled")
                done, _ = ray.wait(waiting, num_returns=1, timeout=POLL_S if remaining is None else
                                   min(POLL_S, remaining))
                if not done:
                    continue
                with self._held(deadline, plan, results, units, timeout, what, names, inflight):
                    for ref in done:
                        if ref in inflight:
                            self._collect(ref, inflight, plan, results, names[0], on_result)
                        elif ref in self._starting.values():
                            self._started(next(s for s, r in self._starting.items() if r == ref))
        finally:  # after an error: nothing of the call keeps running (no lock: a timeout must not wait for it)
            for ref, (_, _, actor) in inflight.items():
                with logged("cancelling a failed call's task on an actor"):
                    ray.cancel(ref)
                with logged("asking an actor to cancel a failed call"):
                    report = actor.cancel.options(concurrency_group="control").remote(call_id)
                    if cancel is not None:
                        cancel.reports.append(report)  # the tokens it discarded (FleetFuture.discarded_tokens)
        return results

    @contextlib.contextmanager
    def _held(self, deadline: float | None, *timed_out: Any) -> Iterator[None]:
        """The fleet's lock for one round of a call's bookkeeping, waited for until the call's deadline at most: an
        update, sleep/wake or start-up holds it while it waits for actors (an actor start can take minutes), and a
        call's timeout must not wait behind that. Past the deadline: the call's TimeoutError (`_time_out(*timed_out)`)
        without the lock."""
        if deadline is None:
            acquired = self._lock.acquire()
        else:
            acquired = self._lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
        if not acquired:
            raise self._time_out(*timed_out, locked=False)
        try:
            yield
        finally:
            self._lock.release()

    def _revive(self) -> None:
        """Under the lock, as a call starts: restart the slots left down (an interrupted update, failed starts) and
        replace the actors a call timed out on while it could not take the lock, unless replaced since."""
        for slot in sorted(self._down):
            self._replace(slot, "it was down after an interrupted update")
        while self._overdue:
            slot, actor, why = self._overdue.popleft()
            if self._actors[slot] is actor and slot not in self._starting:
                self._replace(slot, why)

    def _collect(self, ref, inflight: dict, plan: Dispatcher, results: dict, jobs_name: str,
                 on_result: Callable[[int, int, Any], None] | None) -> None:
        slot, chunk, actor = inflight[ref]
        streamed = isinstance(ref, ray.ObjectRefGenerator)
        try:
            got = ray.get(next(ref)) if streamed else ray.get(ref)
        except StopIteration:  # the chunk's stream ended: every job of it is back
            got = None
        except ray.exceptions.RayActorError as error:
            for other in [r for r, (s, _, _) in inflight.items() if s == slot]:
                inflight.pop(other)
            given_up = plan.fail(slot, done=results)
            if given_up:
                raise RuntimeError(f"{jobs_name} {given_up[:5]} were on an actor that died {plan.max_attempts} times: "
                                   "they probably kill it (out of memory?). Fix: shorten them or give actors more "
                                   "memory.") from None
            if self._actors[slot] is actor:  # not already replaced (an update that landed meanwhile replaces the dead)
                self._replace(slot, f"it died with {jobs_name} in flight: {error}")
            return
        if streamed and got is not None:  # one job's result, or the actor's metrics after its chunk; the stream goes on
            index, value = got
            if index < 0:
                if self._actors[slot] is actor:  # a replaced actor's last words are not the new one's
                    self._meter.actor_seen(slot, value)
                return
            job = chunk.jobs[index]
            results[job] = value
            if on_result is not None:
                on_result(slot, job, value)
            return
        inflight.pop(ref)
        if not streamed:
            results.update(zip(chunk.jobs, got))
        plan.complete(slot, chunk)

    def _time_out(self, plan: Dispatcher, results: dict, units: list[int], timeout: float, what: str,
                  names: tuple[str, str], inflight: dict, locked: bool = True) -> TimeoutError:
        """The call's TimeoutError naming the actors that still hold its jobs; those are replaced (hung or too slow:
        the next call must not queue behind them): now when `locked`, else by the next call (the lock was busy)."""
        held, actors = plan.outstanding(), {slot: actor for slot, _, actor in inflight.values()}
        parts = [f"actor {slot} (pid {self._info[slot].get('pid')} on {self._info[slot].get('host')}) still holds "
                 f"{len(jobs)} {names[0]} / {sum(units[j] for j in jobs)} {names[1]}" for slot, jobs in held.items()]
        parts += [f"actor {slot} still starting" for slot in list(self._starting)]
        why = f"{what} timed out after {timeout}s with its jobs unfinished"
        for slot in held:
            if locked:
                self._replace(slot, why)
            elif slot in actors:
                self._overdue.append((slot, actors[slot], why))
        busy = "" if locked else " (the fleet was busy with an update, sleep/wake or actor start until then)"
        return TimeoutError(f"RolloutFleet.{what} timed out after {timeout}s{busy} with "
                            f"{sum(units[j] for j in results)}/{sum(units)} {names[1]} done; {'; '.join(parts)}. "
                            "Those actors are being replaced.")

    def _on_ready(self, call: Callable) -> tuple[dict[int, Any], list[int]]:
        """call(actor) -> ref on every ready actor; (slot -> value, slots whose actor died). Dead ones are marked
        down; the caller replaces them once the fleet's state is settled."""
        refs = {slot: call(self._actors[slot]) for slot in sorted(self._ready())}
        values, lost = {}, []
        for slot, ref in refs.items():
            try:
                values[slot] = ray.get(ref)
            except ray.exceptions.RayActorError:
                lost.append(slot)
                self._down.add(slot)
        return values, lost

    # ------------------------------------------------------------------ weights
    def _settle(self, verify: bool = True) -> None:
        """Ready actors must report one (version, fingerprint), at the fleet's version (the fingerprint only when
        `verify`: unverified, it stays unknown until the next verified settle); then the dead are replaced (checked
        against it when known) and waited for."""
        states, _ = self._on_ready(lambda actor: actor.state.options(concurrency_group="control").remote(verify))
        distinct = set(states.values())
        if len(distinct) > 1 or any(version != self.version for version, _ in distinct):
            raise RuntimeError(f"actors disagree (fleet version {self.version}): {states}. Fix: call "
                               "update_weights with the full state dict.")
        if distinct:
            self._fingerprint = next(iter(distinct))[1]
        for slot in sorted(self._down):
            self._replace(slot, "it died (found at a weight update)")
        self._await_starts()

    # ------------------------------------------------------------------ actor lifecycle
    def _start(self, source: Any, tokenizer: Any) -> None:
        self._source = ray.put(source) if isinstance(source, InMemoryModel) else source
        self._tokenizer_ref = ray.put(tokenizer) if tokenizer is not None else None  # else loaded from the path
        self._cluster_cpus = ray.cluster_resources().get("CPU", 1.0)
        self._pg = self._placement_group(self.startup_timeout_s)
        self.version, self._fingerprint = 0, None
        self._replay: list | None = []  # updates a replacement replays, in order; None: the last one was not retained
        self._replay_names: list[frozenset] | None = []  # the names each retained update writes
        self._restarts = [0] * self.num_workers
        self._failures = [MAX_START_FAILURES - 1] * self.num_workers  # a first start that fails is final
        self._info: list[dict] = [{} for _ in range(self.num_workers)]
        self._actors, self._down = [None] * self.num_workers, set(range(self.num_workers))
        self._serving = False  # until every first start succeeded: a failed one is final (see _started)
        for slot in range(self.num_workers):
            self._replace(slot)
        self._await_starts()
        self._serving = True

    def _ready(self) -> set[int]:
        return set(range(len(self._actors))) - set(self._starting) - self._down

    def _replace(self, slot: int, why: str = "") -> None:
        """Kill the actor in `slot` (if any; logged with `why` on the "rollout" logger) and start a new one that syncs
        to the fleet's weights."""
        old = self._actors[slot]
        if old is not None:
            info = self._info[slot]
            LOG.warning("RolloutFleet: replacing actor %d (pid %s on %s; replacement %d of that slot): %s", slot,
                        info.get("pid"), info.get("host"), self._restarts[slot] + 1, why or "asked to")
            with logged(f"killing the replaced actor of slot {slot}"):
                ray.kill(old, no_restart=True)
            self._restarts[slot] += 1
            self._homes.forget(slot)
            self._meter.actor_replaced(slot)
            self._transport.actor_replaced()
        updates = self._restore_updates(slot)
        config = dataclasses.replace(self.config, seed=self.config.seed + ACTOR_SEED_STRIDE * (
            slot + self.num_workers * self._restarts[slot]))
        actor = _Actor.options(**self._actor_options(slot)).remote(self._source, config, self._tokenizer_ref,
                                                                   self.resources.threads(self.num_workers))
        self._actors[slot] = actor
        self._down.discard(slot)
        self._starting[slot] = actor.sync.remote(self.version, *updates)

    def _restore_updates(self, slot: int) -> list:
        if self._replay is not None:
            return list(self._replay)
        peers = sorted(self._ready() - {slot})
        if not peers:
            raise RuntimeError(f"actor {slot} cannot be restored: no live actor holds version {self.version} and that "
                               "update came over the weight group (not retained). Fix: call update_weights with the "
                               "full state dict.")
        return [self._actors[peers[0]].state_dict.options(concurrency_group="control").remote()]

    def _started(self, slot: int) -> None:
        ref = self._starting.pop(slot)
        try:
            version, fingerprint, info = ray.get(ref)  # ready: no wait for an actor here (a call's deadline is near)
        except ray.exceptions.RayError as exc:
            self._failures[slot] += 1
            if self._failures[slot] < MAX_START_FAILURES:
                self._replace(slot, f"it failed to start: {exc}")
            elif self._serving and self._ready():  # the others serve: this slot waits for the next call
                LOG.warning("RolloutFleet: actor %d failed to start %d times in a row (last: %s); the slot stays down "
                            "and the next call starts it again", slot, self._failures[slot], exc)
                self._failures[slot] = 0
                self._down.add(slot)
            else:  # at start-up, or nothing else can serve: the caller hears it
                raise RuntimeError(f"actor {slot} failed to start {self._failures[slot]} time(s) in a row; last "
                                   f"error: {exc}") from exc
            return
        if version != self.version or fingerprint != (self._fingerprint or fingerprint):
            raise RuntimeError(f"rollout bug: actor {slot} restored to ({version}, {fingerprint}), fleet holds "
                               f"({self.version}, {self._fingerprint})")
        self._fingerprint, self._failures[slot], self._info[slot] = fingerprint, 0, info

    def _await_starts(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while self._starting:
            remaining = max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(self._starting.values()), num_returns=1, timeout=remaining)
            if not done:
                raise TimeoutError(f"actors {sorted(self._starting)} still starting (resources: {self.resources}); "
                                   f"cluster has {ray.available_resources()}")
            self._started(next(s for s, r in self._starting.items() if r == done[0]))

    def _actor_options(self, slot: int) -> dict:
        options = dict(num_cpus=self.resources.cpus(self._cluster_cpus, self.num_workers), max_restarts=0,
                       max_concurrency=MAX_CALLS,
                       num_gpus=self.resources.num_gpus, resources=dict(self.resources.custom) or None)
        if self._pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self._pg,
                                                                               placement_group_bundle_index=slot)
        return options

    def _placement_group(self, timeout_s: float):
        strategy = self.resources.strategy()
        if strategy is None:
            return None
        bundle = self.resources.bundle(self._cluster_cpus, self.num_workers)
        pg = placement_group([bundle] * self.num_workers, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(f"placement group of {self.num_workers} x {bundle} ({strategy}) could not be placed "
                               f"in {timeout_s}s; cluster has {ray.cluster_resources()}") from None
        return pg


class _Pool:
    """The fleet as a weight transport sees it (transport.ActorPool), called under the fleet's lock."""

    def __init__(self, fleet: RolloutFleet) -> None:
        self.fleet = fleet

    def ready(self) -> dict[int, Any]:
        return {slot: self.fleet._actors[slot] for slot in sorted(self.fleet._ready())}

    def on_ready(self, call: Callable) -> tuple[dict[int, Any], list[int]]:
        return self.fleet._on_ready(call)

    def replace(self, slot: int, why: str = "the weight transport lost it") -> None:
        self.fleet._replace(slot, why)

    def await_starts(self) -> None:
        self.fleet._await_starts()

    def drop(self, slot: int) -> None:
        with logged(f"killing the actor of dropped slot {slot}"):
            ray.kill(self.fleet._actors[slot], no_restart=True)
        self.fleet._down.add(slot)
