"""The trainer's forward: teacher-forced logprobs of completion tokens, what the rollout's `logprobs` must match.

Each row is packed as prompt + completion, right-padded (no left padding, so no query row is fully masked and
positions start at 0 as in the engine). The logit that predicts completion token j of row i sits at position
len(prompt_i) - 1 + j. Logprobs are `log_softmax(logits / T)` over the full vocabulary in fp32, with the sampling
temperature T: exactly what `RolloutBatch.logprobs` records, so for a shared in-place worker the two agree to ~1e-6.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from rollout import replay_routing


@dataclass(frozen=True)
class Packed:
    """input_ids, attention_mask: (R, L); index: (R, T) position of the logit predicting each completion token;
    completion_ids, mask: (R, T)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    index: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor


def pack(prompt_ids: list[list[int]], completion_ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int = 0,
         device: torch.device | str | None = None) -> Packed:
    """Right-padded prompt + completion rows. completion_ids, mask: (R, T) as in RolloutBatch."""
    lengths = mask.long().sum(dim=1).tolist()
    rows = [list(p) + completion_ids[i, :n].tolist() for i, (p, n) in enumerate(zip(prompt_ids, lengths))]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, : len(row)] = 1
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    index = (prompt_lengths[:, None] - 1 + torch.arange(completion_ids.shape[1])[None, :]).clamp(max=width - 1)
    return Packed(input_ids.to(device), attention_mask.to(device), index.to(device), completion_ids.to(device),
                  mask.to(device))


def replayed(model: torch.nn.Module, batch, rows: slice, on: bool):
    """`rollout.replay_routing` over the rows of one micro-batch when `on` (the config's `routing_replay`)."""
    if not on:
        return contextlib.nullcontext()
    if batch.routing is None:
        raise ValueError("routing_replay=True needs rollouts that recorded routing, but the batch has none. Fix: build "
                         "the rollout side with WorkerConfig(record_routing=True), or set routing_replay=False.")
    return replay_routing(model, batch, rows=rows)


def completion_logprobs(model: torch.nn.Module, packed: Packed, temperature: float = 1.0,
                        return_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(R, T) fp32 logprobs of the completion tokens under log_softmax(logits / T), 0 on padding; and, when asked,
    (R, T, H) the last hidden state at the same positions (the state a value head scores). Gradients flow."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r} is invalid: the trainer's logprobs need T > 0. Fix: train on "
                         "sampled rollouts (temperature > 0); greedy rows have no policy gradient.")
    out = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                output_hidden_states=return_hidden, use_cache=False)
    gather = packed.index[:, :, None]
    logits = out.logits.gather(1, gather.expand(-1, -1, out.logits.shape[-1])).float()  # (R, T, V)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    token = logprobs.gather(2, packed.completion_ids[:, :, None]).squeeze(2)
    token = torch.where(packed.mask, token, torch.zeros_like(token))
    hidden = None
    if return_hidden:
        last = out.hidden_states[-1]
        hidden = last.gather(1, gather.expand(-1, -1, last.shape[-1]))
    return token, hidden
