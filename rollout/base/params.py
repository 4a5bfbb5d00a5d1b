"""Sampling parameters of one rollout request, validated before anything reaches the engine.

Semantics follow `model.generate` and vLLM: `temperature=0` is greedy, `top_k=0` disables top-k, `top_p=1.0`
disables top-p. Truncation order is temperature, then top-k, then top-p on the renormalised top-k distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import check_int, invalid

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs; the sampler's top-k pass and each step's output hold this many

# Controls other engines offer that this one cannot honour per request, with their neutral values. They are fields
# so that asking for them is a ValueError naming them, never a silent drop (transformers' engine drops several of
# these with only a warning).
UNSUPPORTED = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
               "min_new_tokens": 0}


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of one prompt.

    n: samples per prompt (they share the prompt's prefill).
    temperature: 0 means greedy; otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 disables.
    top_p: keep the smallest set of tokens whose probability reaches top_p; 1.0 disables.
    max_new_tokens: completion budget; a row cut by it finishes with "length".
    stop_token_ids: tokens that end a row (kept in the completion, finish "stop"); None means the model's EOS.
    ignore_eos: generate up to max_new_tokens whatever is sampled.
    seed: when set, each sample draws from its own counter-based random stream keyed on (seed, sample index), so
        its tokens do not depend on what else is in the batch.
    top_logprobs: at each sampled position, also return the k most likely tokens and their logprobs under the same
        log_softmax(logits / T) as `logprobs` (`RolloutBatch.top_ids` / `top_logprobs`); 0 (the default) returns none
        and costs nothing. At most MAX_TOP_LOGPROBS (20, OpenAI's limit).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check()

    def _check(self) -> None:
        for key, neutral in UNSUPPORTED.items():
            if getattr(self, key) != neutral:
                raise invalid(key, getattr(self, key), "this engine cannot apply it per request",
                              f"leave it at {neutral} (supported: n, temperature, top_k, top_p, max_new_tokens, "
                              "stop_token_ids, ignore_eos, seed, top_logprobs)")
        check_int("n", self.n, 1, "use n >= 1 samples per prompt")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise invalid("temperature", self.temperature, "must be a finite number >= 0",
                          "use 0 for greedy or a positive value such as 1.0")
        check_int("top_k", self.top_k, 0, "use 0 to disable top-k, or a positive k")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not (0.0 < self.top_p <= 1.0):
            raise invalid("top_p", self.top_p, "must be in (0, 1]", "use 1.0 to disable top-p")
        check_int("max_new_tokens", self.max_new_tokens, 1, "ask for at least 1 new token")
        if self.stop_token_ids is not None:
            for token in self.stop_token_ids:
                check_int("stop_token_ids", token, 0, "pass non-negative token ids")
        if self.seed is not None:
            check_int("seed", self.seed, 0, "use a non-negative integer seed or None")
        check_int("top_logprobs", self.top_logprobs, 0, f"use 0 for none, or at most {MAX_TOP_LOGPROBS} alternatives "
                  "per token", maximum=MAX_TOP_LOGPROBS)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
