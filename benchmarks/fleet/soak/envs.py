"""Environments for the soak's episodes: each answers with an observation and reward that depend only on its
episode and turn; a faulty one raises, hangs past the call's env_timeout, or answers a token id outside the
vocabulary at its `fault_turn`. Module-level and plain, so Ray pickles them to the actors (the driver registers this
module to be pickled by value: the actors need not import benchmarks/)."""

from __future__ import annotations

import time

from rollout import Turn

# what each faulty kind puts in the episode's error, as the engine reports it (the checker reads these)
ERROR_TEXT = {"env_raise": "chaos: environment raised", "env_hang": "env_timeout",
              "env_garbage": "outside the vocabulary"}
GARBAGE_ID = 10**6


class ChaosEnv:
    def __init__(self, key: tuple[int, int], fault: str | None, hang_s: float, fault_turn: int = 1) -> None:
        self.key, self.fault, self.hang_s, self.fault_turn = key, fault, hang_s, fault_turn
        self.turns = 0

    def observation(self) -> list[int]:
        p, s = self.key
        return [(31 + 7 * p + 3 * s + 11 * self.turns + i) % 480 + 10 for i in range(5)]

    def step(self, completion_ids: list[int]) -> Turn:
        self.turns += 1
        if self.fault and self.turns == self.fault_turn:
            if self.fault == "env_raise":
                raise RuntimeError(ERROR_TEXT["env_raise"])
            if self.fault == "env_hang":
                time.sleep(self.hang_s)
            if self.fault == "env_garbage":
                return Turn([5, GARBAGE_ID])
        return Turn(observation_ids=self.observation(), reward=float(len(completion_ids) % 2))


class ChaosEnvs:
    """make_env: `faulty` maps (prompt_index, sample_index) to a fault kind; every other episode is healthy."""

    def __init__(self, faulty: dict | None = None, hang_s: float = 3.0) -> None:
        self.faulty = dict(faulty or {})
        self.hang_s = hang_s

    def __call__(self, prompt_index: int, sample_index: int) -> ChaosEnv:
        return ChaosEnv((prompt_index, sample_index), self.faulty.get((prompt_index, sample_index)), self.hang_s)
