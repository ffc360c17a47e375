"""What overlapc found in each captured graph, what it did, and why.

A :class:`Report` holds one :class:`Site` per matmul-collective dependency found (rewritten
or not) and one per collective that belongs to no site, each with the reason a user can
act on. ``str(report)`` is a table; ``report.to_json()`` is JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PATTERNS = (
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "all_reduce_sum",
    "all_to_all_matmul",
    "matmul_all_to_all",
    "microbatch",
    "expert_loop",
    "collective",
)
GRAPHS = ("forward", "backward", "inference")
STATUSES = ("found", "rewritten", "skipped")


@dataclass
class Site:
    name: str
    """Stable name, the key of per-site overrides: "<graph>:<module>:<pattern>[#n]"."""
    pattern: str
    """One of PATTERNS; "collective" for a collective that is part of no site; "microbatch" for a
    region of the graph cut into batch slices (option microbatches, passes/microbatch.py);
    "all_reduce_sum" for all-reduces whose results were summed, coalesced into one
    (passes/coalesce.py; details: the all-reduces merged and the bytes saved); "all_reduce_rows"
    for automatic sequence parallelism (passes/auto_sp.py); "fp8_gather" for a gather cast to
    float8 after it, made to cast first (passes/fp8_gather.py; details: wire bytes)."""
    graph: str
    """"forward", "backward" or "inference"."""
    status: str
    """"found" (not rewritten by choice: strategy "none"), "rewritten" or "skipped"."""
    reason: str | None = None
    """Why a site was skipped, or why a collective is part of no site."""
    strategy: str | None = None
    chunks: int | None = None
    group: str | None = None
    """Process-group name of the collective."""
    world_size: int | None = None
    collective: str = ""
    """Graph node name of the collective."""
    collective_op: str = ""
    """all_gather_into_tensor, reduce_scatter_tensor, all_reduce or all_to_all_single."""
    matmuls: list[str] = field(default_factory=list)
    """Graph node names of the matmuls of the site."""
    module: str | None = None
    """Module path the site comes from (e.g. "layers.0.attention"), where the graph records it."""
    dim: int | None = None
    """Gather/scatter dim of the collective in the tensor the model sees."""
    dtype: str | None = None
    shapes: dict[str, Any] = field(default_factory=dict)
    """"input"/"output" of the collective, "matmuls": [[lhs, rhs, out], ...]."""
    comm_bytes: int | None = None
    """Bytes this rank sends (all-gather, all-to-all) or reduces (reduce-scatter, all-reduce)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Pattern-specific facts (matmul roles, other users, predicted times, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass
class Report:
    sites: list[Site] = field(default_factory=list)
    unmatched_overrides: list[str] = field(default_factory=list)
    """``overrides`` globs that matched no site (explain() fills it; the backend logs a warning)."""

    def extend(self, sites):
        self.sites.extend(sites)

    def by(self, *, pattern=None, graph=None, status=None) -> list[Site]:
        return [
            s
            for s in self.sites
            if (pattern is None or s.pattern == pattern)
            and (graph is None or s.graph == graph)
            and (status is None or s.status == status)
        ]

    def counts(self) -> dict[tuple[str, str], int]:
        """{(graph, pattern): number of sites}."""
        out: dict[tuple[str, str], int] = {}
        for s in self.sites:
            out[(s.graph, s.pattern)] = out.get((s.graph, s.pattern), 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "sites": [s.to_dict() for s in self.sites],
            "summary": {f"{g}/{p}": n for (g, p), n in sorted(self.counts().items())},
            "unmatched_overrides": list(self.unmatched_overrides),
        }

    def to_json(self, **kw) -> str:
        kw.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        table = format_table(self.sites)
        if self.unmatched_overrides:
            table += "\noverrides that matched no site: " + ", ".join(map(repr, self.unmatched_overrides))
        return table

    def __repr__(self) -> str:
        return f"Report({len(self.sites)} sites: {self.counts()})"


def _fmt_shape(s):
    return "x".join(str(d) for d in s) if isinstance(s, (list, tuple)) else str(s)


def format_table(sites: list[Site]) -> str:
    if not sites:
        return "overlapc: no collectives in the captured graphs."
    head = ("graph", "pattern", "status", "module", "collective", "matmuls", "shape", "plan", "reason")
    rows = []
    for s in sites:
        shape = ""
        if s.shapes.get("input") is not None:
            shape = f"{_fmt_shape(s.shapes['input'])}->{_fmt_shape(s.shapes.get('output'))}"
            if s.dim is not None:
                shape += f" d{s.dim}"
        plan = ""
        if s.strategy:
            plan = s.strategy + (f"/{s.chunks}" if s.chunks else "")
        rows.append(
            (
                s.graph,
                s.pattern,
                s.status,
                s.module or "",
                s.collective,
                ",".join(s.matmuls),
                shape,
                plan,
                s.reason or "",
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    widths[-1] = len(head[-1])  # the reason column is last: do not pad it

    def line(r):
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

    out = [line(head), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    n_sites = sum(1 for s in sites if s.pattern != "collective")
    n_rw = sum(1 for s in sites if s.status == "rewritten")
    n_coll = len(sites) - n_sites
    out.append(f"{n_sites} sites ({n_rw} rewritten), {n_coll} other collectives")
    return "\n".join(out)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
