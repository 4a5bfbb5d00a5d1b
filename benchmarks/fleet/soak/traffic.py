"""The soak's steady traffic, as a trainer and agent harnesses would drive the rollout side, every call recorded:

- the fleet trainer: generate, submit with a weight update landing mid-call (each in-flight mode in turn), episodes,
  score, and a RolloutCollector (over-sampling, partial rollouts carried across updates);
- the server clients: token-in/token-out and streamed completions over loopback HTTP, mostly seeded;
- the server's trainer: weight updates of the served worker, in every in-flight mode.

`Rig` is what the driver built; these loops only use it. Every call goes through `FleetCalls` (fleet) or
`client.Http` (server), which record what was sent, the versions and what came back.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any

from rollout import RolloutCollector, SamplingParams

from .envs import ChaosEnvs
from .history import History, error_of, rows_of

MODES = ("wait", "abort", "recompute", "keep")


@dataclass
class Rig:
    history: History
    versions: Any  # weights.Versions
    fleet: Any
    worker: Any
    http: Any  # client.Http
    stop: threading.Event
    seed: int
    cluster: Any = None
    vocab: int = 512
    context: int = 1024
    update_lock: threading.Lock = field(default_factory=threading.Lock)  # one fleet update at a time


def params_dict(p: SamplingParams) -> dict:
    return dict(n=p.n, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, max_new_tokens=p.max_new_tokens,
                seed=p.seed, ignore_eos=p.ignore_eos)


def draw_params(rng: random.Random, max_new: int = 32) -> SamplingParams:
    """A request's sampling: mostly seeded (replayable), temperatures, top-k / top-p and greedy rows mixed."""
    kind = rng.random()
    temperature, top_k, top_p = (0.0, 0, 1.0) if kind < 0.15 else (rng.choice([1.0, 0.7, 1.3]), 0, 1.0)
    if 0.15 <= kind < 0.3:
        top_k = 20
    elif 0.3 <= kind < 0.4:
        top_p = 0.9
    seed = rng.randrange(1 << 20) if rng.random() < 0.8 else None
    return SamplingParams(n=rng.randint(1, 3), temperature=temperature, top_k=top_k, top_p=top_p,
                          max_new_tokens=rng.randint(4, max_new), seed=seed, ignore_eos=rng.random() < 0.5)


def draw_prompts(rng: random.Random, count: int, max_len: int = 40) -> list[list[int]]:
    return [[rng.randrange(10, 500) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


class FleetCalls:
    """Fleet calls, each recorded: begin (what was sent, the version), then exactly one end."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig

    def _begin(self, op: str, prompts, params, fault: int | None, **sent) -> dict:
        sent = dict(prompts=prompts, params=[params_dict(p) for p in params], **sent)
        return self.rig.history.begin("fleet", op, sent, self.rig.fleet.policy_version, fault)

    def _end_ok(self, call: dict, batch, params) -> Any:
        self.rig.history.end(call, "ok", self.rig.fleet.policy_version, rows=rows_of(batch, params))
        return batch

    def _end_error(self, call: dict, exc: BaseException) -> None:
        outcome = "cancelled" if isinstance(exc, CancelledError) else "error"
        self.rig.history.end(call, outcome, self.rig.fleet.policy_version, error=error_of(exc))

    def generate(self, prompts, params, op: str = "generate", fault: int | None = None, timeout: float | None = None,
                 env: ChaosEnvs | None = None, max_turns: int = 1, env_timeout: float | None = None) -> Any:
        episode = None if env is None else dict(faulty={f"{p},{s}": k for (p, s), k in env.faulty.items()},
                                                hang_s=env.hang_s, max_turns=max_turns, env_timeout=env_timeout)
        call = self._begin(op, prompts, params, fault, timeout=timeout, episode=episode)
        kwargs = {} if env is None else dict(env=env, max_turns=max_turns, env_timeout=env_timeout)
        try:
            batch = self.rig.fleet.generate(prompts, params, timeout=timeout, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every outcome is recorded; the checker judges it
            self._end_error(call, exc)
            return None
        return self._end_ok(call, batch, params)

    def submit(self, prompts, params, op: str = "submit", fault: int | None = None, cancel_after: float | None = None,
               during=None) -> Any:
        """Submit; run `during()` (a weight update) or cancel after `cancel_after` seconds; collect."""
        call = self._begin(op, prompts, params, fault, cancel_after=cancel_after)
        try:
            future = self.rig.fleet.submit(prompts, params)
            if during is not None:
                time.sleep(0.3)
                during()
            if cancel_after is not None:
                time.sleep(cancel_after)
                future.cancel()
            batch = future.result(timeout=600)
        except BaseException as exc:  # noqa: BLE001
            self._end_error(call, exc)
            return None
        return self._end_ok(call, batch, params)

    def score(self, rows: list[dict]) -> None:
        prompts, completions = [r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows]
        call = self.rig.history.begin("fleet", "score", dict(prompts=prompts, completions=completions),
                                      self.rig.fleet.policy_version)
        try:
            scores = self.rig.fleet.score(prompts, completions)
        except BaseException as exc:  # noqa: BLE001
            self._end_error(call, exc)
            return
        self.rig.history.end(call, "ok", self.rig.fleet.policy_version, scores=[s.tolist() for s in scores])

    def update(self, mode: str) -> None:
        rig = self.rig
        with rig.update_lock:
            version = rig.fleet.policy_version + 1
            t0 = rig.history.now()
            try:
                rig.fleet.update_weights(rig.versions[version], version=version, in_flight=mode)
                rig.history.update("fleet", version, mode, t0, rig.fleet.weights_fingerprint())
            except BaseException as exc:  # noqa: BLE001 - recorded; a failed update is a violation unless explained
                rig.history.update("fleet", version, mode, t0, None, error=error_of(exc))


def fleet_trainer(rig: Rig, step_s: float = 0.0) -> None:
    """One loop of a trainer on the fleet: a plain call, a call with an update landing mid-call (modes in turn),
    episodes, a score of rows just made, and every few steps a collector across an update."""
    rng, calls = random.Random(f"fleet-trainer-{rig.seed}"), FleetCalls(rig)
    step = 0
    while not rig.stop.is_set():
        step += 1
        for action in _trainer_step(rig, rng, calls, step):
            if rig.stop.is_set():
                return
            action()
        time.sleep(step_s)


def _trainer_step(rig: Rig, rng: random.Random, calls: FleetCalls, step: int) -> list:
    prompts = draw_prompts(rng, rng.randint(2, 6))
    params = [draw_params(rng) for _ in prompts]
    made = []
    mode = MODES[step % len(MODES)]
    long = [SamplingParams(n=2, max_new_tokens=rng.randint(24, 64), ignore_eos=True, seed=rng.randrange(1 << 20))
            for _ in range(3)]
    long_prompts, env_prompts = draw_prompts(rng, 3), draw_prompts(rng, 2, 20)
    actions = [
        lambda: made.append(calls.generate(prompts, params)),
        lambda: calls.submit(long_prompts, long, op="submit_update", during=lambda: calls.update(mode)),
        lambda: calls.generate(env_prompts, [SamplingParams(n=2, max_new_tokens=8, ignore_eos=True)] * 2,
                               op="episodes", env=ChaosEnvs(), max_turns=3, env_timeout=30.0),
        lambda: made[0] is not None and len(made[0]) and calls.score(rows_of(made[0], params)[:4]),
    ]
    if step % 4 == 0:
        actions.append(lambda: collect(rig, rng, calls))
    return actions


def collect(rig: Rig, rng: random.Random, calls: FleetCalls) -> None:
    """A collector over 8 prompts: two batches of 2 groups with an update between (partial rollouts carried)."""
    prompts = draw_prompts(rng, 8, 24)
    sampling = SamplingParams(n=2, max_new_tokens=24, seed=rng.randrange(1 << 20))
    call = rig.history.begin("fleet", "collector", dict(prompts=prompts, params=[params_dict(sampling)]),
                             rig.fleet.policy_version)
    rows: list[dict] = []
    try:
        with RolloutCollector(rig.fleet, prompts, sampling, reward_fn=lambda g: (g.completion_lengths % 2).float(),
                              over_sample=1.5, partial=True, max_staleness=1) as collector:
            for k in range(2):
                batch = collector.next_batch(2, timeout=600)
                rows += rows_of(batch, [sampling] * len(prompts))
                if k == 0:
                    calls.update(rng.choice(MODES))
    except BaseException as exc:  # noqa: BLE001
        rig.history.end(call, "error", rig.fleet.policy_version, rows=rows, error=error_of(exc))
        return
    rig.history.end(call, "ok", rig.fleet.policy_version, rows=rows)


def server_client(rig: Rig, name: str) -> None:
    """An agent-harness-like client: token-in/token-out calls and streamed completions, one at a time."""
    rng = random.Random(f"server-client-{rig.seed}-{name}")
    while not rig.stop.is_set():
        prompt = draw_prompts(rng, 1)[0]
        p = draw_params(rng, max_new=48)
        sp = dict(n=p.n, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, max_tokens=p.max_new_tokens,
                  ignore_eos=p.ignore_eos, **({} if p.seed is None else {"seed": p.seed}))
        if rng.random() < 0.5:
            rig.http.generate(prompt, sp)
        else:
            rig.http.stream(prompt, sp)


def server_trainer(rig: Rig, every_s: float = 4.0) -> None:
    """Updates of the served worker's weights, every in-flight mode in turn."""
    rng = random.Random(f"server-trainer-{rig.seed}")
    k = 0
    while not rig.stop.wait(rng.uniform(0.5, 1.5) * every_s):
        k += 1
        mode, version = MODES[k % len(MODES)], rig.worker.policy_version + 1
        t0 = rig.history.now()
        try:
            rig.worker.update_weights(rig.versions[version], version=version, in_flight=mode)
            rig.history.update("server", version, mode, t0, rig.worker.weights_fingerprint())
        except BaseException as exc:  # noqa: BLE001
            rig.history.update("server", version, mode, t0, None, error=error_of(exc))
