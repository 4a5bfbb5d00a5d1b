"""Sampling parameters of one rollout request, validated before anything reaches the engine.

Semantics follow `model.generate` and vLLM: `temperature=0` is greedy, `top_k=0` disables top-k (so does -1, vLLM's
and SGLang's spelling, normalised to 0), `top_p=1.0` disables top-p, `min_p=0` disables min-p. The order (vLLM's):
`logit_bias` and `min_new_tokens`, then the repetition, frequency and presence penalties, then temperature, min-p,
top-k, and top-p on the renormalised distribution.
`logprobs` never see any of it (the raw logits / T); `sampling_logprobs` are of the distribution sampled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import check_int, invalid
from .structured import Structured

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs; the sampler's top-k pass and each step's output hold this many
MAX_PENALTY = 2.0  # OpenAI's bound on frequency_penalty and presence_penalty (vLLM's too)
MAX_BIAS = 100.0  # OpenAI's bound on a logit_bias value
TOP_K_OFF = -1  # vLLM's and SGLang's top_k for "disabled" (verl, SkyRL, OpenRLHF send it): taken as 0


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of one prompt.

    n: samples per prompt (they share the prompt's prefill).
    temperature: 0 means greedy; otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 disables (-1, as vLLM, verl, SkyRL and OpenRLHF write it, is stored as 0).
    top_p: keep the smallest set of tokens whose probability reaches top_p; 1.0 disables.
    max_new_tokens: completion budget; a row cut by it finishes with "length".
    stop_token_ids: tokens that end a row (kept in the completion, finish "stop"); None means the model's EOS.
    ignore_eos: generate up to max_new_tokens whatever is sampled.
    seed: when set, each sample draws from its own counter-based random stream keyed on (seed, sample index), so
        its tokens do not depend on what else is in the batch. Any 64-bit signed integer (negative ones too, as
        OpenAI's API takes).
    top_logprobs: at each sampled position, also return the k most likely tokens and their logprobs under the same
        log_softmax(logits / T) as `logprobs` (`RolloutBatch.top_ids` / `top_logprobs`); 0 (the default) returns none
        and costs nothing. At most MAX_TOP_LOGPROBS (20, OpenAI's limit).
    min_p: drop tokens whose probability (after temperature) is below min_p x that of the most likely; 0 disables.
    repetition_penalty: HF / vLLM: every token of the prompt or of the completion so far has its logit divided by it
        if positive, multiplied by it otherwise; 1.0 disables. > 0.
    presence_penalty, frequency_penalty: OpenAI: a token's logit minus presence_penalty if it occurs in the
        completion so far, minus frequency_penalty x its count there; in [-2, 2], 0 disables.
    min_new_tokens: the stop ids (stop_token_ids, or the model's EOS) cannot be sampled before this many tokens.
    logit_bias: {token id: bias} (a mapping, or (id, bias) pairs; kept as sorted pairs), added to the logits; each bias
        in [-100, 100] (OpenAI's range; -100 in effect bans a token).
    structured: a `Structured` (structured.py): the completion must be that JSON / schema / pattern / tool call;
        each step samples only tokens its grammar allows (a stop id only once the grammar is complete). Applied
        after logit_bias and the penalties, before temperature's min-p, top-k and top-p; `logprobs` stay the full
        vocabulary's, `sampling_logprobs` are of the masked distribution (docs/sampling.md). None: unconstrained.
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
    logit_bias: tuple[tuple[int, float], ...] | None = None
    structured: Structured | None = None

    def __post_init__(self) -> None:
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.top_k == TOP_K_OFF and not isinstance(self.top_k, bool):
            object.__setattr__(self, "top_k", 0)  # vLLM's "disabled" in this project's spelling
        self._check()
        self._check_adjustments()

    def _check(self) -> None:
        check_int("n", self.n, 1, "use n >= 1 samples per prompt")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise invalid("temperature", self.temperature, "must be a finite number >= 0",
                          "use 0 for greedy or a positive value such as 1.0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise invalid("top_k", self.top_k, "must be an integer >= 0, or -1 (disabled)",
                          "use 0 (or -1) to disable top-k, or a positive k")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not (0.0 < self.top_p <= 1.0):
            raise invalid("top_p", self.top_p, "must be in (0, 1]", "use 1.0 to disable top-p")
        check_int("max_new_tokens", self.max_new_tokens, 1, "ask for at least 1 new token")
        if self.stop_token_ids is not None:
            for token in self.stop_token_ids:
                check_int("stop_token_ids", token, 0, "pass non-negative token ids")
        if self.seed is not None:
            check_int("seed", self.seed, -2**63, "use a 64-bit signed integer seed, or None", maximum=2**63 - 1)
        check_int("top_logprobs", self.top_logprobs, 0, f"use 0 for none, or at most {MAX_TOP_LOGPROBS} alternatives "
                  "per token", maximum=MAX_TOP_LOGPROBS)

    def _check_adjustments(self) -> None:
        _check_number("min_p", self.min_p, 0.0, 1.0, "use a value in [0, 1]; 0 disables min-p")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise invalid("repetition_penalty", self.repetition_penalty, "must be a finite number > 0",
                          "use 1.0 to disable it, or a value such as 1.1 (> 1 discourages repeats)")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), -MAX_PENALTY, MAX_PENALTY,
                          f"use a value in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]; 0 disables it")
        check_int("min_new_tokens", self.min_new_tokens, 0, "use 0 for none, or at most max_new_tokens",
                  maximum=self.max_new_tokens)
        for token, bias in self.logit_bias or ():
            check_int("logit_bias", token, 0, "key each bias by a non-negative token id")
            _check_number(f"logit_bias[{token}]", bias, -MAX_BIAS, MAX_BIAS,
                          f"use a bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}] (-100 in effect bans the token)")
        self._check_structured()

    def _check_structured(self) -> None:
        if self.structured is None:
            return
        if not isinstance(self.structured, Structured):
            raise invalid("structured", type(self.structured).__name__, "must be a rollout.Structured",
                          "build it with Structured.json_schema(schema), Structured.json_object(), ...")
        for name, clash in (("ignore_eos", self.ignore_eos), ("min_new_tokens", self.min_new_tokens)):
            if clash:  # a complete grammar allows only the stop ids: neither can be honoured with it
                raise invalid(name, clash, "cannot be combined with `structured` (a complete grammar allows only "
                              "the stop ids)", f"drop {name}, or `structured`")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the row asks for penalties, a logit bias or min_new_tokens (the sampler's adjust pass)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_new_tokens > 0 or bool(self.logit_bias))

    @property
    def is_constrained(self) -> bool:
        """Whether the row's tokens are constrained by a grammar (`structured`): cheap, for per-request decisions
        (such rows are never drafted by speculative decoding: their next mask needs the token before it)."""
        return self.structured is not None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(name: str, value: object, low: float, high: float, fix: str) -> None:
    if not _is_number(value) or not math.isfinite(value) or not low <= value <= high:
        raise invalid(name, value, f"must be a finite number in [{low:g}, {high:g}]", fix)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """A logit_bias mapping (or (id, bias) pairs) as pairs sorted by token id; ids and values checked later."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [(token, value) for token, value in items]
    except (TypeError, ValueError):
        raise invalid("logit_bias", bias, "must be a mapping of token id to bias", "pass e.g. {50256: -100}") from None
    if len({token for token, _ in pairs}) != len(pairs):
        raise invalid("logit_bias", bias, "lists a token id twice", "give each token one bias")
    return tuple(sorted(pairs, key=lambda pair: pair[0] if isinstance(pair[0], int) else -1))
