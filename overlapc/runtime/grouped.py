"""``overlapc::grouped_mm``: a grouped matmul of any dtype on any device, run group by group.

A dropless MoE written as a Python loop of per-expert matmuls (passes/expert_loop.py) is
rewritten into calls of this op, so that the pipeline of passes/dropless.py sees one
row-wise body with run-time group offsets, as it does for ``torch._grouped_mm``. It follows
``_grouped_mm``'s semantics for its two offset forms::

    grouped_mm(a (R, K), b (G, K, N), offs) -> (R, N)       rows [offs[g-1], offs[g]) by b[g]
    grouped_mm(a (K, R), b (R, N), offs)    -> (G, K, N)    the sum over group g's rows

``offs`` holds the groups' cumulative row counts (int32 or int64; the last is R). Each group
runs as the ``mm`` the user's loop ran, on the same rows, so the forward is bit-for-bit the
loop's; the backward is this op again (``_grouped_mm``'s own kernels take only bf16 on the
CPU and need 16-byte aligned operands on CUDA; this op has neither restriction, and no
kernel of its own either: its speed is that of the loop it replaces).
"""
from __future__ import annotations

import torch


def _ends(offs: torch.Tensor) -> list[int]:
    return [int(e) for e in offs.tolist()]


@torch.library.custom_op("overlapc::grouped_mm", mutates_args=())
def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """See the module docstring."""
    ends = _ends(offs)
    if mat_b.dim() == 3:  # rows by per-group weights
        out = mat_a.new_empty((mat_a.shape[0], mat_b.shape[-1]))
        start = 0
        for g, end in enumerate(ends):
            torch.mm(mat_a[start:end], mat_b[g], out=out[start:end])
            start = end
        return out
    out = mat_a.new_empty((len(ends), mat_a.shape[0], mat_b.shape[-1]))
    start = 0
    for g, end in enumerate(ends):  # per-group sums over rows (weight gradients)
        torch.mm(mat_a[:, start:end], mat_b[start:end], out=out[g])
        start = end
    return out


@grouped_mm.register_fake
def _(mat_a, mat_b, offs):
    _check(mat_a, mat_b, offs)
    if mat_b.dim() == 3:
        return mat_a.new_empty((mat_a.shape[0], mat_b.shape[-1]))
    return mat_a.new_empty((offs.shape[0], mat_a.shape[0], mat_b.shape[-1]))


def _check(a, b, offs):
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"overlapc::grouped_mm: offs must be a 1-D int32/int64 tensor, got {offs.dtype} "
                         f"of shape {tuple(offs.shape)}")
    if a.dim() != 2 or b.dim() not in (2, 3):
        raise ValueError(f"overlapc::grouped_mm takes (R, K) x (G, K, N) or (K, R) x (R, N); got "
                         f"{tuple(a.shape)} x {tuple(b.shape)}")
    torch._check(a.shape[1] == b.shape[-2],
                 lambda: f"overlapc::grouped_mm: inner sizes differ: {tuple(a.shape)} x {tuple(b.shape)}")
    if b.dim() == 3:
        torch._check(b.shape[0] == offs.shape[0],
                     lambda: f"overlapc::grouped_mm: {b.shape[0]} weights for {offs.shape[0]} groups")


def _setup(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    if b.dim() != 3:
        raise RuntimeError("overlapc::grouped_mm: the backward of its weight-gradient form "
                           "((K, R) x (R, N)) is not implemented (double backward)")
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = grouped_mm(grad, b.transpose(-2, -1), offs)
    if ctx.needs_input_grad[1]:
        grad_b = grouped_mm(a.t(), grad, offs)
    return grad_a, grad_b, None


grouped_mm.register_autograd(_backward, setup_context=_setup)

GROUPED_MM = torch.ops.overlapc.grouped_mm.default
