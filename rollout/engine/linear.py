"""Wide linear layers (the lm_head above all) computed in column blocks on the engine's loop thread.

On the host, MKL's fp32 GEMM runs a [rows, hidden] @ [hidden, N] product with N in the tens of thousands (a
vocabulary) at 45-90 GFLOP/s on 16-512 rows, where the same product in blocks of 512 output columns runs at 70-130
(measured on 2 cores: benchmarks/RESULTS.md, "Throughput against vLLM"). Each output element is the same dot product
over the same hidden dimension either way, so the blocks are bit for bit the unblocked result (pinned by
tests/test_linear.py); only the order in which columns are produced changes.

`blocked(model)` gives every plain `nn.Linear` of at least `MIN_COLUMNS` outputs the class `BlockedLinear` for as long
as the engine lives (`restore` gives it back): the same module, parameters and state dict; off the engine's loop
thread (a trainer's forward and backward) its forward is `nn.Linear`'s own. Subclasses of `nn.Linear` (PEFT's LoRA
layers, FSDP-wrapped modules, quantized layers) are left alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import ENGINE_THREAD

BLOCK_COLUMNS = 512
MIN_COLUMNS = 8 * BLOCK_COLUMNS  # narrower layers run as fast unblocked


class BlockedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not ENGINE_THREAD.active or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        biases = [None] * self.out_features if self.bias is None else self.bias.split(BLOCK_COLUMNS)
        return torch.cat([F.linear(x, w, b) for w, b in zip(self.weight.split(BLOCK_COLUMNS), biases)], dim=-1)


def blocked(model: nn.Module) -> list[nn.Module]:
    """Give BlockedLinear to the model's wide plain linear layers on the host; returns them (for `restore`)."""
    if next(model.parameters()).device.type != "cpu":
        return []
    wide = [m for m in model.modules() if type(m) is nn.Linear and m.out_features >= MIN_COLUMNS]
    for module in wide:
        module.__class__ = BlockedLinear
    return wide


def restore(modules: list[nn.Module]) -> None:
    for module in modules:
        if type(module) is BlockedLinear:
            module.__class__ = nn.Linear
