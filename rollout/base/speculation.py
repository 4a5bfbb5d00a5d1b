"""Speculation: which draft sources a worker speculates with, and how far. Frozen and validated at construction.

Speculation changes what an engine step costs, never the tokens: a draft token is kept only where it is the token
plain decoding would have drawn at that position (the counter-based sampler decides), so rows are bit for bit those
of speculation off. The draft sources themselves are `rollout/engine/speculation/drafts.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import check_int, invalid

DRAFT_SOURCES = ("context", "history", "model")
SPECULATION_MODES = ("auto", "always", "off")
MAX_DRAFT_TOKENS = 32  # drafts longer than this are almost never accepted whole, and cost a wide verify row
MAX_NGRAM = 8


@dataclass(frozen=True)
class Speculation:
    """Draft sources and limits for speculative rollouts (`WorkerConfig.speculation`).

    drafts: the sources, in any order (a list is accepted and stored as a tuple; at least one, no repeats):
        "context" proposes what followed the most recent earlier occurrence of the row's own last tokens (an n-gram
        lookup in its prompt and completion so far); "history" proposes from the completions recorded for the same
        prompt ids (earlier calls and epochs, and samples of the same group that finished earlier in the call);
        "model" runs `draft_model` where no n-gram source proposes (a sampled row's draft tokens are its own draws
        from the draft model, with its params and uniforms, or the draft's argmax where that has lately agreed with
        the policy more often; rollout/engine/speculation/draft_model.py). Where two n-gram sources propose, the longer match
        wins.
    max_draft_tokens: most draft tokens fed after a row's next token in one step, in [1, 32].
    history_memory_mb: what the history index may hold, in MiB (> 0); past it, whole prompts are forgotten least
        recently used first.
    mode: "auto" drafts only where the measured cost says it pays (thin steps, rows whose drafts keep being
        accepted), "always" drafts every row every step, "off" never drafts (the config kept, e.g. to compare).
    draft_model: a smaller causal LM with the policy's vocabulary (a model object or a checkpoint directory),
        required when "model" is in drafts and refused otherwise; the worker checks its vocabulary against the
        policy's at construction.
    min_ngram, max_ngram: the shortest and longest suffix of the row looked up (longest first), 1 <= min <= max <= 8.
        Shorter matches propose more often and are accepted less often.
    """

    drafts: tuple[str, ...] = ("context", "history")
    max_draft_tokens: int = 4
    history_memory_mb: float = 64
    mode: str = "auto"
    draft_model: object | None = None
    min_ngram: int = 2
    max_ngram: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.drafts, list):
            object.__setattr__(self, "drafts", tuple(self.drafts))
        self._check_drafts()
        check_int("max_draft_tokens", self.max_draft_tokens, 1, "use e.g. 4 (drafts past 8 are rarely accepted whole)",
                  MAX_DRAFT_TOKENS)
        memory = self.history_memory_mb
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory > 0 or memory == float("inf"):
            raise invalid("history_memory_mb", memory, "must be a finite number > 0",
                          "use e.g. 64 (MiB); leave 'history' out of drafts to keep no history")
        if self.mode not in SPECULATION_MODES:
            raise invalid("mode", self.mode, f"must be one of {SPECULATION_MODES}",
                          "use 'auto' (draft where it pays), 'always' or 'off'")
        self._check_draft_model()
        check_int("min_ngram", self.min_ngram, 1, f"use e.g. 2; at most max_ngram and {MAX_NGRAM}", MAX_NGRAM)
        check_int("max_ngram", self.max_ngram, self.min_ngram, f"use e.g. 4; at least min_ngram ({self.min_ngram}) "
                  f"and at most {MAX_NGRAM}", MAX_NGRAM)

    def _check_drafts(self) -> None:
        drafts = self.drafts
        if not isinstance(drafts, tuple) or not drafts:
            raise invalid("drafts", drafts, f"must be a non-empty tuple or list of {DRAFT_SOURCES}",
                          "use e.g. ('context', 'history'), or Speculation(mode='off') to not speculate")
        for source in drafts:
            if source not in DRAFT_SOURCES:
                raise invalid("drafts", drafts, f"{source!r} is not a draft source: each must be one of "
                              f"{DRAFT_SOURCES}", "name only 'context', 'history' or 'model'")
        if len(set(drafts)) != len(drafts):
            raise invalid("drafts", drafts, "must not name a source twice", "name each source once")

    def _check_draft_model(self) -> None:
        if "model" in self.drafts and self.draft_model is None:
            raise invalid("draft_model", None, "is required when 'model' is in drafts",
                          "pass draft_model= (a smaller causal LM with the same vocabulary), or drop 'model'")
        if "model" not in self.drafts and self.draft_model is not None:
            raise invalid("draft_model", type(self.draft_model).__name__, "has no use unless 'model' is in drafts",
                          "add 'model' to drafts, or leave draft_model at None")
