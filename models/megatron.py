"""Megatron-style layers written with functional collectives in forward: models that
``torch.export`` takes (DTensor-parallelized modules do not export on torch 2.13).

Weights are this rank's shards; every builder takes a 1-D mesh and returns
``(module, example_inputs)`` like the other reference models.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F


class SPMLP(nn.Module):
    """Sequence-parallel MLP: all-gather rows -> w1 -> gelu -> w2 -> reduce-scatter rows."""

    def __init__(self, group, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.group = group
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):  # x: this rank's rows
        g = funcol.all_gather_tensor(x, 0, self.group)
        return funcol.reduce_scatter_tensor(self.w2(F.gelu(self.w1(g))), "sum", 0, self.group)


class TPBlock(nn.Module):
    """Tensor-parallel block without sequence parallelism: x replicated; q/k/v and w1/w3
    hold this rank's columns (heads), wo and w2 its rows, whose outputs are all-reduced."""

    def __init__(self, group, dim: int = 32, heads: int = 2, hidden: int = 48):
        super().__init__()
        self.group, self.heads = group, heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):  # (batch, seq, dim)
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        h = x + funcol.all_reduce(self.wo(a), "sum", self.group)
        return h + funcol.all_reduce(self.w2(F.silu(self.w1(h)) * self.w3(h)), "sum", self.group)


def _inputs(shape, mesh):
    rank = mesh.get_local_rank() if mesh.size() > 1 else 0
    return (torch.randn(shape, generator=torch.Generator().manual_seed(rank)),)


def build_sp_mlp(mesh, *, rows: int = 64, dim: int = 16, hidden: int = 32):
    """(SPMLP, (this rank's rows,)); weights from this rank's seed."""
    torch.manual_seed(100 + (mesh.get_local_rank() if mesh.size() > 1 else 0))
    return SPMLP(mesh.get_group(), dim, hidden), _inputs((rows, dim), mesh)


def build_tp_block(mesh, *, batch: int = 2, seq: int = 16, dim: int = 32, heads: int = 2, hidden: int = 48):
    """(TPBlock, (x,)); weights from this rank's seed."""
    torch.manual_seed(100 + (mesh.get_local_rank() if mesh.size() > 1 else 0))
    return TPBlock(mesh.get_group(), dim, heads, hidden), _inputs((batch, seq, dim), mesh)
