"""``overlapc::local_rows``: this rank's block of rows of a replicated tensor.

Automatic sequence parallelism (passes/auto_sp.py) runs row-wise ops on each rank's rows
only. A replicated operand of such an op (a residual that was never all-reduced) is cut to
the same rows here; the graph is the same on every rank, so the rank is read at run time
from the process group, never baked into the graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _rank(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_rank(_resolve_process_group(group_name))


@torch.library.custom_op("overlapc::local_rows", mutates_args=())
def local_rows(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Rows ``[r * n, (r + 1) * n)`` of ``x`` (dim 0), n = len(x) / world, r = this rank."""
    if x.shape[0] % world:
        raise ValueError(f"overlapc: {x.shape[0]} rows do not split over a world of {world}")
    n = x.shape[0] // world
    return x.narrow(0, _rank(group_name) * n, n).clone()


@local_rows.register_fake
def _(x, world, group_name):
    return x.new_empty((x.shape[0] // world, *x.shape[1:]))
