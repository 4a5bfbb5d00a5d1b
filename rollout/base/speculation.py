"""Speculation (temporary stand-in until the drafts branch lands)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Speculation:
    drafts: tuple[str, ...] = ("context", "history")
    max_draft_tokens: int = 4
    history_memory_mb: float = 64
    mode: str = "auto"
    draft_model: object | None = None
    min_ngram: int = 2
    max_ngram: int = 4
