"""Dynamic shapes: one plan per shape bucket, each compiled once with symbolic sizes.

With ``torch.compile(dynamic=True)`` (or after dynamo marks a dim dynamic on a
recompile), the backend gets a graph whose sizes are symbols. overlapc's plan depends on
sizes (whether a site pays, how many chunks), so the backend returns a dispatcher:

- a call's **bucket** is, per size symbol, the power-of-two range its value falls in
  ([2^(k-1), 2^k); values below 2 stand alone). The planner decides for the bucket at its
  lower bound (the smallest size in it, so every chunk count it allows fits every size):
  a pure function of the bucket and the options, the same on every rank.
- the first call in a bucket compiles the graph with fresh symbolic inputs: the rewrites
  keep their size arithmetic symbolic (chunk c of a site with R rows is rows
  [R*w_<c // T, R*w_<=c // T), the last chunk takes the remainder), so the result serves
  every size of the bucket that satisfies its **guards**: what the compile assumed about
  the sizes (R at least the chunk weights' total, a scattered dim divisible by the world
  size, ...), recorded by the bucket's own ShapeEnv.
- each call runs the first compiled entry of its bucket whose guards hold for its sizes;
  none: a new entry is compiled (same plan, other guards).
- at most ``torch._dynamo.config.recompile_limit`` entries (8) per graph, as dynamo bounds
  its own recompiles: a call that would need one more runs the graph as captured (eager,
  no rewrite, its collectives whole) and says so once in a warning. Every rank sees the
  same sizes in the same order in SPMD code, so all ranks fall back on the same call.

Dynamo's own guards stay in charge of everything else (dtypes, devices, static dims).
"""

from __future__ import annotations

import logging
import threading
import warnings

import torch

log = logging.getLogger("overlapc")


def symbolic_inputs(gm: torch.fx.GraphModule) -> list | None:
    """The dynamo graph's placeholder example values when any size is symbolic, else None."""
    vals = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        vals.append(n.meta.get("example_value", n.meta.get("val")))
    if not any(_is_symbolic(v) for v in vals):
        return None
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for v in vals:
        if isinstance(v, torch.Tensor) and is_traceable_wrapper_subclass(v) and _is_symbolic(v):
            # Re-fakeifying a subclass needs its inner tensors' contexts: compile once with
            # dynamo's symbols instead; sites with symbolic sizes are then reported, not rewritten.
            log.info("overlapc: a %s input has dynamic sizes: no shape buckets for this graph", type(v).__name__)
            return None
    return vals


def _symbolic(d) -> bool:
    """A size (or int input) that is a symbol, not a number."""
    return isinstance(d, torch.SymInt) and not d.node.expr.is_number


def _is_symbolic(v) -> bool:
    return _symbolic(v) or (isinstance(v, torch.Tensor) and any(_symbolic(d) for d in v.shape))


def entry_limit() -> int:
    """Compiled entries per bucketed graph: dynamo's own recompile limit."""
    import torch._dynamo.config as dc

    return int(getattr(dc, "recompile_limit", None) or getattr(dc, "cache_size_limit", 8))


def bucket_of(value: int) -> int:
    """The power-of-two range holding ``value``, by its lower bound (values below 2 alone).

    The lower bound is also what the planner decides at: the smallest size of the bucket,
    so a chunk count it allows fits every size of the bucket, and a dim that is a power of
    two (a model width marked dynamic) is planned at its own value."""
    if value < 2:
        return value
    return 1 << (value.bit_length() - 1)


class Entry:
    def __init__(self, compiled, guards: str | None, keep: list[int]):
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        self.compiled, self.guards, self.keep = compiled, guards, keep
        # What ShapeEnv.evaluate_guards_expression evals, compiled once: it runs on every call.
        self._code = compile(guards, "<overlapc bucket guards>", "eval") if guards else None
        self._globals = SYMPY_INTERP

    def accepts(self, args) -> bool:
        if self._code is None:
            return True
        return bool(eval(self._code, self._globals, {"L": {f"t{i}": args[j] for i, j in enumerate(self.keep)}}))


# One lock for every bucketed graph: compiles run one at a time in a process, and each
# compile exchanges its plan with the other ranks (overlapc/agree.py) in the same order.
_COMPILE_LOCK = threading.RLock()


class BucketedGraph:
    """The callable the backend returns for a graph with symbolic sizes."""

    def __init__(self, gm: torch.fx.GraphModule, example_values: list, compile_fn):
        self.gm = gm
        self.example_values = example_values
        self.compile_fn = compile_fn
        """compile_fn(gm, fake_inputs) -> callable: the backend's static path (AOTAutograd +
        passes + inner compiler), run inside the bucket's shape context."""
        self.entries: dict[tuple, list[Entry]] = {}
        self.compiles = 0
        self.fell_back = 0
        """Calls run uncompiled because the entry limit was reached."""
        self._sizes = {
            d.node.expr
            for v in example_values
            if isinstance(v, torch.Tensor)
            for d in v.shape
            if isinstance(d, torch.SymInt)
        }
        """Dynamo's size symbols: an int input that is none of them is a plain scalar, guarded
        but not bucketed (the plan depends on sizes only)."""

    # -- per call
    def __call__(self, *args):
        key = self.key(args)
        entry = self._find(key, args)
        if entry is None:
            with _COMPILE_LOCK:
                entry = self._find(key, args)  # another thread may have compiled it
                if entry is None:
                    if self.compiles >= entry_limit():
                        self._note_fallback(key)
                    else:
                        entry = self._compile(args, key)
            if entry is None:  # run outside the lock: the graph issues collectives
                return self.gm(*args)
        return entry.compiled(*args)

    def _note_fallback(self, key):
        if not self.fell_back:
            warnings.warn(
                f"overlapc: this graph already has {self.compiles} shape-bucket entries "
                f"(torch._dynamo.config.recompile_limit = {entry_limit()}); sizes in bucket {key} and any "
                "other new ones run the captured graph without overlap (eager). Raise the limit, or mark "
                "fewer dims dynamic, to compile them.",
                stacklevel=4,
            )
        self.fell_back += 1

    def _find(self, key, args) -> Entry | None:
        for entry in self.entries.get(key, ()):
            if entry.accepts(args):
                return entry
        return None

    def key(self, args) -> tuple:
        out = []
        for v, a in zip(self.example_values, args):
            if isinstance(v, torch.SymInt) and v.node.expr in self._sizes:
                out.append(bucket_of(int(a)))
            elif isinstance(v, torch.Tensor) and isinstance(a, torch.Tensor):
                out.extend(bucket_of(int(a.shape[d])) for d, s in enumerate(v.shape) if _symbolic(s))
        return tuple(out)

    # -- compile one entry
    def _compile(self, args, key) -> Entry:
        from torch._dynamo.source import LocalSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        from overlapc.passes.ops import shape_bucket

        env = ShapeEnv()
        mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=False)
        reps: dict = {}
        fresh: dict = {}  # dynamo's size symbol -> this bucket's SymInt for it

        def note(sym, value):
            e = sym.node.expr if isinstance(sym, torch.SymInt) else None
            if e is not None and e.is_Symbol:
                reps.setdefault(e, bucket_of(value))

        # Tensors first: one new symbol per dynamic dim (no duck sizing: sizes that happen to
        # be equal at this call, a batch of 512 and a width of 512, stay apart; sizes dynamo
        # knows equal become guards where the graph relies on it).
        fakes: list = [None] * len(args)
        for i, (v, a) in enumerate(zip(self.example_values, args)):
            if not isinstance(a, torch.Tensor):
                continue
            shape = v.shape if isinstance(v, torch.Tensor) else a.shape
            dyn = [DimDynamic.DYNAMIC if _symbolic(d) else DimDynamic.STATIC for d in shape]
            src = LocalSource(f"t{i}")
            if DimDynamic.DYNAMIC not in dyn:
                fake = mode.from_tensor(a, source=src, static_shapes=True)
            else:  # a plain tensor: symbolic_inputs() kept subclasses with dynamic sizes out
                ctx = StatelessSymbolicContext(dynamic_sizes=dyn, constraint_sizes=[None] * a.dim())
                fake = mode.from_tensor(a, source=src, symbolic_context=ctx)
                for d, size, real in zip(shape, fake.shape, a.shape):
                    if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
                        fresh.setdefault(d.node.expr, size)
                    note(size, int(real))
            fakes[i] = fake
        for i, (v, a) in enumerate(zip(self.example_values, args)):
            if isinstance(a, torch.Tensor):
                continue
            if _symbolic(v):
                if v.node.expr in fresh:  # a size dynamo passes as an input: that dim's symbol
                    fakes[i] = fresh[v.node.expr]
                    continue
                # A Python int argument: any sign.
                src = LocalSource(f"t{i}")
                sym = env.create_symbol(int(a), src, dynamic_dim=DimDynamic.DYNAMIC, positive=None)
                fakes[i] = env.create_symintnode(sym, hint=int(a), source=src)
                note(fakes[i], int(a))
            else:
                fakes[i] = a
        from torch._functorch import config as functorch_config

        # The backward too is compiled now, inside the bucket: AOTAutograd may otherwise
        # defer it to the first backward(), outside it (no rewrites, guards not recorded).
        lazy = (
            {"force_non_lazy_backward_lowering": True}
            if hasattr(functorch_config, "force_non_lazy_backward_lowering")
            else {}
        )
        with shape_bucket(reps), functorch_config.patch(lazy):
            compiled = self.compile_fn(self.gm, fakes)
        # Guards over the size-carrying inputs (a placeholder may also hold e.g. a DeviceMesh).
        # Tensor subclasses (DTensor parameters) are static here: dynamo guards them.
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        keep = [
            i
            for i, f in enumerate(fakes)
            if isinstance(f, torch.SymInt) or (isinstance(f, torch.Tensor) and not is_traceable_wrapper_subclass(f))
        ]
        guards = _guard_expression(env, [fakes[i] for i in keep])
        entry = Entry(compiled, guards, keep)
        self.entries.setdefault(key, []).append(entry)
        self.compiles += 1
        log.info("overlapc: compiled shape bucket %s (%d entries); guards: %s", key, self.compiles, guards or "none")
        if not entry.accepts(args):  # the compile's own guards must hold for the call that made it
            raise RuntimeError(f"overlapc: the entry compiled for bucket {key} rejects its own sizes (guards {guards})")
        return entry


def _guard_expression(env, placeholders) -> str | None:
    """The ShapeEnv's guards over ``placeholders`` (named t0, t1, ...) as one expression.

    Each guard is parenthesised: a guard can itself be a disjunction ("a == 1 or b == 0"),
    and ShapeEnv.produce_guards_expression joins them with a bare " and ", which would
    then read "x and a == 1 or b == 0" and accept sizes the entry was not compiled for."""
    from torch._dynamo.source import LocalSource

    guards = env.produce_guards(
        placeholders, [LocalSource(f"t{i}") for i in range(len(placeholders))], ignore_static=True
    )
    return " and ".join(f"({g})" for g in guards) or None
