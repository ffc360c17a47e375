"""The benchmark harness's measurement of compute under communication (benchmarks/common.py),
in a real gloo world: every rank returns the same numbers, and a replay that cannot run
raises on every rank."""
from __future__ import annotations

import pytest


def _loaded(dtype: str):
    import torch
    import torch.distributed as dist

    from benchmarks import common

    group = dist.new_group(backend="gloo")
    calls = [{"op": "all_reduce", "shape": [1 << 16], "dtype": dtype, "group": None, "world": dist.get_world_size()}]
    x = torch.randn(128, 128)
    try:
        return common.loaded_times(lambda: x @ x, calls, group, rounds=3)
    except Exception as e:  # noqa: BLE001 - the test wants to see each rank's error
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group(group)


def test_loaded_times_agree_across_ranks(world2):
    a, b = world2.run(_loaded, "float32")
    assert a == b and a[0] > 0 and a[1] > 0, (a, b)


def test_a_bad_replay_raises_on_every_rank(world2):
    errs = world2.run(_loaded, "no_such_dtype", timeout=120)
    assert all(isinstance(e, str) and "no_such_dtype" in e for e in errs), errs
