"""teach: a few steps of supervised fine-tuning, so a tiny random model says something on cue.

Tests use it to make a model emit a tool call (so the parsing paths run on what a model really sampled), and the
OpenAI agent example uses it as the format warm-up an agent model gets before RL. Cross-entropy on the completion
tokens only, full batch, Adam; the model is left in eval mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def teach(model: torch.nn.Module, pairs: Sequence[tuple[list[int], list[int]]], steps: int = 100, lr: float = 1e-2,
          seed: int = 0) -> float:
    """Fit `model` to produce each completion after its prompt; returns the last mean loss per completion token."""
    torch.manual_seed(seed)
    width = max(len(p) + len(c) for p, c in pairs)
    ids = torch.zeros((len(pairs), width), dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(pairs):
        row = list(prompt) + list(completion)
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(prompt): len(row)] = torch.tensor(list(completion))
        mask[i, : len(row)] = 1
    device = next(model.parameters()).device
    ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
    model.eval()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())
