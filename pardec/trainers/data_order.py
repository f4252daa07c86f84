"""Deterministic, resumable data order shared by all ranks.

Examples form one endless stream: epoch e is a permutation of the dataset seeded by (seed, e). The
global batch of optimiser step t is the slice ``[t*G, (t+1)*G)`` of the stream, G = micro x accum
x world; inside it, micro-batch m of rank r is chunk ``m * world + r``. The data position is thus
the step number alone, which makes resume exact, and one process with accumulation A*W sees the
same global batches as W processes with accumulation A.
"""

from __future__ import annotations

import torch


class DataOrder:
    def __init__(self, num_examples: int, micro: int, accum: int, world: int, rank: int, seed: int):
        if num_examples == 0:
            raise ValueError("the training dataset is empty")
        self.n, self.micro, self.accum, self.world, self.rank, self.seed = num_examples, micro, accum, world, rank, seed
        self._epoch, self._perm = -1, None

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=g).tolist(), epoch
        return self._perm[offset]

    def micro_batches(self, step: int) -> list[list[int]]:
        """Example indices of this rank's ``accum`` micro-batches for optimiser step ``step``."""
        start = step * self.global_batch
        out = []
        for m in range(self.accum):
            chunk = m * self.world + self.rank
            first = start + chunk * self.micro
            out.append([self._index(p) for p in range(first, first + self.micro)])
        return out

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / self.n
