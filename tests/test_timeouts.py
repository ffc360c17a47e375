"""A chunked collective that does not complete within the process group's timeout raises
an OverlapError naming its site (and, with inner="eager", its chunk) on the waiting rank.

The job gives its group a 3 s timeout; both ranks run the compiled function once (compile,
plan agreement, one good step); then rank 1 does not call it again, and rank 0 must fail
within the timeout plus a grace, with the site in the message."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

TIMEOUT_S = 3.0


def hung_peer(inner: str, phase: str) -> dict:
    import torch.distributed._functional_collectives as fc

    import overlapc
    from overlapc.errors import OverlapError

    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=TIMEOUT_S))
    w = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))

    def layer(x):
        return fc.all_gather_tensor(x, 0, group) @ w

    torch._dynamo.reset()
    fn = torch.compile(layer, backend=overlapc.backend(inner=inner, strategy="decompose", chunks=2))
    x = torch.randn(8, 16, requires_grad=phase == "backward")
    fn(x).sum().backward() if phase == "backward" else fn(x)
    out = {"rank": dist.get_rank()}
    if phase == "backward":
        y = fn(x)  # both ranks run the forward of the second step
    if dist.get_rank() == 1:
        time.sleep(TIMEOUT_S + 3)  # never joins (the rest of) the second step
    else:
        t = time.monotonic()
        try:
            y.sum().backward() if phase == "backward" else fn(x)
            out["error"] = None
        except OverlapError as e:
            out["error"] = str(e)
            out["is_runtime_error"] = isinstance(e, RuntimeError)
        except Exception as e:  # noqa: BLE001 - the test reports what was raised instead
            out["error"] = f"not an OverlapError: {type(e).__name__}: {e}"
        out["elapsed"] = time.monotonic() - t
    dist.destroy_process_group(group)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    "inner,phase", [("eager", "forward"), ("inductor", "forward"), ("eager", "backward"), ("inductor", "backward")]
)
def test_timeout_names_the_site(world2, inner, phase):
    res = world2.run(hung_peer, inner, phase, timeout=120)
    r0 = res[0]
    assert r0["error"] is not None and "not an OverlapError" not in r0["error"], r0
    # Forward: y = all_gather(x) @ w; backward: dx = reduce_scatter(dy @ w.T).
    site = ":all_gather_matmul" if phase == "forward" else "backward:reduce_scatter_tensor:matmul_reduce_scatter"
    assert site in r0["error"] and "rank 0" in r0["error"], r0["error"]
    # It is the group's timeout that fired (not some other, earlier failure), and the error
    # is still a RuntimeError, as torch's own collective failures are.
    # (gloo says "Timed out waiting 3000ms ..." or "Application timeout caused pair closure")
    assert ("Timed out" in r0["error"] or "timeout" in r0["error"]) and r0["is_runtime_error"], r0
    assert r0["elapsed"] >= TIMEOUT_S - 0.5, r0
    if inner == "eager":
        assert "collective 1 of 2" in r0["error"], r0["error"]
    assert r0["elapsed"] < TIMEOUT_S + 10, r0
