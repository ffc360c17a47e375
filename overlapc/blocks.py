"""Per-block compile: name sites by the block's path in its model, and give each block its overrides.

torchtitan compiles each transformer block on its own (``block.compile(backend=...)``), so
dynamo hands the backend a graph whose module paths start at the block ("attention.wo"),
and, because parameters are graph inputs, it reuses that one graph for every block of the
same structure: the backend runs once for ``layers.1``, and ``layers.2`` and ``layers.3``
run what it returned.

Here the backend finds the block it compiles for, and its path in the model as
``model.named_modules()`` shows it, from the modules whose forwards are running when dynamo
calls the backend (the compile happens on the first call, inside the model's forward). The
outermost such module is the model. Site names then read
``forward:layers.1.attention.wo:matmul_reduce_scatter``.

The compiled program is shared by the block's siblings (modules of the same class under the
same model) unless overrides tell them apart. One program is compiled per distinct set of
resolved overrides, and each call runs its block's one, chosen by the identity of a
parameter the call passes in. The report lists every block that has run with its own
site names.
"""

from __future__ import annotations

import logging
import re
import sys
import weakref
from dataclasses import dataclass, field

import torch

from overlapc.passes.ops import strip_wrappers

log = logging.getLogger("overlapc")

# The root module's source as dynamo writes it at the start of a module path.
_ROOT_SOURCE = re.compile(r"^(?:L\['\w+'\](?:\[\d+\])*|self)")


@dataclass
class Located:
    """The module a graph was compiled for, inside the outermost module running it."""

    prefix: str
    """Its path in the model, wrappers left out ("layers.1"); "" when it is the model."""
    arg: int
    """Index of a graph input that is one of its parameters: it tells blocks apart at run time."""
    siblings: dict[str, weakref.ref] = field(default_factory=dict)
    """Path -> module of every module of its class in the model (itself included)."""


def _running_modules() -> list[torch.nn.Module]:
    """Modules whose forward is on the Python stack, innermost first, each once."""
    seen, out = set(), []
    f = sys._getframe(1)
    while f is not None:
        m = f.f_locals.get("self") if f.f_code.co_varnames[:1] == ("self",) else None
        if isinstance(m, torch.nn.Module) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
        f = f.f_back
    return out


def _param_inputs(gm: torch.fx.GraphModule) -> list[tuple[int, torch.Tensor]]:
    """(input index, tensor) of the graph's placeholders that dynamo lifted from a module."""
    out = []
    for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        ga = n.meta.get("grapharg")
        if ga is None or "_parameters" not in str(getattr(ga, "source", "")):
            continue
        try:
            t = ga.example
        except Exception:  # a weak reference that died
            continue
        if isinstance(t, torch.Tensor):
            out.append((i, t))
    return out


def locate(gm: torch.fx.GraphModule) -> Located | None:
    """The module ``gm`` was compiled for and its path in the model; None where it is not known
    (no module on the stack owns the graph's parameters)."""
    params = _param_inputs(gm)
    if not params:
        return None
    running = _running_modules()
    ids = {id(t): i for i, t in params}
    block = arg = None
    for m in running:  # innermost first: the compiled module is the first that owns them
        own = [ids[id(p)] for p in m.parameters() if id(p) in ids]
        if own:
            block, arg = m, min(own)
            break
    if block is None:
        return None
    root, prefix = block, ""
    for m in running[running.index(block) + 1 :]:
        path = next((name for name, sub in m.named_modules(remove_duplicate=False) if sub is block), None)
        if path is not None:
            root, prefix = m, strip_wrappers(path)
    loc = Located(prefix, arg)
    if prefix:
        for name, sub in root.named_modules():
            # Siblings that are compiled on their own (module.compile(), or torch.compile's
            # wrapper in the module's place) are the ones that may run this graph.
            compiled = (
                getattr(sub, "_compiled_call_impl", None) is not None
                or isinstance(sub, torch._dynamo.eval_frame.OptimizedModule)
                or name.endswith("._orig_mod")
            )
            if type(sub) is type(block) and (sub is block or compiled):
                loc.siblings.setdefault(strip_wrappers(name), weakref.ref(sub))
    return loc


def with_prefix(gm: torch.fx.GraphModule, prefix: str) -> None:
    """Put ``prefix`` in front of every module path ``gm``'s nodes record, so that the
    ATen graphs AOTAutograd derives from it carry the block's path in the model. Subgraphs
    count too: a checkpointed region's body is one."""
    for n in _all_nodes(gm):
        stack = n.meta.get("nn_module_stack")
        if not stack:
            continue
        out = {}
        for key, (path, *rest) in stack.items():
            m = _ROOT_SOURCE.match(path)
            if m is not None:
                path = f"{m.group(0)}.{prefix}{path[m.end() :]}"
            out[key] = (path, *rest)
        n.meta["nn_module_stack"] = out


def _all_nodes(gm: torch.fx.GraphModule):
    """The nodes of ``gm`` and of every graph module it holds (higher-order ops' bodies)."""
    for sub in gm.modules():
        if isinstance(sub, torch.fx.GraphModule):
            yield from sub.graph.nodes


def _reprefix(path: str, old: str, new: str) -> str:
    """``path`` (a module path, or one followed by ":...") under block ``new`` instead of ``old``."""
    if path == old or path.startswith((old + ".", old + ":")):
        return new + path[len(old) :]
    return path


def rename(name: str, old: str, new: str) -> str:
    """Site name ``name`` of block ``old`` as block ``new``'s: "forward:layers.1.wo:x" -> "forward:layers.2.wo:x"."""
    graph, sep, rest = name.partition(":")
    return f"{graph}{sep}{_reprefix(rest, old, new)}"


def module_paths(gm: torch.fx.GraphModule) -> set[str]:
    """Module paths in ``gm`` relative to the compiled module ("" for the module itself)."""
    from overlapc.passes import ops

    out = {""}
    for n in _all_nodes(gm):
        p = ops.module_path(n)
        if p and n.meta.get("nn_module_stack") and len(n.meta["nn_module_stack"]) > 1:
            parts = p.split(".")
            out.update(".".join(parts[: i + 1]) for i in range(len(parts)))  # a site may name an ancestor
    return out


def signature(opts, prefix: str, rel: set[str]) -> tuple:
    """What the overrides resolve to for every site a block at ``prefix`` could have: blocks
    with equal signatures can run one compiled program."""
    from .report import GRAPHS, PATTERNS

    if not opts.overrides:
        return ()
    names = (f"{g}:{prefix}{'.' + r if r else ''}:{p}" for g in GRAPHS for r in sorted(rel) for p in PATTERNS)
    return tuple(tuple(sorted(opts.for_site(n).items())) for n in names)


class Serving:
    """The blocks one compiled program runs for: its rows in the report appear under each."""

    def __init__(self, prefix: str, potential: list[str]):
        self.prefix = prefix
        self.potential = potential
        """Every sibling that may run this program (for the unmatched-override check)."""
        self.aliases: list[str] = []
        self.rows: list = []
        self.fn = None
        """The compiled program."""

    def copies(self, rows, prefixes) -> list:
        import dataclasses

        return [
            dataclasses.replace(
                r,
                name=rename(r.name, self.prefix, q),
                module=None if r.module is None else _reprefix(r.module, self.prefix, q),
            )
            for q in prefixes
            for r in rows
        ]

    def names(self, rows) -> list[str]:
        return [rename(r.name, self.prefix, q) for q in self.potential for r in rows]


class PerBlock:
    """What the backend returns for a graph dynamo may share among sibling blocks: runs each
    call with its block's program, compiling a group's program at the group's first call, and
    lists a block in the report at its first call."""

    def __init__(self, loc: Located, programs: dict[str, Serving], add_rows, make):
        self.loc = loc
        self.programs = programs
        """Sibling path -> the Serving whose program it runs."""
        self.first = programs[loc.prefix]
        self._by_param: dict[int, tuple[weakref.ref, str | None]] = {}
        self._seen: set[str] = {loc.prefix}
        self._add_rows = add_rows
        self._make = make
        self._warned = False

    def _block_of(self, t) -> str | None:
        hit = self._by_param.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        # New parameter objects (FSDP's unsharded ones, a reloaded state): look again.
        self._by_param.clear()
        for path, ref in self.loc.siblings.items():
            m = ref()
            for p in m.parameters() if m is not None else ():
                self._by_param[id(p)] = (weakref.ref(p), path)
        hit = self._by_param.get(id(t))
        if hit is None or hit[0]() is not t:
            self._by_param[id(t)] = hit = (weakref.ref(t), None)  # of no block: do not look again
        return hit[1]

    def program(self, args) -> tuple[str | None, Serving]:
        """(block path, Serving) of the program a call with graph inputs ``args`` runs."""
        path = self._block_of(args[self.loc.arg])
        return path, self.programs.get(path, self.first) if path is not None else self.first

    def __call__(self, *args):
        path, serving = self.program(args)
        if path is None and not self._warned:
            self._warned = True
            log.info("overlapc: a call of the graph compiled for %s with parameters of no known block", self.loc.prefix)
        elif path is not None and path not in self._seen:
            self._seen.add(path)
            if serving.fn is None:  # the first call of its group: compile it, named for this block
                self._make(serving, path)
            else:
                serving.aliases.append(path)
                self._add_rows(serving.copies(serving.rows, [path]))
        return serving.fn(*args)


def compile_per_block(gm, loc: Located, opts, compile_one, add_rows):
    """Compile ``gm`` for block ``loc``; its siblings whose overrides resolve otherwise get
    their own program at their first call (dynamo reuses ``gm`` for them, or compiles them
    anew where it guards on the block's identity: then they never call this one).

    ``compile_one(gm, serving)`` compiles one copy of the graph; ``add_rows(rows)`` adds report
    rows. Every rank compiles the same programs in the same order (ranks call blocks in step)."""
    from overlapc.passes.build import copy_graph_module

    rel = module_paths(gm)
    groups: dict[tuple, list[str]] = {}
    for p in [loc.prefix] + [p for p in loc.siblings if p != loc.prefix]:
        groups.setdefault(signature(opts, p, rel), []).append(p)
    programs = {}
    for members in groups.values():
        serving = Serving(members[0], members)
        for p in members:
            programs[p] = serving

    def make(serving: Serving, prefix: str) -> None:
        g = copy_graph_module(gm)
        with_prefix(g, prefix)
        serving.prefix = prefix
        serving.fn = compile_one(g, serving)

    make(programs[loc.prefix], loc.prefix)
    if not loc.siblings.keys() - {loc.prefix}:
        return programs[loc.prefix].fn
    return PerBlock(loc, programs, add_rows, make)
