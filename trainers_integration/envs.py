"""Environments for the multi-turn demo (`rollout demo --env NAME`).

`recall`: a two-turn episode whose reward needs the observation. The model speaks first (turn 1, unrewarded);
the environment answers with a secret digit drawn at random for the episode; in turn 2 the reward is the fraction
of the model's tokens that are that digit. A policy that ignores the observation can at best always say the same
digit and earn 1/10 on average (`BLIND_CEILING`); earning more means reading the observation the environment sent.
"""

from __future__ import annotations

import random

from rollout import Turn

DIGITS = tuple(str(d) for d in range(10))
BLIND_CEILING = 1 / len(DIGITS)  # the best mean reward of a policy that never reads the observation


class Recall:
    """One episode: turn 1 gets the secret digit as its observation; turn 2 is scored against it."""

    def __init__(self, digit_ids: list[int], seed: str) -> None:
        self.secret = random.Random(seed).choice(digit_ids)
        self.turn = 0

    def step(self, completion_ids: list[int]) -> Turn:
        self.turn += 1
        if self.turn == 1:
            return Turn(observation_ids=[self.secret])
        hits = sum(1 for t in completion_ids if t == self.secret)
        return Turn(reward=hits / len(completion_ids), done=True)


class RecallFactory:
    """make_env for `Recall`: the secret depends on the step, the prompt and the seed (the n samples of a prompt
    share it, so GRPO's group compares answers to the same question). Picklable, for a fleet."""

    def __init__(self, tokenizer, seed: int) -> None:
        self.digit_ids = [tokenizer.convert_tokens_to_ids(d) for d in DIGITS]
        self.seed, self.step = seed, 0

    def __call__(self, prompt_index: int, sample_index: int) -> Recall:
        return Recall(self.digit_ids, f"{self.seed}-{self.step}-{prompt_index}")


ENVS = {"recall": RecallFactory}
