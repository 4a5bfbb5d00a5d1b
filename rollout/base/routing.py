"""Routing: the experts each row's positions were routed to, as the rollout engine computed them (mixture-of-experts
models with `WorkerConfig(record_routing=True)`); part of RolloutBatch. Finding routers and replaying routing:
rollout.moe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def routing_dtype(num_experts: int) -> torch.dtype:
    """uint8 up to 256 experts, int16 beyond."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass(frozen=True)
class Routing:
    """The experts each row's positions were routed to, as the rollout engine computed them.

    layers: the MoE routers' module names (wrapper prefixes removed), one per recorded layer, in model order.
    rows: one tensor per row, (positions, len(layers), top_k) of `routing_dtype(num_experts)` (uint8 up to 256
        experts): positions 0 .. len(prompt) + len(completion) - 2, every token the engine fed (the last completion
        token is never fed: its experts change no logprob of the row).
    """

    layers: tuple[str, ...]
    num_experts: int
    top_k: int
    rows: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        shape = (len(self.layers), self.top_k)
        for i, row in enumerate(self.rows):
            if row.dim() != 3 or tuple(row.shape[1:]) != shape or row.dtype != routing_dtype(self.num_experts):
                raise ValueError(f"routing row {i} has shape {tuple(row.shape)} and dtype {row.dtype}: must be "
                                 f"(positions, {shape[0]}, {shape[1]}) of {routing_dtype(self.num_experts)}.")

    def __len__(self) -> int:
        return len(self.rows)

    def __reduce__(self):
        # pickled (the fleet's transport) with each row as a numpy array: ~40 bytes of framing per row, where a
        # pickled tensor takes ~300 (more than a 100-token row's 4-byte-per-token experts)
        return _unpickle_routing, (self.layers, self.num_experts, self.top_k, tuple(row.numpy() for row in self.rows))

    def select(self, rows: Sequence[int] | slice) -> "Routing":
        picked = self.rows[rows] if isinstance(rows, slice) else tuple(self.rows[i] for i in rows)
        return Routing(self.layers, self.num_experts, self.top_k, tuple(picked))

    @property
    def bytes_per_token(self) -> int:
        return len(self.layers) * self.top_k * torch.empty((), dtype=routing_dtype(self.num_experts)).element_size()

    @property
    def nbytes(self) -> int:
        return sum(row.numel() * row.element_size() for row in self.rows)

    def same_layout(self, other: "Routing") -> bool:
        return (self.layers, self.num_experts, self.top_k) == (other.layers, other.num_experts, other.top_k)

    @staticmethod
    def concat(parts: Sequence["Routing"]) -> "Routing":
        """Rows of several recordings of the same model, in order. ValueError if their layouts differ."""
        first = parts[0]
        for part in parts[1:]:
            if not first.same_layout(part):
                raise ValueError(f"routing of different models cannot be merged: {len(first.layers)} layers x "
                                 f"{first.num_experts} experts (top-{first.top_k}) vs {len(part.layers)} x "
                                 f"{part.num_experts} (top-{part.top_k}).")
        return Routing(first.layers, first.num_experts, first.top_k, tuple(r for p in parts for r in p.rows))


def _unpickle_routing(layers: tuple[str, ...], num_experts: int, top_k: int, rows: tuple) -> Routing:
    return Routing(layers, num_experts, top_k, tuple(torch.tensor(row) for row in rows))
