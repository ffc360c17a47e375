"""Repairs for two failures of torch's own compile stack that overlapc's compiles would hit on
torchtitan-style programs (both fail with ``backend="aot_eager"`` too).

**Saved rng states after saved opaque objects.** Activation checkpointing inside a compiled
DTensor program saves the DeviceMesh (an opaque graph input of the parallelize hooks) for the
recomputation, beside tensors. When the checkpointed region also holds a seeded op
(scaled-dot-product attention is tagged ``nondeterministic_seeded`` even without dropout),
torch's ``functionalize_rng_ops`` appends the rng states to the forward outputs after the saved
opaque objects and adds their backward placeholders after the opaque placeholders, while
AOTAutograd's runtime reads saved values as (tensors, opaque objects, symints). torch 2.13 then
fails at the first call with ``expected all tensors_saved_with_vc_check to be Tensors``.
``fix_saved_order`` moves the rng states before the opaque objects on both sides, which is the
order the runtime reads; a partition without that mix is returned as it is.

**An AsyncCollectiveTensor graph input.** A block compiled on its own whose input is
``DTensor.to_local()`` of a collective's result (the first transformer block after a
sequence-parallel embedding) receives an AsyncCollectiveTensor. AOTAutograd, traced for that
subclass, routes the input's gradient past ``to_local``'s backward, and DTensor's
redistribute backward fails on a plain tensor (``'Tensor' object has no attribute
'_local_tensor'``). ``waited_inputs`` compiles such a graph for the plain tensor instead, and
at run time hands it the waited value through a differentiable identity, so the gradient
takes the input's own path.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx


def _rng_state_outputs():
    """torch's rng-saving op and opaque-node test, or None where this torch has neither."""
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
        from torch._prims.rng_prims import run_and_save_rng_state
    except ImportError:
        return None
    return run_and_save_rng_state, is_opaque_node


def fix_saved_order(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """Put the forward's saved rng states before its saved opaque objects, and the backward's
    rng-state placeholders before its opaque placeholders, keeping each group's order. The
    forward's first ``num_fwd_outputs`` outputs are the program's own (a DTensor output brings
    its mesh among them) and stay where they are. True where the graphs changed."""
    found = _rng_state_outputs()
    if found is None:
        return False
    run_and_save, is_opaque = found

    def is_state(n: Any) -> bool:
        return (
            isinstance(n, fx.Node)
            and n.target is operator.getitem
            and getattr(n.args[0], "target", None) is run_and_save
        )

    out = next(iter(fw.graph.find_nodes(op="output")))
    own, saved = list(out.args[0][:num_fwd_outputs]), list(out.args[0][num_fwd_outputs:])
    opaque = [i for i, n in enumerate(saved) if is_opaque(n)]
    late = {i for i, n in enumerate(saved) if is_state(n) and opaque and i > opaque[0]}
    if not late:
        return False
    states = [saved[i] for i in sorted(late)]
    rest = [n for i, n in enumerate(saved) if i not in late]
    at = next(i for i, n in enumerate(rest) if is_opaque(n))
    out.args = (tuple(own + rest[:at] + states + rest[at:]),)

    # functionalize_rng_ops names the backward's rng-state placeholders in forward output order
    phs = list(bw.graph.find_nodes(op="placeholder"))
    bw_states = [p for p in phs if p.name.startswith("rng_state_output")]
    first_opaque = next((p for p in phs if is_opaque(p)), None)
    if len(bw_states) != len(states) or first_opaque is None:
        raise RuntimeError(
            f"overlapc: cannot reorder the saved rng states of an activation-checkpointed graph "
            f"({len(states)} forward, {len(bw_states)} backward)"
        )
    for p in bw_states:
        if phs.index(p) > phs.index(first_opaque):
            first_opaque.prepend(p)
    fw.recompile()
    bw.recompile()
    return True


def eager_partition(rows_pass):
    """AOTAutograd ``partition_fn`` for the eager path: ``rows_pass`` on the joint graph, torch's
    default partition (min-cut where the graph has checkpointed regions), then the repair."""

    def partition(joint, joint_inputs, **kw):
        from torch._functorch.partitioners import default_partition

        rows_pass(joint.graph)
        joint.recompile()
        fw, bw = default_partition(joint, joint_inputs, **kw)
        if "num_fwd_outputs" in kw:
            fix_saved_order(fw, bw, kw["num_fwd_outputs"])
        return fw, bw

    return partition


def inductor_partitioner(inductor_config):
    """A ``custom_partitioner_fn`` for inductor: the partitioner inductor would run (a user's
    own ``custom_partitioner_fn``, else min-cut), then the repair. None where this torch has
    no such setting."""
    try:
        from torch._inductor.custom_graph_pass import CustomPartitionerFn
    except ImportError:
        return None
    if "custom_partitioner_fn" not in inductor_config._config:
        return None
    inner = inductor_config.custom_partitioner_fn

    class Partitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kw):
            if inner is not None:
                fw, bw = inner(gm, joint_inputs, **kw)
            else:
                from torch._functorch.partitioners import min_cut_rematerialization_partition

                fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kw)
            if "num_fwd_outputs" in kw:
                fix_saved_order(fw, bw, kw["num_fwd_outputs"])
            return fw, bw

        def uuid(self):
            return None  # overlapc's inductor compiles run with fx_graph_cache off

    return Partitioner()


class _Waited(torch.autograd.Function):
    """The completed value of an AsyncCollectiveTensor as a plain tensor, with the gradient
    passed through unchanged to the input's own backward."""

    @staticmethod
    def forward(ctx, x):
        y = x.trigger_wait() if hasattr(x, "trigger_wait") else x
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _is_async(x) -> bool:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return isinstance(x, AsyncCollectiveTensor)


def waited_inputs(example_inputs) -> tuple[list, list[int]]:
    """``example_inputs`` with every AsyncCollectiveTensor replaced by a plain fake of its value
    (same sizes, strides and ``requires_grad``), and the positions replaced."""
    out, at = list(example_inputs), []
    for i, x in enumerate(out):
        if _is_async(x):
            plain = x.elem.detach()
            if x.requires_grad:
                plain.requires_grad_(True)
            out[i] = plain
            at.append(i)
    return out, at


def with_waited_args(fn, at: list[int]):
    """``fn``, compiled for ``waited_inputs``'s plain tensors at positions ``at``, called with
    the AsyncCollectiveTensors dynamo passes there (dynamo calls a backend's result with the
    graph's inputs as positional arguments)."""
    if not at:
        return fn

    def call(*args):
        args = list(args)
        for i in at:
            if _is_async(args[i]):
                args[i] = _Waited.apply(args[i])
        return fn(*args)

    return call
