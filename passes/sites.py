"""The matched-site base classes shared by every site kind, and their conversion to a report row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.fx import Node

from overlapc.report import Site
from overlapc.runtime import lanes

from . import ops
from .normalize import Producer, Use


@dataclass(eq=False)
class MatchedSite:
    """Nodes a site spans plus its parsed arguments. Subclasses add their own nodes."""

    pattern: ClassVar[str] = ""
    coll: Node
    wait: Node
    group: str | None
    world: int | None

    # Filled by the planner and the lowering.
    name: str = ""
    graph_kind: str = ""
    status: str = "found"
    reason: str | None = None
    strategy: str | None = None
    chunks: int | None = None
    timeout: float | None = None
    """Seconds a fused op may wait for its peers (strategy "fuse")."""
    details: dict = field(default_factory=dict)

    def skip(self, reason: str | None) -> None:
        """Leave the site as it is, saying why (the report's reason)."""
        self.status, self.strategy, self.chunks, self.reason = "skipped", None, None, reason

    @property
    def matmuls(self) -> list[Node]:
        raise NotImplementedError

    @property
    def dim(self) -> int | None:
        return None

    def comm_bytes(self) -> int | None:
        """Bytes of the collective's input on this rank."""
        v = ops.val(self.coll.args[0])
        if v is None:
            return None
        n = ops.hint(v.numel())  # symbolic: at the shape bucket's representative sizes
        return None if n is None else n * v.element_size()

    def module(self) -> str | None:
        return ops.common_module(ops.module_path(m) for m in self.matmuls) or ops.module_path(self.coll)

    def shapes(self) -> dict:
        mms = []
        for m in self.matmuls:
            lhs, rhs = ops.MATMULS[m.target]
            mms.append([ops.shape(m.args[lhs]), ops.shape(m.args[rhs]), ops.shape(m)])
        return {"input": ops.shape(self.coll.args[0]), "output": ops.shape(self.coll), "matmuls": mms}

    def snapshot(self) -> None:
        """Record the report row while the site's nodes still exist (lowering erases them)."""
        self._row = self._make_row()

    def to_report(self) -> Site:
        row = getattr(self, "_row", None) or self._make_row()
        row.status, row.reason, row.strategy, row.chunks = self.status, self.reason, self.strategy, self.chunks
        row.details = _plain(self.details)
        return row

    def _make_row(self) -> Site:
        v = ops.val(self.coll.args[0])
        return Site(
            name=self.name,
            pattern=self.pattern,
            graph=self.graph_kind,
            status=self.status,
            reason=self.reason,
            strategy=self.strategy,
            chunks=self.chunks,
            group=self.group,
            world_size=self.world,
            collective=self.coll.name,
            collective_op=ops.collective_name(self.coll),
            matmuls=[m.name for m in self.matmuls],
            module=self.module(),
            dim=self.dim,
            dtype=ops.dtype_name(v) if v is not None else None,
            shapes=_plain(self.shapes()),
            comm_bytes=self.comm_bytes(),
            details=_plain(self.details),
        )


@dataclass(eq=False)
class ConsumerSite(MatchedSite):
    """A collective whose result feeds matmuls (all-gather -> mm, all-to-all -> mm)."""

    uses: list[Use] = field(default_factory=list)
    other_users: list[Node] = field(default_factory=list)
    """Users of the collective's result (or its views) that are not matmuls: they still need it whole."""

    @property
    def matmuls(self):
        return ops.in_graph_order(u.matmul for u in self.uses)


@dataclass(eq=False)
class ProducerSite(MatchedSite):
    """A collective whose input is a matmul or a sum of matmuls (mm -> RS / AR / all-to-all)."""

    producer: Producer = None

    @property
    def matmuls(self):
        return ops.in_graph_order(self.producer.matmuls)


@dataclass(eq=False)
class Loose:
    """A collective that is part of no site, and why."""

    coll: Node
    reason: str
    name: str = ""
    graph_kind: str = ""

    def to_report(self) -> Site:
        v = ops.val(self.coll.args[0]) if self.coll.args and isinstance(self.coll.args[0], Node) else None
        return Site(
            name=self.name,
            pattern="collective",
            graph=self.graph_kind,
            status="skipped",
            reason=self.reason,
            group=lanes.base_group(ops.group_name(self.coll) or "") or None,  # the user's group, not a lane
            world_size=ops.world_size(self.coll),
            collective=self.coll.name,
            collective_op=ops.collective_name(self.coll),
            module=ops.module_path(self.coll),
            dtype=ops.dtype_name(v) if v is not None else None,
            shapes=_plain(
                {"input": ops.shape(self.coll.args[0]) if v is not None else None, "output": ops.shape(self.coll)}
            ),
        )


def _plain(x):
    """Shapes may hold SymInts; the report wants ints or strings."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, str, float, int)):
        return x
    if isinstance(x, torch.SymInt):
        # int() of an unbacked size (a run-time split) would guard on data: keep the formula.
        expr = x.node.expr
        return int(expr) if expr.is_number else str(expr)
    try:
        return int(x)
    except (TypeError, ValueError):
        return str(x)
