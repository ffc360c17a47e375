"""Shared fixtures: a fake process group of 8 ranks in this process, and reusable gloo worlds."""

from __future__ import annotations

import os

import pytest
import torch

# Tests compile many small graphs; keep each process to one intra-op thread.
torch.set_num_threads(1)

# Hermetic: no calibrated profile or live-group measurements of this machine's own runs
# (~/.cache/overlapc) decide a test's plans. Set before overlapc is imported and before any
# world is spawned (workers inherit it).
os.environ["OVERLAPC_CACHE"] = __import__("tempfile").mkdtemp(prefix="overlapc-test-cache-")
# Plans from the profile, not from timings of this machine's loopback at that moment (which flip
# close decisions, e.g. micro-batch slices, between runs). tests/test_live.py measures on purpose.
os.environ["OVERLAPC_MEASURE"] = "0"


@pytest.fixture(scope="session")
def fake_mesh8():
    """A 1-D DeviceMesh over a fake process group of world size 8 (shapes right, values meaningless)."""
    from overlapc.cli import fake_world

    mesh = fake_world(8)
    yield mesh


@pytest.fixture
def own_fake_world():
    """For a test that makes its own fake world in this process: the world of 8 that
    fake_mesh8's users expect is put back afterwards (groups resolve by name, "0")."""
    yield
    from overlapc.cli import fake_world

    fake_world(8)


_WORLDS: dict[int, object] = {}


def _world(n: int):
    from overlapc.testing.world import World

    if n not in _WORLDS:
        _WORLDS[n] = World(n, timeout=float(os.environ.get("OVERLAPC_TEST_TIMEOUT", "600")))
    return _WORLDS[n]


@pytest.fixture(scope="session")
def world2():
    w = _world(2)
    yield w


@pytest.fixture(scope="session")
def world4():
    w = _world(4)
    yield w


def pytest_sessionfinish(session, exitstatus):
    for w in _WORLDS.values():
        w.close()
    _WORLDS.clear()
    __import__("shutil").rmtree(os.environ["OVERLAPC_CACHE"], ignore_errors=True)
