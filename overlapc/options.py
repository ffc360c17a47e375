"""Options: one kw-only dataclass, validated on entry.

Every door (``torch.compile(..., options=...)``, ``overlapc.backend(**options)``,
``@overlapc.overlap(**options)``, ``overlapc.explain(..., options=...)`` and the CLI's
``--option k=v``) goes through :func:`Options.from_user`, so a wrong name or value is
the same :class:`OverlapError` everywhere, naming the option and what it allows.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import OverlapError

INNER = ("inductor", "eager")
STRATEGIES = ("auto", "decompose", "fuse", "none")
FORMS = ("auto", "all_to_all", "native")
AUTO_SP = ("auto", "off")
SITE_OVERRIDABLE = ("strategy", "chunks")


@dataclass(kw_only=True, frozen=True)
class Options:
    inner: str = "inductor"
    """Compiler that runs the rewritten graphs: "inductor" or "eager" (AOTAutograd graphs run as they are)."""
    strategy: str = "auto"
    """How sites are rewritten: "auto" (the planner decides), "decompose" (chunked collectives), "fuse"
    (fused Triton kernels over symmetric memory, AG -> mm and mm -> RS sites) or "none" (find and report only)."""
    chunks: int | str = "auto"
    """Pieces each collective is split into: "auto" or an int >= 2."""
    min_bytes: int = 0
    """Sites whose collective moves fewer bytes per rank than this are left alone."""
    microbatches: int | str = "auto"
    """Cut the batch (dim 0 of the activations) into this many slices that interleave, so one slice's
    collectives hide under another's compute (attention too); 1: off; "auto": where the cost model predicts
    slices save more than row-chunked sites would. See passes/microbatch.py."""
    schedule: bool = True
    """Reorder the graph so collectives are issued as early, and waited on as late, as dependencies allow."""
    addmm_partials: bool = True
    """Sum the per-chunk partial products a rewrite builds with addmm chains (the GEMM adds into the running
    sum) instead of mm then add: one pass fewer over the output per chunk. See passes/accumulate.py."""
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per-site options: {site-name glob: {"strategy": ..., "chunks": ...}}; the first matching glob wins."""
    hardware: str | None = None
    """Cost-model profile: "cpu-local" (``overlapc calibrate``), "cpu-default", "h100-nvlink", "h200-nvlink",
    "ib-400g", or the path of a profile JSON file; None: the profile of the machine this runs on."""
    measure: bool = field(default_factory=lambda: os.environ.get("OVERLAPC_MEASURE", "1") != "0")
    """On unless the environment sets OVERLAPC_MEASURE=0 (plans that do not depend on timings, e.g. for a
    test suite). Where ``hardware`` is None: time the graph's collectives on the live process group when it is
    compiled (every rank together, cached), so the planner prices the user's own network rather than a
    profile's (overlapc/runtime/live.py). Links are timed alone; where moving bytes takes the cores the
    GEMMs need, the plan that follows can lose, and option ``adapt`` then keeps the captured graph."""
    adapt: int = 3
    """Under strategy "auto": for a graph the planner rewrote, run the rewritten program and the graph as
    captured alternately for this many timed calls each (after one warm-up call each; up to three times
    as many where the two are within 10%), then keep the one the slowest rank ran faster, on every rank
    (overlapc/runtime/adapt.py). Compiles such graphs twice. 0: off."""
    lanes: int = 0
    """Extra gloo process groups per gloo group that carry its all-gathers, so that chunked all-gathers and
    reduce-scatters are on the wire together (gloo fails with them in flight on one group); made when a graph
    that uses them is compiled (overlapc/runtime/lanes.py). 0 (the default): every collective on its group,
    gloo's collective kinds kept apart; on a shaped link that measured as fast or faster (BENCHMARKS.md,
    "Wire-bound"). Other backends ignore it."""
    reduce_scatter: str = "auto"
    """How reduce-scatters run: "all_to_all" (an all-to-all, then each rank sums the blocks it received),
    "native" (the backend's own) or "auto": all-to-all on gloo groups, whose reduce-scatter is an all-reduce
    moving twice the bytes (passes/forms.py), where the live group measured that form no slower (``measure``);
    native elsewhere and under strategy "none" without slices."""
    all_gather: str = "auto"
    """How all-gathers run: "all_to_all" (an all-to-all of W copies of the rank's input: the same bytes and
    values), "native" or "auto": all-to-all on gloo groups, whose all-gather stalls on its TCP transport and
    cannot share the wire with the lowered reduce-scatters (passes/forms.py), unless ``lanes`` carry them; as
    ``reduce_scatter`` says elsewhere."""
    auto_sp: str = "auto"
    """Automatic sequence parallelism (passes/auto_sp.py): an all-reduce followed by row-wise ops (residual
    add, norm, casts) becomes a reduce-scatter, those ops on this rank's rows, and an all-gather where whole
    rows are needed, in forward and backward, where that moves no more bytes and each rank gets enough rows
    ("auto"); "off" keeps every all-reduce."""
    timeout: float = 300.0
    """Seconds a fused op may wait for its peers before it raises an error naming the op (strategy "fuse")."""
    mode: str | None = None
    """torch.compile mode, passed to inductor ("default", "reduce-overhead", "max-autotune", ...)."""

    def __post_init__(self):
        _check_choice("inner", self.inner, INNER)
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_chunks("chunks", self.chunks)
        _check_choice("reduce_scatter", self.reduce_scatter, FORMS)
        _check_choice("all_gather", self.all_gather, FORMS)
        _check_choice("auto_sp", self.auto_sp, AUTO_SP)
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise OverlapError(f"option 'min_bytes' must be an int >= 0; got {self.min_bytes!r}")
        if self.microbatches != "auto" and (
            isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1
        ):
            raise OverlapError(
                f"option 'microbatches' must be an int >= 1 (1: off) or \"auto\"; got {self.microbatches!r}"
            )
        for name in ("schedule", "addmm_partials", "measure"):
            if not isinstance(getattr(self, name), bool):
                raise OverlapError(f"option {name!r} must be True or False; got {getattr(self, name)!r}")
        if isinstance(self.adapt, bool) or not isinstance(self.adapt, int) or self.adapt < 0:
            raise OverlapError(
                f"option 'adapt' must be an int >= 0 (timed calls per program; 0: off); got {self.adapt!r}"
            )
        if isinstance(self.lanes, bool) or not isinstance(self.lanes, int) or self.lanes < 0:
            raise OverlapError(f"option 'lanes' must be an int >= 0 (0: no lanes); got {self.lanes!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise OverlapError(f"option 'timeout' must be a number of seconds > 0; got {self.timeout!r}")
        if self.hardware is not None and not isinstance(self.hardware, str):
            raise OverlapError(f"option 'hardware' must be a profile name or a file path; got {self.hardware!r}")
        if self.hardware is not None:
            from overlapc.passes.cost import load_profile

            load_profile(self.hardware)  # a wrong name or a malformed file fails here, naming it
        if self.mode is not None and not isinstance(self.mode, str):
            raise OverlapError(f"option 'mode' must be a torch.compile mode string; got {self.mode!r}")
        if not isinstance(self.overrides, Mapping):
            raise OverlapError(
                "option 'overrides' must be a dict {site-name glob: {option: value}}; "
                f"got {type(self.overrides).__name__}"
            )
        for glob, per_site in self.overrides.items():
            if not isinstance(glob, str) or not isinstance(per_site, Mapping):
                raise OverlapError(
                    f"option 'overrides' entry {glob!r}: expected a site-name glob mapped to a dict of options"
                )
            for k, v in per_site.items():
                if k not in SITE_OVERRIDABLE:
                    raise OverlapError(
                        f"option 'overrides[{glob!r}]' sets {k!r}; per-site options allowed: "
                        + ", ".join(SITE_OVERRIDABLE)
                    )
                if k == "strategy":
                    _check_choice(f"overrides[{glob!r}].strategy", v, STRATEGIES)
                else:
                    _check_chunks(f"overrides[{glob!r}].chunks", v)
        # Frozen, hashable-by-content: store overrides as a plain dict copy.
        object.__setattr__(self, "overrides", {k: dict(v) for k, v in self.overrides.items()})

    @property
    def fixed_slices(self) -> bool:
        """Whether micro-batch slices are asked for by number (``microbatches`` an int above 1)."""
        return isinstance(self.microbatches, int) and self.microbatches > 1

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_user(cls, options: Mapping[str, Any] | Options | None = None, **kwargs) -> Options:
        """Merge a dict (or Options) with keyword options; unknown names are an OverlapError."""
        if isinstance(options, Options):
            base = dataclasses.asdict(options)
        elif options is None:
            base = {}
        elif isinstance(options, Mapping):
            base = dict(options)
        else:
            raise OverlapError(f"options must be a dict or overlapc.Options; got {type(options).__name__}")
        base.update(kwargs)
        allowed = cls.names()
        for name in base:
            if name not in allowed:
                near = difflib.get_close_matches(str(name), allowed, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise OverlapError(f"unknown option {name!r}{hint}; allowed options: " + ", ".join(allowed))
        return cls(**base)

    def unmatched_overrides(self, names) -> list[str]:
        """The ``overrides`` globs that match none of ``names`` (site names)."""
        import fnmatch

        names = list(names)
        return [g for g in self.overrides if not any(fnmatch.fnmatchcase(n, g) for n in names)]

    def for_site(self, name: str) -> dict[str, Any]:
        """strategy and chunks for one site, after per-site overrides (first matching glob wins)."""
        import fnmatch

        out = {"strategy": self.strategy, "chunks": self.chunks}
        for glob, per_site in self.overrides.items():
            if fnmatch.fnmatchcase(name, glob):
                out.update(per_site)
                break
        return out


def _check_choice(name: str, value, allowed):
    if value not in allowed:
        raise OverlapError(
            f"option {name!r} must be one of " + ", ".join(repr(a) for a in allowed) + f"; got {value!r}"
        )


def _check_chunks(name: str, value):
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise OverlapError(f"option {name!r} must be 'auto' or an int >= 2; got {value!r}")
