"""Structure: every all-to-all region form is rewritten at every chunk count 2 .. 2 x world.

A region's chunked replay narrows tensors the original graph only viewed whole; a chunk
count that does not divide an axis (or that cuts a dim another view merges) gives chunks
whose strides a view cannot take. Such a failure used to be reported as a skip, with the
eager graph kept, so it was silently lost overlap. Here it is a test failure: each form,
at worlds 2, 4 and 8 (sub-meshes of the session's fake process group), is compiled with
strategy "decompose" and a fixed chunk count, and every all-to-all site of the forward and
backward graphs must be rewritten.

The dropless forms cannot be traced on fake tensors (their split sizes are data) and are
swept in real worlds (tests/test_all_to_all_distributed.py); numerics against eager are
there too.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import overlapc
from overlapc.models import moe, ulysses

A2A = ("all_to_all_matmul", "matmul_all_to_all")


def _moe(**kw):
    def build(mesh, world):
        return moe.build_ep(mesh, tokens=32, dim=32, hidden=48, n_experts=max(8, 2 * world), capacity_factor=1.25, **kw)

    return build


def _ulysses(gqa=None):
    """Two query heads per rank; with ``gqa``, one k/v head per rank shared by both."""

    def build(mesh, world):
        heads = 2 * world
        extra = {"n_kv_heads": world, "gqa": gqa} if gqa else {}
        return ulysses.build_ulysses(mesh, dim=8 * heads, seq=8 * world, n_heads=heads, **extra)

    return build


FORMS = {
    "index-bmm": _moe(expert_form="bmm"),
    "index-loop": _moe(expert_form="loop"),
    "index-grouped": _moe(expert_form="grouped", dtype="bfloat16"),
    "einsum-bmm": _moe(expert_form="bmm", dispatch="einsum"),
    "einsum-loop": _moe(expert_form="loop", dispatch="einsum"),
    "ulysses": _ulysses(),
    "ulysses-gqa": _ulysses(gqa="repeat"),
    "ulysses-gqa-sdpa": _ulysses(gqa="sdpa"),
}
# In `make test`: the GShard layer (einsum) at a divisor and non-divisors of its local
# experts and at 2 x world; every other form at world 4 at a non-divisor and at 2 x world.
# The rest (about 2.5 minutes): `make test-all`.
QUICK = {
    ("einsum-bmm", 2): (2, 3, 4),
    ("einsum-bmm", 4): (3, 5, 8),
    **{(name, 4): (3, 8) for name in FORMS if name != "einsum-bmm"},
}


def _cases():
    for name in FORMS:
        for world in (2, 4, 8):
            for chunks in range(2, 2 * world + 1):
                quick = chunks in QUICK.get((name, world), ())
                yield pytest.param(
                    name, world, chunks, id=f"{name}-w{world}-c{chunks}", marks=() if quick else pytest.mark.extended
                )


@pytest.mark.parametrize("name,world,chunks", list(_cases()))
def test_every_all_to_all_site_is_rewritten(fake_mesh8, name, world, chunks):
    torch._dynamo.reset()
    mesh = DeviceMesh("cpu", list(range(world)))
    model, inputs = FORMS[name](mesh, world)
    report = overlapc.explain(model, *inputs, options={"strategy": "decompose", "chunks": chunks})
    sites = [s for s in report.sites if s.pattern in A2A]
    assert {(s.graph, s.pattern) for s in sites} == {(g, p) for g in ("forward", "backward") for p in A2A}, [
        (s.graph, s.pattern) for s in sites
    ]
    bad = [(s.name, s.status, s.reason) for s in sites if s.status != "rewritten"]
    assert not bad, bad
    # the count asked for, where the chosen axis has that many slabs (the planner picks among
    # the axes that can honour it; where none can, the one predicted to save most)
    got = [(s.name, s.chunks, s.details["axis"]["extent"]) for s in sites]
    assert all(n == min(chunks, extent) for _, n, extent in got), got
