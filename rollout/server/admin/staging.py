"""Staging: the weight-update fence of vLLM's RLHF router (`/start_weight_update` ... `/finish_weight_update`), which
SkyRL and TRL's async GRPO drive: one update arriving in chunks, applied at the end as one.

    start  -> an empty staging area (409 if one is open already)
    add    -> each chunk's tensors (from /update_weights or /update_weights_from_disk) kept, nothing applied; a name
              staged twice is a 400 naming it, and nothing of that chunk is kept
    take   -> everything staged, the area closed; the caller applies it through the rollout side's `update_weights`
              (validated whole before any weight changes: names, shapes, finite values), so the update lands whole
              or not at all

The tensors are held where they arrived (a checkpoint's on the CPU, a group's on the model's device) until `take`.
"""

from __future__ import annotations

import torch

from ..transport.errors import ApiError, bad_request


class Staging:
    def __init__(self) -> None:
        self._staged: dict[str, torch.Tensor] | None = None

    @property
    def is_open(self) -> bool:
        return self._staged is not None

    def open(self) -> None:
        if self._staged is not None:
            raise ApiError(409, f"a weight update is open already ({len(self._staged)} tensors staged). Fix: POST "
                           "/finish_weight_update to apply it first", code="conflict")
        self._staged = {}

    def add(self, weights: dict[str, torch.Tensor]) -> int:
        """Stage one chunk; returns how many tensors are staged in all."""
        assert self._staged is not None, "add() needs an open staging area"
        twice = sorted(set(weights) & set(self._staged))
        if twice:
            raise bad_request(f"weights['{twice[0]}']", f"weights['{twice[0]}'] was staged already in this update. "
                              "Fix: send each tensor once between /start_weight_update and /finish_weight_update")
        self._staged.update(weights)
        return len(self._staged)

    def take(self) -> dict[str, torch.Tensor]:
        """Everything staged; the area is closed whatever the caller then makes of it."""
        if self._staged is None:
            raise ApiError(409, "no weight update is open. Fix: POST /start_weight_update, then the tensors "
                           "(/update_weights), then /finish_weight_update", code="conflict")
        staged, self._staged = self._staged, None
        if not staged:
            raise bad_request(None, "no tensors were staged between /start_weight_update and /finish_weight_update: "
                              "nothing to apply, the version stays. Fix: send the tensors with /update_weights")
        return staged
