"""Stand-in until the drafts branch lands: context n-gram drafts only."""

from __future__ import annotations


class RowDrafts:
    def __init__(self, prompt, n=3):
        self.tokens = list(prompt)
        self.n = n

    def extend(self, tokens):
        self.tokens.extend(tokens)

    def propose(self, k):
        t = self.tokens
        for n in range(self.n, 0, -1):
            if len(t) <= n:
                continue
            key = t[-n:]
            for i in range(len(t) - n - 1, -1, -1):
                if t[i:i + n] == key:
                    return t[i + n:i + n + k]
        return []


class DraftIndex:
    def __init__(self, spec):
        self.spec = spec

    def row(self, prompt):
        return RowDrafts(prompt)

    def record(self, prompt, completion):
        pass

    def clear(self):
        pass

    memory_bytes = 0
