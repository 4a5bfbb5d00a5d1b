"""The faults, one function per kind, each recorded in the history when injected (`history.fault`).

Infrastructure faults act on the rig (kill an actor, kill the Ray worker node and add a new one, make an engine
thread raise at its next step, sleep/wake); request faults are calls that carry the fault (an environment that
raises / hangs / answers garbage, a cancel, a timeout, a client that drops its stream, a burst that exhausts the
server's tiny KV cache, oversized and malformed bodies), recorded with the fault's id.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from rollout import SamplingParams

from .client import bad_bodies
from .envs import ChaosEnvs
from .schedule import Fault
from .traffic import FleetCalls, Rig, draw_params, draw_prompts

ENGINE_FAULT = "chaos: injected engine fault"


def arm_engine_death() -> Callable:
    """A function that, run in a process, makes that process's next engine step raise ENGINE_FAULT (once). Nested,
    so Ray pickles it by value into an actor (`actor.__ray_call__`); the patch stays installed, disarmed."""

    def arm(_self=None) -> None:
        from rollout.engine.upstream.runner import RolloutModelRunner

        original = getattr(RolloutModelRunner, "_chaos_original", None)
        if original is None:
            original = RolloutModelRunner._forward_process_and_sample
            RolloutModelRunner._chaos_original = original
        armed = [True]

        def flaky(self, *args):
            if armed[0]:
                armed[0] = False
                raise RuntimeError("chaos: injected engine fault")
            return original(self, *args)

        RolloutModelRunner._forward_process_and_sample = flaky

    return arm


class Injector:
    def __init__(self, rig: Rig, rejoin_s: float = 5.0) -> None:
        self.rig, self.rejoin_s = rig, rejoin_s
        self.calls = FleetCalls(rig)
        self.threads: list[threading.Thread] = []
        self.worker_node = None  # the Ray node the driver may kill (never the head)
        self.rejoin_at: float | None = None

    def inject(self, fault: Fault) -> None:
        """Start `fault` on its own thread (a fault that waits, e.g. a hang or a re-join, does not delay the next)."""
        thread = threading.Thread(target=getattr(self, fault.kind), args=(fault,), name=f"chaos-{fault.kind}",
                                  daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]

    def _record(self, fault: Fault, target: str, detail: str = "") -> None:
        self.rig.history.fault(fault.kind, fault.id, target, detail)

    # ------------------------------------------------------------------ infrastructure
    def actor_kill(self, fault: Fault) -> None:
        import ray

        actors = self.rig.fleet.actors
        slot = fault.arg % len(actors)
        self._record(fault, f"fleet actor {slot}")
        ray.kill(actors[slot], no_restart=True)

    def node_kill(self, fault: Fault) -> None:
        """Kill the worker node's raylet and every process on it; a new node joins `rejoin_s` later (`tick`, on the
        main thread: Ray starts a node only there)."""
        cluster = self.rig.cluster
        if cluster is None or self.worker_node is None:
            return
        node, self.worker_node = self.worker_node, None
        self._record(fault, "ray worker node", f"re-joins after {self.rejoin_s}s")
        cluster.remove_node(node, allow_graceful=False)
        self.rejoin_at = time.monotonic() + self.rejoin_s

    def tick(self, force: bool = False) -> None:
        """On the main thread: a killed node's replacement joins once its time has come (or now, with `force`)."""
        if self.rejoin_at is not None and (force or time.monotonic() >= self.rejoin_at):
            self.rejoin_at = None
            self.worker_node = self.rig.cluster.add_node(num_cpus=1)

    def engine_death_fleet(self, fault: Fault) -> None:
        actors = self.rig.fleet.actors
        slot = fault.arg % len(actors)
        self._record(fault, f"fleet actor {slot} engine thread")
        try:
            actors[slot].__ray_call__.remote(arm_engine_death())
        except Exception:  # noqa: BLE001 - the actor may be dead already (another fault)
            pass

    def engine_death_server(self, fault: Fault) -> None:
        self._record(fault, "server worker engine thread")
        arm_engine_death()()

    def sleep_wake_fleet(self, fault: Fault) -> None:
        self._record(fault, "fleet", "sleep, then wake")
        self.rig.fleet.sleep()
        time.sleep(0.2 + fault.arg % 10 / 10)
        self.rig.fleet.wake()

    def sleep_wake_server(self, fault: Fault) -> None:
        self._record(fault, "server worker", "sleep, then wake")
        self.rig.worker.sleep()
        time.sleep(0.2 + fault.arg % 10 / 10)
        self.rig.worker.wake()

    # ------------------------------------------------------------------ requests that carry the fault
    def _env_fault(self, fault: Fault) -> None:
        rng = random.Random(fault.arg)
        prompts = draw_prompts(rng, 3, 20)
        faulty = {(p, s): fault.kind for p in range(3) for s in range(2) if rng.random() < 0.5} or \
            {(0, 0): fault.kind}
        self._record(fault, "fleet episodes", f"{len(faulty)} of 6 episodes")
        self.calls.generate(prompts, [SamplingParams(n=2, max_new_tokens=6, ignore_eos=True)] * 3, op="episodes",
                            fault=fault.id, env=ChaosEnvs(faulty, hang_s=2.5), max_turns=3, env_timeout=1.0)

    env_raise = env_hang = env_garbage = _env_fault

    def _fleet_request(self, fault: Fault, target: str) -> tuple[random.Random, list, list]:
        rng = random.Random(fault.arg)
        prompts = draw_prompts(rng, 3)
        self._record(fault, target)
        return rng, prompts, [draw_params(rng, 64) for _ in prompts]

    def cancel(self, fault: Fault) -> None:
        rng, prompts, params = self._fleet_request(fault, "fleet submit")
        self.calls.submit(prompts, params, op="cancel", fault=fault.id, cancel_after=rng.uniform(0.0, 1.0))

    def timeout(self, fault: Fault) -> None:
        rng, prompts, params = self._fleet_request(fault, "fleet generate")
        self.calls.generate(prompts, params, op="timeout", fault=fault.id, timeout=rng.uniform(0.05, 1.5))

    def disconnect(self, fault: Fault) -> None:
        rng = random.Random(fault.arg)
        prompt = draw_prompts(rng, 1)[0]
        sp = dict(n=rng.randint(1, 3), max_tokens=400, ignore_eos=True, seed=rng.randrange(1 << 20))
        if rng.random() < 0.7:
            self._record(fault, "server stream", "the client closes the connection mid-stream")
            self.rig.http.stream(prompt, sp, drop_after=rng.randint(1, 8), fault=fault.id)
        else:
            self._record(fault, "server generate", "the client times out and closes the connection")
            self.rig.http.generate(prompt, sp, op="disconnect", fault=fault.id, timeout=rng.uniform(0.1, 1.0))

    def kv_exhaustion(self, fault: Fault) -> None:
        """A burst of long rows at once: more KV than the server's tiny cache holds (preemptions, no failure)."""
        rng = random.Random(fault.arg)
        self._record(fault, "server KV cache", "8 concurrent calls of 3 x 96 tokens")
        burst = [threading.Thread(target=self.rig.http.generate, args=(
            draw_prompts(rng, 1, 60)[0], dict(n=3, max_tokens=96, ignore_eos=True, seed=rng.randrange(1 << 20))),
            kwargs=dict(op="kv_burst", fault=fault.id)) for _ in range(8)]
        [t.start() for t in burst]
        [t.join() for t in burst]

    def _bad(self, fault: Fault, oversized: bool) -> None:
        bodies = [b for b in bad_bodies(self.rig.vocab, self.rig.context) if ("oversized" in b[3]) == oversized]
        path, body, param, label = bodies[fault.arg % len(bodies)]
        self._record(fault, f"server {path}", label)
        self.rig.http.bad(path, body, param, label, fault.id)

    def oversized(self, fault: Fault) -> None:
        self._bad(fault, True)

    def malformed(self, fault: Fault) -> None:
        self._bad(fault, False)
