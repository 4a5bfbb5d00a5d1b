"""The "model" draft source: a smaller causal LM with the policy's vocabulary proposes a row's next tokens.

Each row keeps the draft model's KV of what it fed last time (a transformers `DynamicCache`, batch of one). At a
step the cache is cut back to the longest prefix of that which the row still holds (a rejected draft's KV goes),
the row's tokens since are fed in one forward, then k tokens are decoded one at a time.

Which token a draft position proposes: a greedy row's is the draft model's argmax. A sampled row's is either
- the coupled draw: the row's own draw (sampler.py: its temperature, top-k, top-p, min-p, and its uniform at that
  position, by inverse CDF in vocabulary order) from the draft model's logits. The policy draws with the same
  uniform, so where the two distributions are close both draws are the same token (benchmarks/speculation/draft_agreement.py,
  the stdlib policy at T = 1: 64% of draws at total variation 0.06 against 39% for the argmax, 100% for the policy
  itself); but the CDFs are in vocabulary order, so a far draft (TV past ~0.3) agrees less often than its argmax
  does (12% against 16% at TV 0.65); or
- the argmax, which agrees where the policy happens to draw the draft's mode.
`Agreement` counts, at each sampled row's first draft position, which of the two the policy really drew, and the
draft model proposes with the one that has agreed more often lately (the coupled draw to start with). A draft token
is kept only where the policy's own draw at that position is the same token, so none of this changes a token, only
how many are kept; where the draft forwards cost more than they save, "auto" measures it (the lookup seconds per
offered row) and drafts less.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...base.errors import invalid
from ..sampling.sampler import RowSpec, SamplingRows, sample_rows


class DraftModel:
    """A draft model on the policy's device; `source(tokens)` gives a row its drafter."""

    def __init__(self, model: Any, policy_vocab: int) -> None:
        self.model = model.eval()
        self.policy_vocab = policy_vocab  # draft logits at or past it are cut (the policy could not read those ids)
        self.agreement = Agreement()

    @classmethod
    def checked(cls, draft: Any, policy: Any, same_tokenizer: bool = False) -> "DraftModel":
        """The draft model, after the check that it drafts in the policy's ids: as many ids as the policy reads,
        unless the worker found both tokenizers the same (`same_tokenizer`: embeddings may then be padded to other
        sizes, and the draft's logits past the policy's ids are cut). A ValueError names speculation.draft_model
        otherwise."""
        policy_ids, draft_ids = vocab_size(policy), vocab_size(draft)
        if not same_tokenizer and draft_ids != policy_ids:
            raise invalid("speculation.draft_model", f"{draft_ids} token ids",
                          f"must have the policy's vocabulary ({policy_ids} ids)",
                          "use a draft model of the policy's family, trained with its tokenizer")
        return cls(draft, policy_ids)

    def source(self, tokens: list[int], sampling: RowSpec | None = None) -> "ModelSource":
        """A row's drafter; `sampling`: the row's params and stream key (None: argmax drafts)."""
        return ModelSource(self, tokens, sampling)

    @torch.inference_mode()
    def draft(self, source: "ModelSource", k: int) -> list[int]:
        """k tokens that continue `source.tokens`: the coupled draws or the argmaxes, as `agreement` leads (module
        docstring); `source`'s cache and fed ids are updated."""
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
        if source.check is not None and len(tokens) > source.check[0]:  # what the policy drew at the first one
            index, coupled, argmax = source.check
            self.agreement.observe(coupled == tokens[index], argmax == tokens[index])
        sampled = source.sampling is not None and not source.sampling.params.is_greedy
        coupled = sampled and self.agreement.coupled_leads
        draft: list[int] = []
        while True:
            # the row's next token is sampled at the position of its last one (the sampler's counter); the coupled
            # draw is made where it is proposed, and at the first position (what `Agreement` compares)
            first = not draft
            drawn, argmax = self.pick(logits[0, -1], source.sampling if sampled and (coupled or first) else None,
                                      len(tokens) - 1 + len(draft))
            if first and sampled:
                source.check = (len(tokens), drawn, argmax)
            token = drawn if coupled else argmax
            draft.append(token)
            if len(draft) == k:
                break
            logits = self.model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache,
                                use_cache=True).logits
            fed.append(token)
        source.cache, source.fed, source.held = cache, fed, len(tokens)
        return draft

    def pick(self, logits: torch.Tensor, sampling: RowSpec | None, position: int) -> tuple[int, int]:
        """(coupled draw, argmax) of the draft model's logits (V,) for a row's draw at `position`: the draw is the
        row's own (its temperature, truncation and min-p, and its uniform at `position`), the argmax where
        `sampling` is None. Rows the speculator drafts for have no penalties, bias or grammar (delivery.py, `_draftable`)."""
        logits = logits[: self.policy_vocab].float()
        argmax = int(logits.argmax())
        if sampling is None:
            return argmax, argmax
        passes = dataclasses.replace(sampling.passes, top=0, adjust=0, constrain=False)
        rows = SamplingRows.of([sampling], logits.device)
        drawn = sample_rows(logits[None], rows, torch.tensor([position], device=logits.device), passes)
        return int(drawn.tokens[0]), argmax


class Agreement:
    """How often, lately, the policy drew a sampled row's coupled draft token and how often its draft argmax, at the
    row's first draft position (the one position always verified); moving sums over ~100 observations."""

    DECAY = 0.99

    def __init__(self) -> None:
        self.coupled, self.argmax = 1.0, 0.0  # the coupled draw leads until the argmax has agreed more often

    def observe(self, coupled: bool, argmax: bool) -> None:
        self.coupled = self.DECAY * self.coupled + coupled
        self.argmax = self.DECAY * self.argmax + argmax

    @property
    def coupled_leads(self) -> bool:
        return self.coupled >= self.argmax


class ModelSource:
    """One row's drafter on the draft model: proposes from the row's tokens whatever its last n-gram is."""

    name = "model"
    keyed = False  # proposes without an n-gram match (RowDrafts asks it where no n-gram source proposes)

    def __init__(self, runner: DraftModel, tokens: list[int], sampling: RowSpec | None = None) -> None:
        self.runner, self.tokens = runner, tokens  # tokens: the row's list, extended by its RowDrafts
        self.sampling = sampling  # the row's params and stream key: drafts are drawn as the row draws
        self.cache: Any = None
        self.fed: list[int] = []  # the ids whose KV the cache holds, in order
        self.held = 0  # len(tokens) at the last draft: every one of them is in `fed`
        # a sampled row's last first draft position: (index in tokens of the token drawn there, coupled, argmax)
        self.check: tuple[int, int, int] | None = None

    def advance(self) -> None:
        pass

    def draft(self, k: int) -> list[int]:
        return self.runner.draft(self, k)


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
