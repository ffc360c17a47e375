"""explain(): what would the backend do with this model, without running a collective.

The model runs once under a FakeTensorMode, with its parameters, buffers and inputs
replaced by fake tensors of the same shapes, dtypes and placements. Dynamo and
AOTAutograd capture the forward graph (and, where anything requires grad, the backward
graph, lowered eagerly rather than on the first backward call), and the passes run on
them exactly as in the backend. Fake tensors carry no data, so no collective moves a
byte: explain is safe on one rank of a real job, in a notebook, or on a fake process
group.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from .compiler import Backend
from .errors import OverlapError
from .options import Options
from .report import Report


def explain(fn: Callable | torch.nn.Module, *args, options: dict | Options | None = None, **kwargs) -> Report:
    """Capture ``fn(*args, **kwargs)`` and report every matmul-collective site.

    Returns a :class:`Report`; ``str(report)`` is a table, ``report.to_json()`` JSON.
    The passes run on the AOTAutograd graphs (what ``inner="eager"`` rewrites); with
    ``inner="inductor"`` the backend matches on inductor's post-grad graphs, where the
    same sites appear after inductor's own decompositions.
    """
    return capture(fn, *args, options=options, **kwargs)[0]


def capture(
    fn: Callable | torch.nn.Module, *args, options: dict | Options | None = None, **kwargs
) -> tuple[Report, list[tuple[str, torch.fx.GraphModule]]]:
    """explain(), plus the (kind, rewritten GraphModule) of every graph captured."""
    opts = Options.from_user(options)
    if not callable(fn):
        raise OverlapError(f"explain() takes a module or a function; got {type(fn).__name__}")
    report = Report()
    # no collective runs: neither plan agreement nor measuring the live group
    backend = Backend(
        dataclasses.replace(opts, inner="eager", measure=False), report, keep_graphs=True, verify_plans=False
    )
    module = fn if isinstance(fn, torch.nn.Module) else None
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def to_fake(t: torch.Tensor):
        f = fake_mode.from_tensor(t)
        if isinstance(t, torch.nn.Parameter):
            f = torch.nn.Parameter(f, requires_grad=t.requires_grad)
        return f

    lazy_bw = _eager_backward_lowering()
    with fake_mode, lazy_bw, _no_recompile_limit():
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, to_fake, (args, kwargs))
        state = {}
        if module is not None:
            state = {k: to_fake(v) for k, v in _state(module).items()}
        # Static shapes: the report is about these inputs (automatic dynamic shapes would
        # otherwise kick in when explain() sees a second shape of the same code).
        compiled = torch.compile(fn, backend=backend, dynamic=False)
        with _reparametrize(module, state):
            out = compiled(*fake_args, **fake_kwargs)
            if lazy_bw is _NO_EAGER_LOWERING:
                _run_backward(out, list(state.values()) + pytree.tree_leaves((fake_args, fake_kwargs)))
    report.unmatched_overrides = opts.unmatched_overrides(s.name for s in report.sites)
    return report, backend.graphs


def _no_recompile_limit():
    """Every explain() compiles ``fn`` afresh with a new backend, and dynamo caches per code
    object: past its recompile limit (8 on torch 2.11-2.13) it would run the ninth capture of
    the same forward eagerly, the backend would never see a graph and the report would list
    no sites, silently. Lift the limit for this capture, and make hitting it anyway an error."""
    from torch._dynamo import config as dynamo_config

    names = dynamo_config._config if hasattr(dynamo_config, "_config") else vars(dynamo_config)
    patch = {}
    for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if limit in names:
            patch[limit] = max(getattr(dynamo_config, limit), 1 << 16)
    for fail in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if fail in names:
            patch[fail] = True
    return dynamo_config.patch(**patch)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


def _reparametrize(module, state):
    if module is None or not state:
        return contextlib.nullcontext()
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, state, tie_weights=True)


_NO_EAGER_LOWERING = contextlib.nullcontext()


def _eager_backward_lowering():
    """Compile backward graphs with the forward (torch >= 2.12 has the switch)."""
    from torch._functorch import config as functorch_config

    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return functorch_config.patch(force_non_lazy_backward_lowering=True)
    return _NO_EAGER_LOWERING


def _run_backward(out: Any, fake_leaves: list):
    """Older torch: trigger the lazy backward compile with a backward on fake tensors only."""
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    inputs = [t for t in fake_leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs and inputs:
        torch.autograd.grad(outs, inputs, [torch.ones_like(t) for t in outs], allow_unused=True)
