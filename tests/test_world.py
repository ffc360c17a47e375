"""World: the reusable process pool that distributed tests, the demo and benchmarks share.
Failures are loud and bounded: a rank's exception names the rank, a hang becomes a timeout."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from overlapc.testing.world import World, WorldError, WorldTimeout


def rank_sum(k):
    t = torch.tensor([float(dist.get_rank() + k)])
    dist.all_reduce(t)
    return t.item()


def fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def sleep_forever():
    time.sleep(3600)


@pytest.mark.distributed
def test_world_reuse_errors_and_timeouts():
    with World(2, timeout=60) as w:
        assert w.run(rank_sum, 1) == [3.0, 3.0]  # ranks 0 and 1: (0+1)+(1+1)
        with pytest.raises(WorldError, match=r"rank 1: ValueError: boom on purpose"):
            w.run(fail_on_rank1)
        assert w.run(rank_sum, 0) == [1.0, 1.0]  # restarted after the failure
        t0 = time.monotonic()
        with pytest.raises(WorldTimeout, match="did not finish within 2 s"):
            w.run(sleep_forever, timeout=2)
        assert time.monotonic() - t0 < 30
        assert w.run(rank_sum, 2) == [5.0, 5.0]
    with pytest.raises(ValueError, match="module-level function"):
        World(1).run(lambda: 1)
