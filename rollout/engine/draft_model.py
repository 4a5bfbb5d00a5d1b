"""The "model" draft source: a smaller causal LM with the policy's vocabulary proposes a row's next tokens greedily.

Each row keeps the draft model's KV of what it fed last time (a transformers `DynamicCache`, batch of one). At a
step the cache is cut back to the longest prefix of that which the row still holds (a rejected draft's KV goes),
the row's tokens since are fed in one forward, then k tokens are decoded one at a time, each the draft model's
argmax. A draft token is kept only where the policy's own draw at that position is the same token, so the draft
model changes what a step costs, never a token; where its forwards cost more than its drafts save, "auto" measures it
(the lookup seconds per offered row) and drafts less.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base.errors import invalid


class DraftModel:
    """A draft model on the policy's device; `source(tokens)` gives a row its drafter."""

    def __init__(self, model: Any, policy_vocab: int) -> None:
        self.model = model.eval()
        self.policy_vocab = policy_vocab  # a draft id at or past it is cut (the policy could not read it)

    @classmethod
    def checked(cls, draft: Any, policy: Any, same_tokenizer: bool = False) -> "DraftModel":
        """The draft model, after the check that it drafts in the policy's ids: as many ids as the policy reads,
        unless the worker found both tokenizers the same (`same_tokenizer`: embeddings may then be padded to other
        sizes, and a draft id past the policy's is cut). A ValueError names speculation.draft_model otherwise."""
        policy_ids, draft_ids = vocab_size(policy), vocab_size(draft)
        if not same_tokenizer and draft_ids != policy_ids:
            raise invalid("speculation.draft_model", f"{draft_ids} token ids",
                          f"must have the policy's vocabulary ({policy_ids} ids)",
                          "use a draft model of the policy's family, trained with its tokenizer")
        return cls(draft, policy_ids)

    def source(self, tokens: list[int]) -> "ModelSource":
        return ModelSource(self, tokens)

    @torch.inference_mode()
    def greedy(self, source: "ModelSource", k: int) -> list[int]:
        """Up to k argmax tokens that continue `source.tokens`; `source`'s cache and fed ids are updated."""
        tokens = source.tokens
        # a row's tokens only grow: the first `source.held` are those of the last call, all fed then
        keep = source.held + common_prefix(source.fed[source.held:], tokens[source.held:])
        keep = min(keep, len(tokens) - 1)  # at least one token is fed: its logits start the draft
        cache = source.cache
        if cache is None or keep == 0:
            from transformers import DynamicCache

            cache, keep = DynamicCache(), 0
        else:
            crop(cache, keep)
        device = next(self.model.parameters()).device
        fed = list(tokens)
        logits = self.model(input_ids=torch.tensor([tokens[keep:]], device=device), past_key_values=cache,
                            use_cache=True).logits
        draft: list[int] = []
        while True:
            token = int(logits[0, -1].argmax())
            if token >= self.policy_vocab:
                break
            draft.append(token)
            if len(draft) == k:
                break
            logits = self.model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache,
                                use_cache=True).logits
            fed.append(token)
        source.cache, source.fed, source.held = cache, fed, len(tokens)
        return draft


class ModelSource:
    """One row's drafter on the draft model: proposes from the row's tokens whatever its last n-gram is."""

    name = "model"
    keyed = False  # proposes without an n-gram match (RowDrafts asks it where no n-gram source proposes)

    def __init__(self, runner: DraftModel, tokens: list[int]) -> None:
        self.runner, self.tokens = runner, tokens  # tokens: the row's list, extended by its RowDrafts
        self.cache: Any = None
        self.fed: list[int] = []  # the ids whose KV the cache holds, in order
        self.held = 0  # len(tokens) at the last draft: every one of them is in `fed`

    def advance(self) -> None:
        pass

    def draft(self, k: int) -> list[int]:
        return self.runner.greedy(self, k)


def vocab_size(model: Any) -> int:
    """How many token ids the model reads (its input embedding's rows)."""
    return int(model.get_input_embeddings().weight.shape[0])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def crop(cache: Any, keep: int) -> None:
    """Cut every layer of a DynamicCache to its first `keep` positions."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        for layer in cache.layers:
            layer.crop(-remove)
