"""The residual MLP stack that the tests and the benchmark shard: ``fully_shard``
on each :class:`Block`, then on the :class:`Model` root."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class Model(nn.Module):
    """A residual MLP stack: ``fully_shard`` goes on each block, then the root."""

    def __init__(self, dim: int, hidden: int, num_blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(num_blocks))
        self.out = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)
