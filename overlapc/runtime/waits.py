"""Failures of the collectives a rewrite emitted, reported with their site.

A chunked collective runs on the user's process group (or one of its lanes,
overlapc/runtime/lanes.py, which take the group's options) and completes, times out or fails
like any torch collective: within the group's timeout (``init_process_group(timeout=...)``,
``new_group(timeout=...)``; torch's defaults are 30 min for gloo, 10 min for NCCL). What
overlapc adds is the name: the error says which site, which chunk, on which rank of which
group, instead of a bare transport message.

- ``inner="eager"``: every wait a rewrite emitted (tagged by passes/lower.py) is replaced by
  :func:`wait`, which re-raises a failure as ``OverlapCommError`` naming its site and chunk.
- ``inner="inductor"``: inductor generates the waits; :func:`named_failures` wraps a
  compiled graph so that a collective failure inside it names the graph's rewritten sites.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlapc.errors import OverlapCommError, OverlapError
from overlapc.runtime import lanes

# Words of the transport errors a failed or timed-out collective raises (gloo, NCCL).
_COMM_FAILURE = (
    "Timed out",
    "timed out",
    "timeout caused pair closure",
    "Connection closed",
    "Connection reset",
    "reset by peer",
    "NCCL error",
    "ncclRemoteError",
    "ncclSystemError",
    "gloo/transport",
)


def _rank() -> str:
    return str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else "?"


def describe(site: str, chunk: int, chunks: int, group: str) -> str:
    return f"site {site} (collective {chunk + 1} of {chunks}) on rank {_rank()} of group {group!r}"


def wait(x: torch.Tensor, site: str, chunk: int, chunks: int, group: str) -> torch.Tensor:
    """``wait_tensor(x)``; a failure is re-raised naming the site and chunk."""
    try:
        return torch.ops._c10d_functional.wait_tensor.default(x)
    except RuntimeError as e:
        raise OverlapCommError(
            f"overlapc: {describe(site, chunk, chunks, group)} did not complete: {e} "
            "(the process group's timeout bounds each collective; a peer that died "
            "or never reached this step fails it)"
        ) from e


def name_waits(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of an eager-run graph whose tagged waits are :func:`wait` calls (``gm`` itself
    when it has none). ``gm`` keeps plain wait_tensor nodes: reports and tests read it."""
    from overlapc.passes.lower import SITE_WAIT

    wait_op = torch.ops._c10d_functional.wait_tensor.default
    if not any(n.meta.get(SITE_WAIT) and n.target is wait_op for n in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for node in list(graph.nodes):
        tag = node.meta.get(SITE_WAIT)
        if tag is None or node.target is not wait_op:
            continue
        site, chunk, chunks = tag
        coll = node.args[0]
        group = coll.args[-1] if isinstance(coll, torch.fx.Node) and coll.args else "?"
        group = lanes.base_group(group) if isinstance(group, str) else group  # the user's group, not a lane
        with graph.inserting_before(node):
            new = graph.call_function(wait, (node.args[0], site, chunk, chunks, str(group)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph)


def is_comm_failure(e: BaseException) -> bool:
    if not isinstance(e, RuntimeError) or isinstance(e, OverlapError):
        return False
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(e, dist_error) or any(w in str(e) for w in _COMM_FAILURE)


def named_failures(fn, kind: str, sites: list[str]):
    """Wrap a compiled graph (boxed or not): a collective failure inside names ``sites``."""
    if not sites:
        return fn

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if not is_comm_failure(e):
                raise
            raise OverlapCommError(
                f"overlapc: a collective of the {kind} graph failed on rank {_rank()}: {e} (the graph's "
                f"rewritten sites: {', '.join(sites)}; the failing collective may be any of the graph's; "
                "inner='eager' names the exact site and chunk)"
            ) from e

    call._boxed_call = getattr(fn, "_boxed_call", False)
    return call
