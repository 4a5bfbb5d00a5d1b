"""RolloutFleet: RolloutWorker's API on a pool of Ray actors (the package's only Ray import).

    with RolloutFleet(model_path, num_workers=2, config=WorkerConfig(...)) as fleet:
        batch = fleet.generate(prompts, sampling=SamplingParams(n=8))   # same rows, same order as a worker
        fleet.update_weights(state_dict, version=step)

Contract:
- Requests and updates are validated here, on the caller's side, with the worker's own checks (against a meta-device
  copy of the model: names and shapes, no memory), before any actor is touched.
- generate spreads prompts by outstanding token load (rollout.dispatch); the n samples of a prompt stay on one actor;
  rows come back prompt-major with global prompt_index, as one RolloutWorker returns them.
- An actor that dies is replaced: its unfinished prompts run on the others meanwhile; the replacement is brought to
  the fleet's weights and version (the retained update, or a live peer's state dict) and checked by fingerprint
  before it takes work. A call that passes `timeout` raises TimeoutError naming the actors still holding work, and
  those actors are replaced.
- update_weights puts the tensors in the object store once (or broadcasts them over a torch.distributed group, see
  init_weight_group); every actor applies them atomically under its fence; versions and fingerprints are compared
  before it returns. Calls are serialised, so no row returned after update_weights comes from older weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("RolloutFleet needs Ray. Fix: pip install 'rollout[ray]'.") from exc

from .actor import FleetActor, InMemoryModel, model_source, to_shared, with_adapters
from ..batch import RolloutBatch
from .collective import WeightGroup, free_port, layout
from ..config import WorkerConfig
from .dispatch import Dispatcher
from ..errors import invalid
from ..prompts import prepare_call
from .resources import FleetResources
from ..weights import plan_update, resolve_names

MAX_START_FAILURES = 3  # consecutive failed starts of one actor before the fleet gives up
_Actor = ray.remote(concurrency_groups={"control": 2})(FleetActor)


class RolloutFleet:
    def __init__(self, model: Any, num_workers: int = 2, config: WorkerConfig | None = None,
                 resources: FleetResources | dict | None = None, tokenizer: Any = None, chunks_per_worker: int = 1,
                 startup_timeout_s: float = 600, ray_init: dict | None = None) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise invalid("num_workers", num_workers, "must be an integer >= 1", "use e.g. one per GPU")
        self.config = config if config is not None else WorkerConfig()
        if isinstance(chunks_per_worker, bool) or not isinstance(chunks_per_worker, int) or chunks_per_worker < 1:
            raise invalid("chunks_per_worker", chunks_per_worker, "must be an integer >= 1",
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
        self._lock = threading.RLock()
        self._actors, self._starting, self._down, self._pg, self._group = [], {}, set(), None, None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(**{"include_dashboard": False, **(ray_init or {})})
        try:
            self._start(source, tokenizer)
        except BaseException:
            self.close()
            raise
        self.max_request_tokens = min(info["max_request_tokens"] for info in self._info)

    # ------------------------------------------------------------------ public surface
    @property
    def actors(self) -> list:
        return list(self._actors)

    @property
    def policy_version(self) -> int:
        return self.version

    def generate(self, prompts: Sequence[Any], sampling=None, chat_template: bool = False,
                 timeout: float | None = None) -> RolloutBatch:
        """RolloutWorker.generate across the fleet: validated here, rows prompt-major in input order."""
        token_lists, params = prepare_call(prompts, sampling, self.tokenizer, chat_template, self.vocab_size,
                                           self.max_context, self.max_request_tokens)
        costs = [len(ids) + p.n * p.max_new_tokens for ids, p in zip(token_lists, params)]

        def submit(actor, jobs: list[int]):
            return actor.generate.remote([token_lists[j] for j in jobs], [params[j] for j in jobs])

        with self._lock:
            grouped = self._scatter(costs, submit, timeout, [p.n for p in params], "generate", ("prompts", "rows"))
            version = self.version
        rows = [dataclasses.replace(row, prompt_index=j, prompt_ids=list(token_lists[j]))
                for j in range(len(token_lists)) for row in sorted(grouped[j], key=lambda r: r.sample_index)]
        stale = [r for r in rows if r.policy_version != version]
        if stale:
            raise RuntimeError(f"rollout bug: {len(stale)} rows from version {stale[0].policy_version}, fleet is at "
                               f"{version}")
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return RolloutBatch.from_rows(rows, pad_token_id=pad if pad is not None else 0, tokenizer=self.tokenizer)

    def score(self, prompts: Sequence[Any], completions: Sequence[Any], temperature: Any = 1.0,
              timeout: float | None = None, **kwargs) -> list[torch.Tensor]:
        """rollout.scoring.score on the actors' models: pairs spread by length, results in input order."""
        if len(prompts) != len(completions):
            raise invalid("completions", f"{len(completions)} items", f"must be one per prompt ({len(prompts)})",
                          "pass as many completions as prompts")
        temps = list(temperature) if isinstance(temperature, Sequence) else None

        def submit(actor, jobs: list[int]):
            temp = [temps[j] for j in jobs] if temps is not None else temperature
            return actor.score.remote([prompts[j] for j in jobs], [completions[j] for j in jobs], temp, kwargs)

        costs = [max(1, len(p) + len(c)) for p, c in zip(prompts, completions)]
        with self._lock:
            scores = self._scatter(costs, submit, timeout, [1] * len(costs), "score", ("pairs", "pairs"))
        return [scores[j] for j in range(len(costs))]

    def update_weights(self, weights, version: int | None = None, full: bool = False) -> int:
        """Validate here (as the worker does), send once, apply atomically on every actor, check they agree.
        A fleet built from a PEFT model takes adapter-only updates (PEFT's or the state dict's names): only the
        adapter's tensors travel."""
        items = list(resolve_names(self._shapes, weights))  # the state dict's names, so actors and the log agree
        plan_update(self._shapes, items, full=full)
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version={version!r} is invalid: must be a non-negative int. Fix: pass e.g. the "
                             "trainer's step number, or None to increment.")
        with self._lock:
            new_version = self.version + 1 if version is None else version
            self._await_starts()
            ref = None
            if self._group is None or not self._broadcast(items, new_version, full):  # else the object store
                ref = ray.put(to_shared(items))  # one copy into shared memory; actors read it in place
                self._on_ready(lambda actor: actor.update_weights.remote(ref, new_version, full))
            self.version = new_version
            names = frozenset(name for name, _ in items)
            if ref is None or self._state_names <= names:
                self._log = [ref] if ref is not None else None
                self._log_names = [names] if ref is not None else None
            elif self._log is not None:  # an update whose names a later one covers is dropped: repeated adapter
                # updates keep one entry, not one per step
                kept = [i for i, old in enumerate(self._log_names) if not old <= names]
                self._log = [self._log[i] for i in kept] + [ref]
                self._log_names = [self._log_names[i] for i in kept] + [names]
            self._fingerprint = None
            self._settle()
            return new_version

    def init_weight_group(self, backend: str | None = None, timeout_s: float = 300) -> None:
        """Open a torch.distributed group (this process rank 0, actors 1..N) that later update_weights use."""
        backend = backend or ("nccl" if self.resources.num_gpus > 0 else "gloo")
        with self._lock:
            self._await_starts()
            slots = sorted(self._ready())
            host, port = ray.util.get_node_ip_address(), free_port()
            refs = [self._actors[s].join_group.remote(backend, host, port, i + 1, len(slots) + 1, timeout_s)
                    for i, s in enumerate(slots)]
            self._group = None
            self._group = WeightGroup(backend, host, port, 0, len(slots) + 1, timeout_s)
            ray.get(refs)
            self._group_stale = False

    def weights_fingerprint(self) -> str:
        """The fingerprint every actor reports (they must agree; see rollout.weights.fingerprint)."""
        with self._lock:
            self._settle()
            return self._fingerprint

    def close(self) -> None:
        """Stop every actor (engines first, briefly), the placement group, and Ray if this fleet started it."""
        with self._lock:
            ready = [self._actors[slot] for slot in sorted(self._ready())]  # a starting actor is just killed
            actors, self._actors, self._starting, self._group = [a for a in self._actors if a], [], {}, None
            if ray.is_initialized():
                if ready:  # never wait long for a hung engine
                    ray.wait([a.close.remote() for a in ready], num_returns=len(ready), timeout=10)
                for actor in actors:
                    with contextlib.suppress(Exception):
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
                 names: tuple[str, str]) -> dict[int, Any]:
        """Run every job on some actor, by load; survive deaths; job index -> result."""
        deadline = None if timeout is None else time.monotonic() + timeout
        plan = Dispatcher(costs, range(self.num_workers), self.chunks_per_worker)
        for slot in sorted(self._down):  # left down by an interrupted update
            self._replace(slot)
        inflight: dict[Any, tuple[int, Any]] = {}  # object ref -> (slot, chunk)
        results: dict[int, Any] = {}
        try:
            while not plan.finished:
                for slot, chunk in plan.assign(self._ready()):
                    inflight[submit(self._actors[slot], list(chunk.jobs))] = (slot, chunk)
                waiting = list(inflight) + list(self._starting.values())
                if not waiting:
                    raise RuntimeError(f"RolloutFleet.{what}: no actor is running or starting")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._time_out(plan, results, units, timeout, what, names)
                done, _ = ray.wait(waiting, num_returns=1, timeout=remaining)
                for ref in done:
                    if ref in inflight:
                        self._collect(ref, inflight, plan, results, names[0])
                    else:
                        self._started(next(s for s, r in self._starting.items() if r == ref))
        finally:
            for ref in inflight:  # after an error: queued chunks are dropped (a running one cannot be interrupted)
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
        return results

    def _collect(self, ref, inflight: dict, plan: Dispatcher, results: dict, jobs_name: str) -> None:
        slot, chunk = inflight.pop(ref)
        try:
            values = ray.get(ref)
        except ray.exceptions.RayActorError:
            for other in [r for r, (s, _) in inflight.items() if s == slot]:
                inflight.pop(other)
            given_up = plan.fail(slot)
            if given_up:
                raise RuntimeError(f"{jobs_name} {given_up[:5]} were on an actor that died {plan.max_attempts} times: "
                                   "they probably kill it (out of memory?). Fix: shorten them or give actors more "
                                   "memory.") from None
            self._replace(slot)
            return
        results.update(zip(chunk.jobs, values))
        plan.complete(slot, chunk)

    def _time_out(self, plan: Dispatcher, results: dict, units: list[int], timeout: float, what: str,
                  names: tuple[str, str]) -> None:
        held = plan.outstanding()
        parts = [f"actor {slot} (pid {self._info[slot].get('pid')} on {self._info[slot].get('host')}) still holds "
                 f"{len(jobs)} {names[0]} / {sum(units[j] for j in jobs)} {names[1]}" for slot, jobs in held.items()]
        parts += [f"actor {slot} still starting" for slot in self._starting]
        for slot in held:  # hung or too slow: replaced, so the next call does not queue behind it
            self._replace(slot)
        raise TimeoutError(f"RolloutFleet.{what} timed out after {timeout}s with {sum(units[j] for j in results)}/"
                           f"{sum(units)} {names[1]} done; {'; '.join(parts)}. Those actors are being replaced.")

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
    def _broadcast(self, items: list, version: int, full: bool) -> bool:
        """Update over the torch.distributed group; False when it failed and the object store must be used."""
        _, lost = self._on_ready(lambda actor: actor.info.options(concurrency_group="control").remote())
        if lost or self._group_stale:  # membership changed: rebuild the group with the actors there are now
            for slot in lost:
                self._replace(slot)
            self._await_starts()
            self.init_weight_group(self._group.backend)
        buckets = layout(items, bucket_mb=256)
        slots = sorted(self._ready())
        refs = [self._actors[s].receive_weights.remote(buckets, version, full) for s in slots]
        try:
            self._group.send(buckets, dict(items))
            ray.get(refs)
            return True
        except Exception:  # a rank died mid-broadcast: drop the group; who did not finish is replaced later
            self._group_stale = True
            finished, _ = ray.wait(refs, num_returns=len(refs), timeout=5)
            for slot, ref in zip(slots, refs):
                if ref not in finished:
                    with contextlib.suppress(Exception):
                        ray.kill(self._actors[slot], no_restart=True)
                    self._down.add(slot)
            return False

    def _settle(self) -> None:
        """Ready actors must report one (version, fingerprint), at the fleet's version; then the dead are replaced
        (checked against it) and waited for."""
        states, _ = self._on_ready(lambda actor: actor.state.options(concurrency_group="control").remote())
        distinct = set(states.values())
        if len(distinct) > 1 or any(version != self.version for version, _ in distinct):
            raise RuntimeError(f"actors disagree (fleet version {self.version}): {states}. Fix: call "
                               "update_weights with the full state dict.")
        if distinct:
            self._fingerprint = next(iter(distinct))[1]
        for slot in sorted(self._down):
            self._replace(slot)
        self._await_starts()

    # ------------------------------------------------------------------ actor lifecycle
    def _start(self, source: Any, tokenizer: Any) -> None:
        self._source = ray.put(source) if isinstance(source, InMemoryModel) else source
        self._tokenizer_ref = ray.put(tokenizer) if tokenizer is not None else None  # else loaded from the path
        self._cluster_cpus = ray.cluster_resources().get("CPU", 1.0)
        self._pg = self._placement_group(self.startup_timeout_s)
        self.version, self._fingerprint, self._log = 0, None, []  # _log: updates a replacement replays
        self._log_names: list[frozenset] | None = []  # the names each retained update writes
        self._group_stale = False
        self._restarts = [0] * self.num_workers
        self._failures = [MAX_START_FAILURES - 1] * self.num_workers  # a first start that fails is final
        self._info: list[dict] = [{} for _ in range(self.num_workers)]
        self._actors, self._down = [None] * self.num_workers, set(range(self.num_workers))
        for slot in range(self.num_workers):
            self._replace(slot)
        self._await_starts()

    def _ready(self) -> set[int]:
        return set(range(len(self._actors))) - set(self._starting) - self._down

    def _replace(self, slot: int) -> None:
        """Kill the actor in `slot` (if any) and start a new one that syncs to the fleet's weights."""
        old = self._actors[slot]
        if old is not None:
            with contextlib.suppress(Exception):
                ray.kill(old, no_restart=True)
            self._restarts[slot] += 1
            self._group_stale = self._group is not None
        updates = self._restore_updates(slot)
        config = dataclasses.replace(self.config, seed=self.config.seed + 7919 * (slot + self.num_workers *
                                                                                   self._restarts[slot]))
        actor = _Actor.options(**self._actor_options(slot)).remote(self._source, config, self._tokenizer_ref,
                                                                   self.resources.threads(self.num_workers))
        self._actors[slot] = actor
        self._down.discard(slot)
        self._starting[slot] = actor.sync.remote(self.version, *updates)

    def _restore_updates(self, slot: int) -> list:
        if self._log is not None:
            return list(self._log)
        peers = sorted(self._ready() - {slot})
        if not peers:
            raise RuntimeError(f"actor {slot} cannot be restored: no live actor holds version {self.version} and that "
                               "update came over the weight group (not retained). Fix: call update_weights with the "
                               "full state dict.")
        return [self._actors[peers[0]].state_dict.options(concurrency_group="control").remote()]

    def _started(self, slot: int) -> None:
        ref = self._starting.pop(slot)
        try:
            state = ray.get(ref)
            info = ray.get(self._actors[slot].info.options(concurrency_group="control").remote())
        except ray.exceptions.RayError as exc:
            self._failures[slot] += 1
            if self._failures[slot] >= MAX_START_FAILURES:
                raise RuntimeError(f"actor {slot} failed to start {self._failures[slot]} time(s) in a row; last "
                                   f"error: {exc}") from exc
            self._replace(slot)
            return
        if state[0] != self.version or state[1] != (self._fingerprint or state[1]):
            raise RuntimeError(f"rollout bug: actor {slot} restored to {state}, fleet holds "
                               f"({self.version}, {self._fingerprint})")
        self._fingerprint, self._failures[slot], self._info[slot] = state[1], 0, info

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
