"""The weights of every policy version, derived from the seed: version 0 is the checkpoint, version v > 0 the
checkpoint with a seeded perturbation. The driver sends them; the checker derives its own copy from the same rule
(they are tiny) and checks every recorded fingerprint against it."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

# versions kept derived (the most recently used): the driver needs the newest of each surface, the checker and the
# replay one at a time; deriving one again is a few ms. Unbounded, a 30-minute run kept all ~450 of them (0.55 MiB
# each: 240 MiB of the driver's RSS, which the end-state check read as a leak)
KEEP = 4


class Versions:
    def __init__(self, base: dict[str, torch.Tensor], seed: int, keep: int = KEEP) -> None:
        self.base = {k: v.detach().clone() for k, v in base.items()}
        self.seed, self.keep = seed, keep
        self._cache: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def __getitem__(self, version: int) -> dict[str, torch.Tensor]:
        if version == 0:
            return self.base
        with self._lock:
            if version in self._cache:
                self._cache.move_to_end(version)
                return self._cache[version]
            gen = torch.Generator().manual_seed(self.seed * 100_003 + version)
            weights = {name: t + 0.2 * torch.randn(t.shape, generator=gen) * t.std()
                       if t.is_floating_point() and t.numel() > 1 else t.clone() for name, t in self.base.items()}
            self._cache[version] = weights
            while len(self._cache) > self.keep:
                self._cache.popitem(last=False)
            return weights
