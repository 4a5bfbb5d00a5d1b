"""Drafts that replay a plain run: what speculation costs and gains when its drafts are right, whatever a real draft
source would find.

`ReplayDrafts` stands in for the engine's `DraftIndex` (same `row` / `record` / `clear` / `memory_bytes`): a row whose
tokens so far are the start of a recorded sequence (prompt + completion of a plain run) is proposed what that run
sampled next, except that every `wrong_every`-th position is proposed another token (so rejection and rollback are
exercised too). Patch it in with `monkeypatch.setattr(rollout.engine.speculation.speculator, "DraftIndex", ReplayDrafts(...))`.
"""

from __future__ import annotations

from collections.abc import Sequence


class ReplayRow:
    def __init__(self, sequences: list[list[int]], prompt: Sequence[int], vocab_size: int, wrong_every: int) -> None:
        self.sequences, self.tokens = sequences, list(prompt)
        self.vocab_size, self.wrong_every = vocab_size, wrong_every

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        n = len(self.tokens)
        for sequence in self.sequences:
            if sequence[:n] == self.tokens:
                return [self._wrong(t) if (n + i) % self.wrong_every == 0 else t
                        for i, t in enumerate(sequence[n:n + k])]
        return []

    def _wrong(self, token: int) -> int:
        return token + 1 if token + 1 < self.vocab_size else token - 1


class ReplayDrafts:
    """A draft index that replays full sequences (prompt + completion) of a plain run."""

    def __init__(self, sequences: list[list[int]], vocab_size: int, wrong_every: int = 3) -> None:
        self.sequences, self.vocab_size, self.wrong_every = sequences, vocab_size, wrong_every
        self.recorded = 0
        self.memory_bytes = 0

    @classmethod
    def of_batch(cls, batch, vocab_size: int, wrong_every: int = 3) -> "ReplayDrafts":
        """The sequences of a `RolloutBatch`."""
        return cls([list(batch.prompt_ids[r]) + batch.completion_ids[r, : int(batch.completion_lengths[r])].tolist()
                    for r in range(len(batch))], vocab_size, wrong_every)

    def __call__(self, spec, draft_model=None) -> "ReplayDrafts":  # stands in for DraftIndex(spec, draft_model)
        return self

    def row(self, prompt: Sequence[int], sampling=None) -> ReplayRow:
        return ReplayRow(self.sequences, prompt, self.vocab_size, self.wrong_every)

    def record(self, prompt, completion) -> None:
        self.recorded += 1

    def clear(self) -> None:
        pass
