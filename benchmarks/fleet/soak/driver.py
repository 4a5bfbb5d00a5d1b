"""The driver: builds the rig (a 2-node local Ray cluster with a RolloutFleet of 2 actors, one per node; a
RolloutWorker with a tiny KV cache behind `rollout.serve` on loopback), runs the traffic and the fault schedule for
the given time, drains, records the end state, and writes the history. It judges nothing: checker.py does.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import torch

import rollout
from rollout import RolloutWorker, WorkerConfig
from rollout.testing import build_tiny_model, load_tiny_model

from . import envs
from .client import Http
from .faults import Injector
from .history import History
from .schedule import draw
from .traffic import FleetCalls, Rig, fleet_trainer, server_client, server_trainer
from .weights import Versions

FLEET_CONFIG = WorkerConfig(page_size=16, num_blocks=256, max_batch_tokens=256)
SERVER_CONFIG = WorkerConfig(page_size=16, num_blocks=40, max_batch_tokens=256)  # 640 tokens: KV pressure is routine
JOIN_S = 180.0  # how long the traffic and the faults may take to finish once the clock has run out
QUIET_S = 60.0  # how long the end state may take to settle (hung environments finish, cancelled requests drop)


def start_cluster():
    """A head node (this driver) and one worker node, 1 CPU each: the fleet's two actors land one per node."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False,
        _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3}))
    node = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    ray.cloudpickle.register_pickle_by_value(envs)  # the actors unpickle the environments without benchmarks/
    return cluster, node


def resources() -> dict:
    import ray

    process = psutil.Process()
    alive = sum(1 for a in ray._private.state.actors().values()
                if a.get("State") == "ALIVE" and "FleetActor" in a.get("ActorClassName", ""))
    names = Counter(re.sub(r"[-_]?\d+", "", t.name) for t in threading.enumerate())
    return dict(rss_mb=round(process.memory_info().rss / 2**20, 1), **rss_parts(), fds=process.num_fds(),
                threads=threading.active_count(), actors_alive=alive, thread_names=dict(names))


def rss_parts() -> dict:
    """RSS split as Linux counts it: private memory (anon), mapped files, and shared memory (Ray's object store is
    shared memory this process maps as it reads and writes objects: bounded by the store's size, not a leak)."""
    parts = {}
    with contextlib.suppress(OSError):
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                parts[f"{key[3:].lower()}_mb"] = round(int(value.split()[0]) / 1024, 1)
    return parts


def object_counts(top: int = 25) -> dict:
    """The driver's Python objects by type (the most numerous): where RSS growth is Python objects, which kind."""
    counts = Counter(type(o).__name__ for o in gc.get_objects())
    return dict(total=sum(counts.values()), **dict(counts.most_common(top)))


def warm_up(rig: Rig) -> None:
    """One of each call, so the pools and buffers a steady run holds exist before the baseline is taken."""
    import random

    calls, rng = FleetCalls(rig), random.Random(0)
    from .traffic import collect, draw_params, draw_prompts
    from .envs import ChaosEnvs
    from rollout import SamplingParams

    calls.generate(draw_prompts(rng, 4), [draw_params(rng) for _ in range(4)], op="warmup")
    calls.generate(draw_prompts(rng, 2, 10), [SamplingParams(n=2, max_new_tokens=4)] * 2, op="warmup",
                   env=ChaosEnvs(), max_turns=2, env_timeout=30.0)
    collect(rig, rng, calls)
    rig.http.generate([11, 12, 13], dict(n=2, max_tokens=8, seed=1), op="warmup")
    rig.http.stream([11, 12, 13], dict(n=2, max_tokens=8, seed=1))


def quiesce(rig: Rig, deadline_s: float = QUIET_S) -> dict:
    """Wait until nothing is in flight anywhere (or the deadline), then probe what is left."""
    deadline = time.monotonic() + deadline_s
    probe = probe_end(rig)
    while time.monotonic() < deadline and not probe["quiet"]:
        time.sleep(1.0)
        probe = probe_end(rig)
    return probe


def probe_end(rig: Rig) -> dict:
    engine = rig.worker.engine
    m = rig.worker.metrics()
    requests = engine._requests
    server = dict(pending=len(requests.pending), calls=len(engine._calls), ledger=len(requests.ledger),
                  requests_running=m.requests_running, requests_waiting=m.requests_waiting,
                  kv_pages_used=m.kv_pages_used, engine_restarts=m.engine_restarts, preemptions=m.preemptions,
                  version=rig.worker.policy_version)
    fm = rig.fleet.metrics()
    fleet = dict(actors_ready=fm.actors_ready, actor_replacements=fm.actor_replacements,
                 engine_restarts=fm.total.engine_restarts, preemptions=fm.total.preemptions,
                 version=rig.fleet.policy_version, num_workers=rig.fleet.num_workers,
                 actors={str(k): dict(requests_running=a.requests_running, requests_waiting=a.requests_waiting,
                                      kv_pages_used=a.kv_pages_used) for k, a in fm.actors.items()})
    quiet = all(server[k] == 0 for k in ("pending", "calls", "ledger", "requests_running", "requests_waiting",
                                          "kv_pages_used")) and fleet["actors_ready"] == fleet["num_workers"] and \
        all(v == 0 for a in fleet["actors"].values() for v in a.values())
    return dict(server=server, fleet=fleet, quiet=quiet)


def run(seed: int, duration_s: float, workdir: Path, mean_gap_s: float = 2.0, rejoin_s: float = 5.0) -> Path:
    """Run the soak; returns the path of the history JSON (in `workdir`)."""
    import ray

    from rollout import RolloutFleet

    torch.set_num_threads(1)  # 2 actors and this process share the machine's cores
    workdir.mkdir(parents=True, exist_ok=True)
    path = build_tiny_model(workdir / "llama")
    base = load_tiny_model(path)[0].state_dict()
    history = History(seed, duration_s, spill=workdir / f"rows-{seed}.jsonl")
    schedule = draw(seed, duration_s, mean_gap_s)
    cluster, node = start_cluster()
    fleet = worker = server = None
    try:
        fleet = RolloutFleet(str(path), num_workers=2, config=FLEET_CONFIG, startup_timeout_s=300,
                             resources={"num_cpus": 1, "torch_threads": 1})
        worker = RolloutWorker(str(path), SERVER_CONFIG)
        server = rollout.serve(worker, port=0, model_name="chaos")
        rig = Rig(history, Versions(base, seed), fleet, worker, None, threading.Event(), seed, cluster,
                  vocab=fleet.vocab_size, context=fleet.max_context or 1024)
        rig.http = Http(server.url, history, lambda: worker.policy_version)
        history.data["meta"] = dict(model=str(path), seed=seed, duration_s=duration_s, mean_gap_s=mean_gap_s,
                                    schedule=[f.__dict__ for f in schedule], pid=os.getpid(),
                                    fleet_config=repr(FLEET_CONFIG), server_config=repr(SERVER_CONFIG))
        warm_up(rig)
        gc.collect()
        history.data["probes"]["baseline"] = resources()
        history.data["meta"]["objects"] = dict(baseline=object_counts())
        injector = Injector(rig, rejoin_s)
        injector.worker_node = node
        clock = history.now()
        loops = [threading.Thread(target=fleet_trainer, args=(rig,), name="chaos-fleet-trainer"),
                 threading.Thread(target=server_client, args=(rig, "a"), name="chaos-client-a"),
                 threading.Thread(target=server_client, args=(rig, "b"), name="chaos-client-b"),
                 threading.Thread(target=server_trainer, args=(rig,), name="chaos-server-trainer")]
        [t.start() for t in loops]
        _run_schedule(rig, injector, schedule, clock, duration_s)
        rig.stop.set()
        injector.tick(force=True)  # a node kill still re-joining when the clock ran out
        history.data["meta"]["stuck_loops"] = [t.name for t in loops if (t.join(JOIN_S) or t.is_alive())]
        history.data["meta"]["stuck_faults"] = injector.join(JOIN_S)
        probe = quiesce(rig)
        gc.collect()
        history.data["probes"].update(probe, final=resources(), end_t=history.now())
        history.data["meta"]["objects"]["final"] = object_counts()
    finally:
        saved = history.save(workdir / f"history-{seed}.json")  # whatever happened: the checker judges it
        for closer in (server, worker, fleet):
            if closer is not None:
                closer.close()
        ray.shutdown()
        cluster.shutdown()
    return saved


def _run_schedule(rig: Rig, injector: Injector, schedule, clock: float, duration_s: float) -> None:
    """Inject each fault at its time; sample resources every 2 s meanwhile."""
    pending = list(schedule)
    next_sample = 0.0
    while True:
        elapsed = rig.history.now() - clock
        if elapsed >= duration_s:
            return
        while pending and pending[0].at_s <= elapsed:
            injector.inject(pending.pop(0))
        injector.tick()
        if elapsed >= next_sample:
            rig.history.sample(resources())
            next_sample = elapsed + 2.0
        time.sleep(0.05)
