"""Prompt logprobs: each prompt token's logprob given the tokens before it, teacher-forced by the rollout side's own
`score` (rollout.scoring: exact, the forward a trainer runs), in the two shapes clients read.

- OpenAI's legacy completions `echo: true` with `logprobs: k` (what lm-eval's `local-completions` sends for a
  loglikelihood: `echo=True, logprobs=1, max_tokens=1` or `0`): the prompt's tokens come first in `logprobs.tokens`,
  `token_logprobs` (null for the first token: nothing predicts it), `top_logprobs` (null for the first; k entries
  each, or null throughout when k is 0) and `text_offset`, then the completion's.
- vLLM's `prompt_logprobs: k`: one entry per prompt token, null for the first, else `{"<id>": {"logprob", "rank",
  "decoded_token"}}` with the prompt token itself and its k most likely alternatives (rank 1 = the most likely).

A prompt is scored as the pair (its first token, the rest), under the request's temperature (0: the raw
distribution), the log-softmax the completion's logprobs come from, so `token_logprobs` is one distribution throughout
and an alternative listed at k = 1 is bit-identical to the token's own logprob when that token is the most likely (the
check lm-eval's `is_greedy` makes). A worker scores with its engine paused: the generations in flight finish first.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..rollouts.choices import Detokenizer
from ..transport.errors import from_value_error


@dataclass(frozen=True)
class PromptScores:
    """One prompt's positions 1..P-1: the prompt token's logprob and rank, and the most likely tokens there."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def first(self, k: int) -> "PromptScores":
        """The k most likely at each position (one scoring call serves echo's k and prompt_logprobs' k)."""
        return PromptScores(self.logprobs, self.ranks, [ids[:k] for ids in self.top_ids],
                            [values[:k] for values in self.top_logprobs])


EMPTY = PromptScores([], [], [], [])  # a one-token prompt: nothing to score


class PromptScorer:
    """Scores prompts through `rollouts.score(..., top_k=k)` on a thread of its own (never on the event loop)."""

    def __init__(self, rollouts: Any) -> None:
        self.rollouts = rollouts
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-serve-score")

    async def score(self, prompts: list[list[int]], temperature: float, top_k: int) -> list[PromptScores]:
        """Per prompt, its PromptScores with `top_k` alternatives at each position."""
        scored = [i for i, p in enumerate(prompts) if len(p) > 1]
        if not scored:
            return [EMPTY] * len(prompts)
        loop = asyncio.get_running_loop()
        try:
            logprobs, top = await loop.run_in_executor(self._pool, lambda: self.rollouts.score(
                [prompts[i][:1] for i in scored], [prompts[i][1:] for i in scored], temperature=temperature,
                top_k=max(top_k, 1)))  # k >= 1: the ranks come with the alternatives
        except ValueError as error:
            raise from_value_error(error) from None
        out = [EMPTY] * len(prompts)
        for i, values, (ids, alternatives, ranks) in zip(scored, logprobs, top):
            out[i] = PromptScores(values.tolist(), ranks.tolist(), ids[:, :top_k].tolist(),
                                  alternatives[:, :top_k].tolist())
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def echo_logprobs(prompt_ids: list[int], scores: PromptScores, detok: Detokenizer, top_k: int, text: str) -> dict:
    """The prompt's part of a legacy completions `logprobs` object (`text`: the prompt's text as echoed; offsets
    index into it)."""
    top = None
    if top_k:
        top = [None] + [legacy_top(detok, token, value, ids, values) for token, value, ids, values
                        in zip(prompt_ids[1:], scores.logprobs, scores.top_ids, scores.top_logprobs)]
    return {"tokens": [detok.name(t) for t in prompt_ids], "token_logprobs": [None, *scores.logprobs],
            "top_logprobs": top, "text_offset": detok.offsets(prompt_ids, text)}


def legacy_top(detok: Detokenizer, token: int, value: float, ids: list[int], values: list[float]) -> dict:
    """One position of the legacy `top_logprobs` (OpenAI's and vLLM's completions): the k most likely tokens, most
    likely first, and the chosen token when it is not among them (k + 1 keys). The keys are token texts, so tokens
    that decode alike share one key: it holds the most likely of them (return_tokens_as_token_ids names each by
    id, and nothing collapses)."""
    top: dict[str, float] = {}
    for other, other_value in zip([*ids, token], [*values, value]):
        top.setdefault(detok.name(other), other_value)
    return top


def joined(prompt: dict, completion: dict) -> dict:
    """The prompt's logprobs object followed by the completion's (offsets already shifted past the prompt)."""
    top = None if prompt["top_logprobs"] is None else prompt["top_logprobs"] + (completion["top_logprobs"] or [])
    return {key: prompt[key] + completion[key] for key in ("tokens", "token_logprobs", "text_offset")} | \
        {"top_logprobs": top}


def vllm_prompt_logprobs(prompt_ids: list[int], scores: PromptScores, detok: Detokenizer) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null, then per position the prompt token and the alternatives scored."""
    out: list[dict | None] = [None]
    for i, token in enumerate(prompt_ids[1:]):
        entry = {str(token): _logprob(scores.logprobs[i], scores.ranks[i], detok.name(token))}
        for rank, (other, value) in enumerate(zip(scores.top_ids[i], scores.top_logprobs[i]), 1):
            entry.setdefault(str(other), _logprob(value, rank, detok.name(other)))
        out.append(entry)
    return out


def _logprob(value: float, rank: int, name: str) -> dict:
    return {"logprob": value, "rank": rank, "decoded_token": name}
