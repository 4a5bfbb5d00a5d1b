"""The weights of every policy version, derived from the seed: version 0 is the checkpoint, version v > 0 the
checkpoint with a seeded perturbation. The driver sends them; the checker derives its own copy from the same rule
(they are tiny) and checks every recorded fingerprint against it."""

from __future__ import annotations

import threading

import torch


class Versions:
    def __init__(self, base: dict[str, torch.Tensor], seed: int) -> None:
        self.base = {k: v.detach().clone() for k, v in base.items()}
        self.seed = seed
        self._cache: dict[int, dict[str, torch.Tensor]] = {0: self.base}
        self._lock = threading.Lock()

    def __getitem__(self, version: int) -> dict[str, torch.Tensor]:
        with self._lock:
            if version not in self._cache:
                gen = torch.Generator().manual_seed(self.seed * 100_003 + version)
                self._cache[version] = {
                    name: t + 0.2 * torch.randn(t.shape, generator=gen) * t.std()
                    if t.is_floating_point() and t.numel() > 1 else t.clone() for name, t in self.base.items()}
            return self._cache[version]
