"""Environments for the multi-turn demo (`rollout demo --env NAME`).

`recall`: a two-turn episode whose reward needs the observation. The model speaks first (turn 1, unrewarded);
the environment answers with a secret digit drawn at random for the episode; in turn 2 the reward is the fraction
of the model's tokens that are that digit. A policy that ignores the observation can at best always say the same
digit and earn 1/10 on average (`BLIND_CEILING`); earning more means reading the observation the environment sent.

`recall --rewrite` (`RecallRewrite`): the same episode under a history-rewriting template, as reasoning models' chat
templates drop earlier `<think>` blocks: turn 2 is not generated from prompt + turn 1 + secret but from a re-rendered
context, prompt + secret, with turn 1 dropped (`Turn(context_ids=...)`). Each episode is then two rows (segments), and
reading the secret means reading it in the rewritten context.
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


class RecallRewrite(Recall):
    """Recall whose second turn restarts from the prompt and the secret (the model's first turn dropped)."""

    def __init__(self, digit_ids: list[int], seed: str, prompt: list[int]) -> None:
        super().__init__(digit_ids, seed)
        self.prompt = list(prompt)

    def step(self, completion_ids: list[int]) -> Turn:
        if self.turn == 0:
            self.turn = 1
            return Turn(context_ids=self.prompt + [self.secret])
        return super().step(completion_ids)


class RecallRewriteFactory(RecallFactory):
    """make_env for `RecallRewrite`: as RecallFactory, and it knows each step's prompts (`prompts(step)`), which the
    re-rendered context starts with."""

    def __init__(self, tokenizer, seed: int, prompts) -> None:
        super().__init__(tokenizer, seed)
        self.prompts = prompts

    def __call__(self, prompt_index: int, sample_index: int) -> RecallRewrite:
        return RecallRewrite(self.digit_ids, f"{self.seed}-{self.step}-{prompt_index}",
                             self.prompts(self.step)[prompt_index])


ENVS = {"recall": RecallFactory}
