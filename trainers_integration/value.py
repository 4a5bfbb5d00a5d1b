"""Value functions for PPO: a head on the policy's own hidden states, or a separate critic model.

Both score the state *before* each completion token (the position whose logits predict it), so values line up with
the logprobs of `forward.completion_logprobs`: values[i, j] = V(prompt_i + completion_i[:j]).
"""

from __future__ import annotations

import torch

from .forward import Packed


class ValueHead(torch.nn.Module):
    """A linear value head on the policy's last hidden state: one forward gives logprobs and values.
    Zero-initialised, so V = 0 at the start. Its parameters must be in the trainer's optimizer."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "ValueHead":
        head = cls(model.config.get_text_config().hidden_size)
        param = next(model.parameters())
        return head.to(device=param.device, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden: (R, T, H) -> (R, T)
        return self.linear(hidden.float()).squeeze(-1)


class CriticModel(torch.nn.Module):
    """A separate critic: any transformers backbone (e.g. a copy of the policy) plus a zero-initialised linear head.
    Scores the same packed rows as the policy."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = ValueHead(backbone.config.get_text_config().hidden_size)
        self.head.to(next(backbone.parameters()).device)

    def forward(self, packed: Packed) -> torch.Tensor:  # -> (R, T) values at the completion positions
        out = self.backbone(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                            output_hidden_states=True, use_cache=False)
        last = out.hidden_states[-1]
        hidden = last.gather(1, packed.index[:, :, None].expand(-1, -1, last.shape[-1]))
        return self.head(hidden)
