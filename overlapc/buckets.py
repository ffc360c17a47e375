"""Dynamic shapes: one plan per shape bucket, each compiled once with symbolic sizes.

With ``torch.compile(dynamic=True)`` (or after dynamo marks a dim dynamic on a
recompile), the backend gets a graph whose sizes are symbols. overlapc's plan depends on
sizes (whether a site pays, how many chunks), so the backend returns a dispatcher:

- a call's **bucket** is, per size symbol, the power-of-two range its value falls in
  ([2^(k-1), 2^k); 0 and 1 stand alone). The planner decides for the bucket at its
  representative value (the range's midpoint, 3 * 2^(k-2)): a pure function of the bucket
  and the options, the same on every rank.
- the first call in a bucket compiles the graph with fresh symbolic inputs: the rewrites
  keep their size arithmetic symbolic (chunk c of a site with R rows is rows
  [R*w_<c // T, R*w_<=c // T), the last chunk takes the remainder), so the result serves
  every size of the bucket that satisfies its **guards**: what the compile assumed about
  the sizes (R at least the chunk weights' total, a scattered dim divisible by the world
  size, ...), recorded by the bucket's own ShapeEnv.
- each call runs the first compiled entry of its bucket whose guards hold for its sizes;
  none: a new entry is compiled (same plan, other guards).

Dynamo's own guards stay in charge of everything else (dtypes, devices, static dims).
"""
from __future__ import annotations

import logging
import threading

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
            log.info("overlapc: a %s input has dynamic sizes: no shape buckets for this graph",
                     type(v).__name__)
            return None
    return vals


def _is_symbolic(v) -> bool:
    if isinstance(v, torch.SymInt):
        return not v.node.expr.is_number
    if isinstance(v, torch.Tensor):
        return any(isinstance(d, torch.SymInt) and not d.node.expr.is_number for d in v.shape)
    return False


def bucket_of(value: int) -> tuple[int, int]:
    """(lower bound, representative) of the power-of-two range holding ``value``."""
    if value < 2:
        return value, value
    low = 1 << (value.bit_length() - 1)
    return low, max(low, 3 * low // 2)


class Entry:
    def __init__(self, compiled, guards: str | None, shape_env, keep: list[int]):
        self.compiled, self.guards, self.shape_env, self.keep = compiled, guards, shape_env, keep

    def accepts(self, args) -> bool:
        if self.guards is None:
            return True
        return self.shape_env.evaluate_guards_expression(self.guards, [args[i] for i in self.keep])


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
        self._lock = threading.Lock()

    # -- per call
    def __call__(self, *args):
        key = self.key(args)
        for entry in self.entries.get(key, ()):
            if entry.accepts(args):
                return entry.compiled(*args)
        with self._lock:
            entry = self._compile(args, key)
        return entry.compiled(*args)

    def key(self, args) -> tuple:
        out = []
        for v, a in zip(self.example_values, args):
            if isinstance(v, torch.SymInt) and not v.node.expr.is_number:
                out.append(bucket_of(int(a))[0])
            elif isinstance(v, torch.Tensor) and isinstance(a, torch.Tensor):
                out.extend(bucket_of(int(a.shape[d]))[0] for d, s in enumerate(v.shape)
                           if isinstance(s, torch.SymInt) and not s.node.expr.is_number)
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
        fakes = []

        def note(sym, value):
            e = sym.node.expr if isinstance(sym, torch.SymInt) else None
            if e is not None and e.is_Symbol:
                reps.setdefault(e, bucket_of(value)[1])

        for i, (v, a) in enumerate(zip(self.example_values, args)):
            src = LocalSource(f"t{i}")
            if isinstance(v, torch.SymInt) and not v.node.expr.is_number:
                sym = env.create_symbol(int(a), src, dynamic_dim=DimDynamic.DUCK)
                node = env.create_symintnode(sym, hint=int(a), source=src)
                note(node, int(a))
                fakes.append(node)
            elif isinstance(a, torch.Tensor):
                dyn = [DimDynamic.DUCK if isinstance(s, torch.SymInt) and not s.node.expr.is_number
                       else DimDynamic.STATIC for s in (v.shape if isinstance(v, torch.Tensor) else a.shape)]
                if DimDynamic.DUCK not in dyn:
                    fake = mode.from_tensor(a, source=src, static_shapes=True)
                else:  # a plain tensor: symbolic_inputs() kept subclasses with dynamic sizes out
                    ctx = StatelessSymbolicContext(dynamic_sizes=dyn, constraint_sizes=[None] * a.dim())
                    fake = mode.from_tensor(a, source=src, symbolic_context=ctx)
                for size, real in zip(fake.shape, a.shape):
                    note(size, int(real))
                fakes.append(fake)
            else:
                fakes.append(a)
        with shape_bucket(reps):
            compiled = self.compile_fn(self.gm, fakes)
        # Guards over the size-carrying inputs (a placeholder may also hold e.g. a DeviceMesh).
        # Tensor subclasses (DTensor parameters) are static here: dynamo guards them.
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass
        keep = [i for i, f in enumerate(fakes) if isinstance(f, torch.SymInt)
                or (isinstance(f, torch.Tensor) and not is_traceable_wrapper_subclass(f))]
        guards = env.produce_guards_expression([fakes[i] for i in keep])
        entry = Entry(compiled, guards, env, keep)
        self.entries.setdefault(key, []).append(entry)
        self.compiles += 1
        log.info("overlapc: compiled shape bucket %s (%d entries); guards: %s", key,
                 self.compiles, guards or "none")
        if not entry.accepts(args):  # the compile's own guards must hold for the call that made it
            raise RuntimeError(f"overlapc: the entry compiled for bucket {key} rejects its own sizes "
                               f"(guards {guards})")
        return entry
